"""One chunk of a pipeline's layers and its tasks: forward (F), recompute (R), backward (B) and,
for schedules that split the backward, the weight gradient (W).

A stage holds one chunk, or several (interleaved, ZB-V). Per micro-batch a chunk keeps the graph of
its forward, or, when the micro-batch is checkpointed, only its input, to recompute the graph just
before the backward, which its own stage runs from the gradient the next chunk sent back.

Split backward (zero-bubble schedules): the forward notes the output of every module that owns
parameters; B computes, in one pass, the gradient of the chunk's input (sent upstream at once) and of
those outputs, keeping the graph; W computes each module's weight gradients from its output's.
Nothing is computed twice, but the graph and those gradients are held from B to W.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import Optional

import torch
from torch import nn

from .batchnorm import StageBatchNorm, batch_norm_layers
from .call import Call
from .device import StageDevice
from .memory import ActivationLedger, Holding
from .microbatch import Value, as_leaves, detached, rebuild, tensors_of
from .partition import Partition
from .rng import StageRandomness, remove_when_gone
from .schedule import Task
from .trace import Event
from .transport import message_key


@dataclass
class ChunkState:
    """What one chunk holds between its tasks during one call; dropped when the call ends."""

    kept_inputs: dict = field(default_factory=dict)   # micro -> input kept for recompute
    graphs: dict = field(default_factory=dict)        # micro -> (input, output or loss, layer outputs, holding)
    outputs: dict = field(default_factory=dict)       # micro -> output (last chunk, forward-only)
    losses: dict = field(default_factory=dict)        # micro -> detached loss (last chunk)
    weight_work: dict = field(default_factory=dict)   # micro -> (per layer (roots, gradients, parameters), holding)


class Chunk:
    """Chunk `index` of `count`: layers `first .. first+len-1` of the model, on its stage's device."""

    def __init__(self, index: int, count: int, partition: Partition, first: int,
                 device: StageDevice, deferred_batch_norm: bool, stage: int, autocast: Optional[torch.dtype] = None):
        self.index = index
        self.count = count
        self.stage = stage  # the stage that runs this chunk
        self.is_first = index == 0
        self.is_last = index == count - 1
        self.partition = partition
        self.layer_ids = list(range(first, first + len(partition)))
        self.device = device
        self.autocast = autocast
        bn_layers = batch_norm_layers(partition)
        self.batch_norm = StageBatchNorm(bn_layers, deferred_batch_norm) if bn_layers else None
        self._has_batch_norm = [bool(batch_norm_layers(layer)) for layer in partition]
        self._capture: Optional[tuple[int, list]] = None  # (thread, list of (module, output)) while noting
        self._owners = [m for m in partition.modules() if any(p is not None for p in m._parameters.values())]
        self._noting = False  # whether the owners' forward hooks that note outputs are registered
        self.ledger = ActivationLedger()
        self.randomness = StageRandomness(list(zip(self.layer_ids, partition)))
        self.state = ChunkState()
        self.call: Optional[Call] = None

    def parameters(self) -> list[nn.Parameter]:
        """Read afresh from the modules that own them (found once: a walk of the module tree per
        call cost more than a near-empty model's step)."""
        return list(dict.fromkeys(p for m in self._owners for p in m._parameters.values() if p is not None))

    def event(self, task: Task, start, end, timed: bool = False) -> Event:
        """The trace event of a task that ran between two marks (`timed`: marks still to be read
        as seconds, which on CUDA waits for the GPU)."""
        host = self.device.host_seconds(end) - self.device.host_seconds(start)
        if timed:
            start, end = self.device.seconds(start), self.device.seconds(end)
        return Event(self.stage, task.micro, task.op, start, end, str(self.device.device), task.chunk, host)

    def start(self, call: Call, ledger: ActivationLedger) -> None:
        """Reset per-call state before the stages start; `ledger` counts the activations of every
        chunk of this chunk's stage (their sum is what the stage's device holds)."""
        self.state = ChunkState()
        self.ledger = ledger
        if call.training and call.split_backward and not self._noting:  # from the first call that splits
            me = weakref.ref(self)  # its backward: a hook costs every other call of the module microseconds
            remove_when_gone(self, [m.register_forward_hook(partial(_note_output, me)) for m in self._owners])
            self._noting = True
        if self.batch_norm is not None:
            self.batch_norm.start_step()
        self.randomness.start(call.decision.seed)
        self.call = call

    def finish(self) -> None:
        """Drop everything the call kept: graphs, kept inputs, outputs and the call itself (what a
        failed call left held in the ledger is released with them)."""
        state = self.state
        for holding in [graph[3] for graph in state.graphs.values()] \
                + [kept for _, kept in state.kept_inputs.values()] + [held for _, held in state.weight_work.values()]:
            self._release(holding)
        self.randomness.finish()
        self.state = ChunkState()
        self.call = None

    # --- tasks -----------------------------------------------------------------------------

    def run(self, task: Task, received) -> Optional[tuple[int, tuple, Value]]:
        """Run one task. `received` is what the upstream chunk sent for it (activation for F on a
        later chunk, gradient for B on an earlier one; already safe to use on this stage), else
        None. Returns the message for a neighbouring chunk, (chunk, key, value), if the task produced
        one. F and R run under the chunk's autocast alike."""
        if self.autocast is not None and task.op in "FR":
            with torch.autocast(self.device.device.type, dtype=self.autocast, cache_enabled=False):
                return self.TASKS[task.op](self, task.micro, received)
        return self.TASKS[task.op](self, task.micro, received)

    def _message(self, kind: str, micro: int, value: Value) -> tuple[int, tuple, Value]:
        destination = self.index + 1 if kind == "F" else self.index - 1
        return destination, message_key(Task(kind, micro, destination)), value

    def _forward(self, micro: int, received):
        call, state = self.call, self.state
        x = self.device.to_here(call.inputs[micro]) if self.is_first else received
        if not call.training:
            with torch.no_grad():
                out, _ = self._layers(x, micro)
            if self.is_last:
                state.outputs[micro] = out
                return None
            return self._message("F", micro, out)
        if not self.is_first:
            x = as_leaves(x)
        keep_graph = (self.index, micro) not in call.recomputed
        noted = [] if keep_graph and call.split_backward else None
        with torch.set_grad_enabled(keep_graph):
            out, holding = self._graph(x, micro, noted, loss=keep_graph)  # a recomputed one's loss: in R
        if keep_graph:
            state.graphs[micro] = (x, out, noted, holding)
        else:
            state.kept_inputs[micro] = (x, self.ledger.hold_all(tensors_of(x)) if call.record_memory else None)
        if self.is_last:
            return None
        return self._message("F", micro, detached(out))

    def _recompute(self, micro: int, received) -> None:
        x, kept = self.state.kept_inputs[micro]
        noted = [] if self.call.split_backward else None
        with torch.enable_grad():
            if self.batch_norm is None:
                out, holding = self._graph(x, micro, noted)
            else:
                with self.batch_norm.recomputing():
                    out, holding = self._graph(x, micro, noted)
        self.state.graphs[micro] = (x, out, noted, holding)
        del self.state.kept_inputs[micro]
        self._release(kept)  # the recomputed graph now holds what it needs of the input

    def _graph(self, x: Value, micro: int, noted: Optional[list], loss: bool = True):
        """The layers on one micro-batch and, on the last chunk (if `loss`), the loss, noted as the
        micro-batch's. Returns (the output or loss, what the ledger holds), released on a failure."""
        out, holding = self._layers(x, micro, noted)
        if not (self.is_last and loss):
            return out, holding
        try:
            out = self._loss(out, micro)
        except BaseException:
            self._release(holding)
            raise
        self.state.losses[micro] = out.detach()
        return out, holding

    def _backward(self, micro: int, received):
        x, out, noted, holding = self.state.graphs.pop(micro)
        if self.is_last:  # a loss that depends on no parameter or input (a parameter-free model) has no backward
            roots = [out] if out.requires_grad else []
            grads = [out.new_full((), self.call.weights[micro])][:len(roots)]  # no host-to-GPU copy
        else:
            grads_out = tensors_of(received)
            pairs = [(o, g) for o, g in zip(tensors_of(out), grads_out) if g is not None and o.requires_grad]
            roots, grads = [o for o, _ in pairs], [g for _, g in pairs]
        del out
        inputs = [] if self.is_first else [t for t in tensors_of(x) if t.requires_grad]
        if noted is not None:
            input_grads = self._backward_inputs(micro, roots, grads, inputs, noted, holding)
        else:
            if roots:
                torch.autograd.backward(roots, grads)
            input_grads = {id(t): t.grad for t in inputs}
            self._release(holding)  # the backward freed the graph
        if self.is_first:
            return None
        return self._message("B", micro, rebuild(x, tuple(input_grads.get(id(t)) for t in tensors_of(x))))

    def _backward_inputs(self, micro: int, roots, grads, inputs, noted, holding) -> dict:
        """B of a split backward: one pass for the gradients of the chunk's input and of every noted
        module output (the graph kept for W); returns {id(input tensor): its gradient}. The work W
        will do, per module call, is filed as (its output tensors, their gradients, its parameters),
        with what the ledger holds of the graph (W frees it)."""
        outputs = {id(t): t for _, out in noted for t in tensors_of(out) if t.requires_grad}
        wanted = inputs + [t for key, t in outputs.items() if key not in {id(i) for i in inputs}]
        gradients = torch.autograd.grad(roots, wanted, grads, retain_graph=True, allow_unused=True) \
            if roots and wanted else [None] * len(wanted)
        found = dict(zip(map(id, wanted), gradients))
        work = []
        for module, out in noted:
            pairs = [(t, found.get(id(t))) for t in tensors_of(out)]
            pairs = [(t, g) for t, g in pairs if g is not None]
            if pairs:
                parameters = [p for p in module.parameters(recurse=False) if p.requires_grad]
                work.append(([t for t, _ in pairs], [g for _, g in pairs], parameters))
        self.state.weight_work[micro] = (work, holding)
        return {id(t): found[id(t)] for t in inputs}

    def _weights(self, micro: int, received) -> None:
        """W of a split backward: each module's weight gradients, from its output's gradient."""
        work, holding = self.state.weight_work.pop(micro)
        for roots, grads, parameters in work:
            if parameters:
                torch.autograd.backward(roots, grads, inputs=parameters)
        del work
        self._release(holding)

    # --- helpers ---------------------------------------------------------------------------

    def _layers(self, x: Value, micro: int, noted: Optional[list] = None) -> tuple[Value, Optional[Holding]]:
        """Run this chunk's layers on one micro-batch, under its random streams, batch norm control
        (only around the layers that need them: each costs Python calls per op) and ledger; append
        (module, output) of every parameter-owning module to `noted` if given (for a split backward).
        Returns the output and what the ledger holds of its graph (None when not counting)."""
        if self.batch_norm is not None:
            self.batch_norm.micro = micro
        counting = self.call.record_memory and torch.is_grad_enabled()

        randomness, key = self.randomness, micro + self.call.micro_offset
        quiet = randomness.quiet  # layers known to draw nothing: called as they are, at no cost

        def each_layer(x: Value) -> Value:
            for layer_id, layer, has_bn in zip(self.layer_ids, self.partition, self._has_batch_norm):
                if has_bn:
                    with self.batch_norm:
                        x = randomness.run(layer_id, layer, x, key)
                else:
                    x = layer(x) if layer_id in quiet else randomness.run(layer_id, layer, x, key)
            return x

        self._capture = None if noted is None else (threading.get_ident(), noted)
        try:
            with self.partition.running(each_layer) as partition:
                if not counting:
                    return partition(x), None  # through nn.Module.__call__, so hooks on the partition run
                with self.ledger.saving(watch=noted is not None) as holding:
                    out = partition(x)
                return out, holding
        finally:
            self._capture = None

    def _release(self, holding: Optional[Holding]) -> None:
        if holding is not None:
            self.ledger.release(holding)

    TASKS = {"F": _forward, "R": _recompute, "B": _backward, "W": _weights}  # op -> what runs it

    def _loss(self, output: Value, micro: int) -> torch.Tensor:
        target = self.device.to_here(self.call.targets[micro])
        loss = self.call.loss_fn(output, target)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"loss_fn must return a scalar tensor (mean over the micro-batch), got {loss!r}")
        return loss.reshape(())


def _note_output(stage: weakref.ref, module: nn.Module, args, output) -> None:
    """Forward hook of a parameter-owning module: note its output while its chunk's stage runs a
    forward for a split backward (and never for anyone else's calls of the module)."""
    owner = stage()
    if owner is not None and owner._capture is not None and owner._capture[0] == threading.get_ident():
        owner._capture[1].append((module, output))
