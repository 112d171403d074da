"""Batch norm inside a pipeline: no double counting on recompute, and deferred running statistics.

In training every micro-batch is normalized with its own statistics (that is what the layer sees).
What needs care is the running mean/var:
- plain mode: each micro-batch updates them as a batch of its own; a recompute must not update
  them a second time;
- deferred mode (`deferred_batch_norm=True`): running stats are updated once per mini-batch, to
  the statistics of the whole mini-batch, exactly as nn.BatchNorm run on the whole batch would.
A thread-local function mode on each stage intercepts `F.batch_norm` to do this without
replacing the model's layers.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

_BN_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")


def batch_norm_layers(module: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """Every batch norm layer inside `module` that keeps running statistics."""
    return [m for m in module.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]


class StageBatchNorm(TorchFunctionMode):
    """Function mode for one stage: use `with control:` around forwards, `recomputing()` around R."""

    def __init__(self, layers: list[nn.modules.batchnorm._BatchNorm], deferred: bool):
        super().__init__()
        self.layers = layers
        self.deferred = deferred
        self.micro = 0
        self._recomputing = False
        self._by_buffer = {id(m.running_mean): m for m in layers}
        self._chunks: dict[nn.Module, dict[int, tuple[int, torch.Tensor, torch.Tensor]]] = {}
        self._counts_at_start: list[torch.Tensor] = []

    def start_step(self) -> None:
        """Forget last step's micro-batch statistics and remember the batch counters."""
        self._chunks = {m: {} for m in self.layers}
        self._counts_at_start = [m.num_batches_tracked.clone() for m in self.layers]

    @contextmanager
    def recomputing(self):
        """Within this block forwards leave running statistics and batch counters untouched."""
        counts = [m.num_batches_tracked.clone() for m in self.layers]
        self._recomputing = True
        try:
            yield
        finally:
            self._recomputing = False
            for m, count in zip(self.layers, counts):
                m.num_batches_tracked.copy_(count)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.batch_norm:
            return func(*args, **kwargs)
        bound = dict(zip(_BN_ARGS, args), **kwargs)
        layer = self._by_buffer.get(id(bound.get("running_mean")))
        if layer is None or not bound.get("training", False):
            return func(*args, **kwargs)
        if self.deferred:
            if not self._recomputing:
                self._chunks[layer][self.micro] = _chunk_statistics(bound["input"])
            bound.update(running_mean=None, running_var=None)
        elif self._recomputing:  # same kernel as the forward, but its update lands on copies
            bound.update(running_mean=bound["running_mean"].clone(), running_var=bound["running_var"].clone())
        return func(**bound)

    @torch.no_grad()
    def finish_step(self) -> None:
        """Deferred mode: fold the micro-batch statistics into one update per layer for the mini-batch."""
        if not self.deferred:
            return
        for layer, start in zip(self.layers, self._counts_at_start):
            chunks = [self._chunks[layer][m] for m in sorted(self._chunks[layer])]
            if not chunks:
                continue
            count, mean, var = _combine(chunks)
            layer.num_batches_tracked.copy_(start + 1)
            factor = layer.momentum if layer.momentum is not None else 1.0 / float(start + 1)
            unbiased = var * count / max(count - 1, 1)
            layer.running_mean.mul_(1 - factor).add_(mean.to(layer.running_mean.dtype), alpha=factor)
            layer.running_var.mul_(1 - factor).add_(unbiased.to(layer.running_var.dtype), alpha=factor)


def _chunk_statistics(x: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(sample count, per-channel mean, per-channel biased variance) of one micro-batch."""
    with torch.no_grad():
        dims = [d for d in range(x.dim()) if d != 1]
        var, mean = torch.var_mean(x, dim=dims, unbiased=False)
    return x.numel() // x.shape[1], mean.double(), var.double()  # combined in float64


def _combine(chunks) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Merge per-chunk (count, mean, biased var) into the whole batch's (parallel-variance formula)."""
    total = sum(n for n, _, _ in chunks)
    mean = sum(n * mu for n, mu, _ in chunks) / total
    sq = sum(n * (var + (mu - mean) ** 2) for n, mu, var in chunks)
    return total, mean, sq / total
