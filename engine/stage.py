"""One pipeline stage: its layers, and the forward (F), recompute (R) and backward (B) tasks.

A stage keeps, per micro-batch, either the graph of its forward (to run backward on later) or,
when the micro-batch is checkpointed, only its input (to recompute the graph just before backward).
Its backward is run explicitly by the stage's own worker with `torch.autograd.backward`, from the
gradient the next stage sent back, so stages run their backwards in parallel.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from .batchnorm import StageBatchNorm, batch_norm_layers
from .device import StageDevice
from .memory import ActivationLedger
from .microbatch import Value, as_leaves, detached, rebuild, tensors_of
from .partition import Partition
from .rng import StageRandomness
from .schedule import Task
from .trace import Event
from .transport import message_key


@dataclass
class StepPlan:
    """What every stage needs to know about the current call, shared read-only by the workers."""

    inputs: list            # micro-batch inputs, as cut from the caller's batch
    targets: Optional[list]  # micro-batch targets; None for a forward-only call
    loss_fn: Optional[Callable]
    weights: list[float]     # each micro-batch's share of the mini-batch, for the loss
    checkpointed: list[bool]
    base_seed: int
    training: bool           # True for step(): keep graphs and run backward
    record_memory: bool


@dataclass
class StageState:
    """What one stage holds between its tasks during one call; dropped when the call ends."""

    kept_inputs: dict = field(default_factory=dict)   # micro -> input kept for recompute
    graphs: dict = field(default_factory=dict)        # micro -> (input, output or loss) with graph
    outputs: dict = field(default_factory=dict)       # micro -> output (last stage, forward-only)
    losses: dict = field(default_factory=dict)        # micro -> detached loss (last stage)


class Stage:
    """Layers `first .. first+len-1` of the model, placed on one device."""

    def __init__(self, index: int, count: int, partition: Partition, first: int,
                 device: StageDevice, deferred_batch_norm: bool):
        self.index = index
        self.count = count
        self.is_first = index == 0
        self.is_last = index == count - 1
        self.partition = partition
        self.layer_ids = list(range(first, first + len(partition)))
        self.device = device
        bn_layers = batch_norm_layers(partition)
        self.batch_norm = StageBatchNorm(bn_layers, deferred_batch_norm) if bn_layers else None
        self._has_batch_norm = [bool(batch_norm_layers(layer)) for layer in partition]
        self.ledger = ActivationLedger()
        self.randomness = StageRandomness(list(zip(self.layer_ids, partition)))
        self.state = StageState()
        self.plan: Optional[StepPlan] = None

    def parameters(self) -> list[nn.Parameter]:
        return list(self.partition.parameters())

    def event(self, task: Task, start, end, timed: bool = False) -> Event:
        """The trace event of a task that ran between two marks (`timed`: marks still to be read
        as seconds, which on CUDA waits for the GPU)."""
        if timed:
            start, end = self.device.seconds(start), self.device.seconds(end)
        return Event(self.index, task.micro, task.op, start, end, str(self.device.device))

    def start(self, plan: StepPlan, t0: float) -> None:
        """Reset per-call state before the workers start."""
        self.state = StageState()
        self.ledger = ActivationLedger(self.parameters())
        self.device.start(t0)
        if self.batch_norm is not None:
            self.batch_norm.start_step()
        self.randomness.start(plan.base_seed)
        self.plan = plan

    def finish(self) -> None:
        """Drop everything the call kept: graphs, kept inputs, outputs and the plan."""
        self.state = StageState()
        self.plan = None

    # --- tasks -----------------------------------------------------------------------------

    def run(self, task: Task, received) -> Optional[tuple[int, tuple, Value]]:
        """Run one task. `received` is what the upstream stage sent for it (activation for F on a
        later stage, gradient for B on an earlier one), else None. Returns the message for a
        neighbouring stage, (stage, key, value), if the task produced one."""
        return {"F": self._forward, "R": self._recompute, "B": self._backward}[task.op](task.micro, received)

    def _forward(self, micro: int, received):
        plan, state = self.plan, self.state
        x = self.device.to_here(plan.inputs[micro]) if self.is_first else self.device.receive(received)
        if not plan.training:
            with torch.no_grad():
                out = self._layers(x, micro)
            if self.is_last:
                state.outputs[micro] = out
                return None
            return self.index + 1, message_key(Task("F", micro)), out
        if not self.is_first:
            x = as_leaves(x)
        keep_graph = not plan.checkpointed[micro]
        with torch.set_grad_enabled(keep_graph):
            out = self._layers(x, micro)
            loss = self._loss(out, micro) if self.is_last else None
        if keep_graph:
            state.graphs[micro] = (x, loss if self.is_last else out)
        else:
            held = self.ledger.hold_all(tensors_of(x)) if plan.record_memory else []
            state.kept_inputs[micro] = (x, held)
        if self.is_last:
            state.losses[micro] = loss.detach()
            return None
        return self.index + 1, message_key(Task("F", micro)), detached(out)

    def _recompute(self, micro: int, received) -> None:
        x, held = self.state.kept_inputs.pop(micro)
        recomputing = self.batch_norm.recomputing() if self.batch_norm is not None else nullcontext()
        with torch.enable_grad(), recomputing:
            out = self._layers(x, micro)
            if self.is_last:
                out = self._loss(out, micro)
        self.state.graphs[micro] = (x, out)
        del held  # the recomputed graph now holds what it needs of the input

    def _backward(self, micro: int, received):
        x, out = self.state.graphs.pop(micro)
        if self.is_last:
            roots = [out]
            grads = [torch.tensor(self.plan.weights[micro], dtype=out.dtype, device=out.device)]
        else:
            grads_out = tensors_of(self.device.receive(received))
            pairs = [(o, g) for o, g in zip(tensors_of(out), grads_out) if g is not None and o.requires_grad]
            roots, grads = [o for o, _ in pairs], [g for _, g in pairs]
        del out
        if roots:
            torch.autograd.backward(roots, grads)
        if self.is_first:
            return None
        input_grads = tuple(t.grad if t.requires_grad else None for t in tensors_of(x))
        return self.index - 1, message_key(Task("B", micro)), rebuild(x, input_grads)

    # --- helpers ---------------------------------------------------------------------------

    def _layers(self, x: Value, micro: int) -> Value:
        """Run this stage's layers on one micro-batch, under the stage's random streams, batch norm
        control (only around the layers that need them: each costs Python calls per op) and ledger."""
        if self.batch_norm is not None:
            self.batch_norm.micro = micro
        counting = self.plan.record_memory and torch.is_grad_enabled()

        def each_layer(x: Value) -> Value:
            for layer_id, layer, has_bn in zip(self.layer_ids, self.partition, self._has_batch_norm):
                with self.batch_norm if has_bn else nullcontext():
                    x = self.randomness.run(layer_id, layer, x, micro)
            return x

        with self.ledger.saving() if counting else nullcontext(), self.partition.running(each_layer) as partition:
            return partition(x)  # through nn.Module.__call__, so hooks on the partition run

    def _loss(self, output: Value, micro: int) -> torch.Tensor:
        target = self.device.to_here(self.plan.targets[micro])
        loss = self.plan.loss_fn(output, target)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"loss_fn must return a scalar tensor (mean over the micro-batch), got {loss!r}")
        return loss.reshape(())
