"""Choosing the stage boundaries: profile each layer, then split so the costliest stage is cheapest."""
from __future__ import annotations

import copy
from itertools import accumulate
from typing import Sequence

import torch
from torch import nn

from .memory import ActivationLedger
from .microbatch import Value, as_leaves, detached, tensors_of
from .partition import check_module
from .pipe import GPipe


def balance_by_time(partitions: int, module: nn.Sequential, sample: Value, repeat: int = 3) -> list[int]:
    """Layers per stage that even out forward+backward time, measured on `sample` (a micro-batch).

    The layers are timed on a copy of the model in training mode (what training costs, whatever
    mode the model is in), one layer per stage, exactly as the engine runs them; the model's mode,
    weights, running statistics and the global random state are left alone.
    """
    return solve(layer_times(module, sample, repeat), partitions)


def balance_by_size(partitions: int, module: nn.Sequential, sample: Value, param_scale: float = 2.0) -> list[int]:
    """Layers per stage that even out memory: activations saved for backward in training mode,
    measured on `sample` with copies of the layers, plus `param_scale` times the parameter bytes
    (2 = weights and their gradients). The model itself, its mode included, is left alone."""
    return solve(layer_sizes(module, sample, param_scale), partitions)


def solve(costs: Sequence[float], partitions: int) -> list[int]:
    """Split `costs` into `partitions` consecutive non-empty runs minimizing the largest run's sum."""
    layers = len(costs)
    if isinstance(partitions, bool) or not isinstance(partitions, int) or not 1 <= partitions <= layers:
        raise ValueError(f"partitions={partitions!r}: expected an int between 1 and the {layers} layers")
    prefix = [0.0, *accumulate(costs)]
    inf = float("inf")
    # best[k][i]: smallest possible largest stage when the first i layers form k stages
    best = [[inf] * (layers + 1) for _ in range(partitions + 1)]
    cut = [[0] * (layers + 1) for _ in range(partitions + 1)]
    best[0][0] = 0.0
    for k in range(1, partitions + 1):
        for i in range(k, layers - (partitions - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    counts, i = [], layers
    for k in range(partitions, 0, -1):
        counts.append(i - cut[k][i])
        i = cut[k][i]
    return counts[::-1]


def layer_times(module: nn.Sequential, sample: Value, repeat: int = 3) -> list[float]:
    """Forward+backward seconds of each layer of `module`, as the engine runs it, on `sample`.

    A copy of the model runs as a pipeline of one layer per stage, one task at a time, so each
    layer is timed with everything a stage adds around it (batch norm control, random streams,
    the activation ledger, the hand-over between stages). Each layer keeps its shortest time
    over `repeat` steps after a warm-up: noise on a shared host only ever adds time.
    """
    check_module(module)
    sandbox = copy.deepcopy(module).train()
    device = tensors_of(sample)[0].device
    batch = tensors_of(sample)[0].shape[0]
    pipe = GPipe(sandbox, [1] * len(sandbox), devices=[device] * len(sandbox), chunks=1, checkpoint="never")
    best = [float("inf")] * len(sandbox)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for step in range(repeat + 1):
                pipe.step(sample, torch.zeros(batch), _probe_loss, serial=True)
                if step == 0:
                    continue  # warm-up
                costs = [0.0] * len(sandbox)
                for event in pipe.trace.events:
                    costs[event.stage] += event.end - event.start
                best = [min(b, c) for b, c in zip(best, costs)]
    finally:
        pipe.close()
    return best


def _probe_loss(output: Value, _target: torch.Tensor) -> torch.Tensor:
    """A stand-in loss for profiling: the mean of every float output."""
    return sum(t.float().mean() for t in tensors_of(output) if t.is_floating_point())


def layer_sizes(module: nn.Sequential, sample: Value, param_scale: float = 2.0,
                count_inputs: bool = True) -> list[float]:
    """Bytes of each layer: activations autograd saves on `sample`, plus param_scale x parameter bytes.

    Each layer is a copy in training mode, fed the previous copy's output. With `count_inputs=False`
    a layer's own input is left out when it saves it: in a chain, that input is the previous layer's
    output and is counted there (or kept by the stage).
    """
    check_module(module)
    costs, x = [], sample
    with torch.random.fork_rng(devices=[t.device for t in tensors_of(sample) if t.is_cuda]):
        for layer in module:
            layer, x = copy.deepcopy(layer).train(), as_leaves(x)
            params = list(layer.parameters())
            ledger = ActivationLedger(params + ([] if count_inputs else list(tensors_of(x))))
            with ledger.saving():
                out = layer(x)
            costs.append(ledger.peak + param_scale * sum(p.numel() * p.element_size() for p in params))
            x = detached(out)
    return costs
