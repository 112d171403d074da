"""What a task does, counted instead of timed: floating-point operations and operator calls.

A timing says how long a task took on this host at that moment; a count says what the task is, on
any host. Lessons judge their claims about the shape of the work (stage 0's backward skips its
input gradient, the last stage also computes the loss, a recompute repeats the forward, early
convolutions cost more than late ones) on these counts, and show the timings beside them as what
this host measured.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from engine.partition import even_balance
from lab.config import RunConfig
from lab.runs.experiments import build, micro_sample


@dataclass(frozen=True)
class Count:
    """The floating-point operations of a task (matrix products and convolutions, as
    torch.utils.flop_counter counts them) and its operator calls (every ATen call)."""

    flops: int
    ops: int


class _OperatorCalls(TorchDispatchMode):
    """Counts the ATen operators called while it is active."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


class _Counting:
    """Counts FLOPs and operator calls of what runs inside `with`; `.count` afterwards."""

    def __enter__(self) -> "_Counting":
        self._flops, self._calls = FlopCounterMode(display=False), _OperatorCalls()
        self._flops.__enter__()
        self._calls.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._calls.__exit__(*exc)
        self._flops.__exit__(*exc)
        self.count = Count(int(self._flops.get_total_flops()), self._calls.calls)


def stage_counts(config: RunConfig, balance: list[int] = None) -> dict[tuple[int, str], Count]:
    """(stage, "F") and (stage, "B") -> the Count of one micro-batch's forward and backward on that
    stage, the model cut by `balance` (equal layer counts if None). Stage 0's input is the data,
    which needs no gradient; the last stage's forward includes the loss, and its backward the loss's
    gradient, as in the engine."""
    model, (inputs, targets), loss_fn = build(config)
    balance = balance or even_balance(config.layers, config.stages)
    x, target = micro_sample(inputs, config), targets.chunk(config.micro_batches)[0]
    counts, first = {}, 0
    for stage, size in enumerate(balance):
        layers = nn.Sequential(*model[first:first + size])
        first += size
        last = stage == len(balance) - 1
        given = x.detach().requires_grad_(x.is_floating_point() and stage > 0)
        with _Counting() as forward:
            out = layers(given)
            loss = loss_fn(out, target) if last else None
        with _Counting() as backward:
            if last:
                loss.backward()
            else:
                out.backward(torch.ones_like(out))
        counts[(stage, "F")], counts[(stage, "B")] = forward.count, backward.count
        x = out.detach()
    return counts


def layer_flops(config: RunConfig) -> list[int]:
    """Per layer, the FLOPs of one micro-batch's forward and backward through it alone (its input
    needing a gradient, as inside a pipe): what each layer's cost is made of, on any host."""
    model, (inputs, _), _ = build(config)
    x, flops = micro_sample(inputs, config), []
    for layer in model:
        given = x.detach().requires_grad_(x.is_floating_point())
        with _Counting() as counting:
            out = layer(given)
            out.backward(torch.ones_like(out))
        flops.append(counting.count.flops)
        x = out.detach()
    return flops
