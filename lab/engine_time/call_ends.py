"""A call's two ends, timed alike for any pipeline: from the call to its first layer's first forward,
and from its first layer's last gradient to the call's return. On the first stage these are what a
call spends outside the model's work at its start and at its end (planning, splitting the batch,
and whatever a call does once its backward is over), with no help from the implementation: a
forward pre-hook and a gradient hook on the model's own first layer, in whichever process runs it.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

from torch import nn


class Ends:
    """Hooks on `layer` (the model's first, on the stage that runs it) that note when a step first
    enters it and when its first parameter's gradient is last accumulated."""

    def __init__(self, layer: nn.Module):
        parameter = next((p for p in layer.parameters() if p.requires_grad), None)
        if parameter is None:
            raise ValueError(f"the first layer {type(layer).__name__} has no trainable parameter to watch")
        self.first: Optional[float] = None
        self.last: Optional[float] = None
        self._hooks = [layer.register_forward_pre_hook(self._entered),
                       parameter.register_post_accumulate_grad_hook(self._accumulated)]

    def _entered(self, module, args) -> None:
        if self.first is None:
            self.first = time.perf_counter()

    def _accumulated(self, parameter) -> None:
        self.last = time.perf_counter()

    def timed(self, step: Callable[[], object]) -> tuple[float, float]:
        """Run one training step; seconds (before its first layer's forward, after its last gradient)."""
        self.first = self.last = None
        start = time.perf_counter()
        step()
        end = time.perf_counter()
        if self.first is None or self.last is None:
            raise RuntimeError("the step never ran the watched layer's forward and backward")
        return self.first - start, end - self.last

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


def median_ends(layer: Optional[nn.Module], step: Callable[[], object], count: int,
                before_each: Callable[[], object] = lambda: None) -> Optional[tuple[float, float]]:
    """Median seconds before the first layer and after its last gradient over `count` steps
    (`before_each` runs untimed ahead of each, e.g. zeroing gradients). With no `layer` (a process
    that does not run the first layer) the steps run untimed and None comes back."""
    ends = Ends(layer) if layer is not None else None
    try:
        times = []
        for _ in range(count):
            before_each()
            times.append(ends.timed(step) if ends is not None else step())
    finally:
        if ends is not None:
            ends.close()
    return None if ends is None else median_pair(times)


def stage_ends(pipe, inputs, targets, loss_fn: Callable, count: int) -> Optional[tuple[float, float]]:
    """In a stage process (ProcessPool.apply): `count` training steps of its pipe; on the rank that
    runs the model's first layer, the median seconds before that layer and after its last gradient,
    else None."""
    first = pipe.partitions[0][0] if 0 in pipe.local_chunks else None
    return median_ends(first, lambda: pipe.step(inputs, targets, loss_fn), count,  # the trace is not read
                       before_each=pipe.zero_grad)


def pool_ends(pool, inputs, targets, loss_fn: Callable, count: int) -> tuple[float, float]:
    """`stage_ends` in every stage process of a ProcessPool: the answer of the one that runs the
    first layer."""
    answers = pool.apply(stage_ends, [(inputs if rank == 0 else None, targets, loss_fn, count)
                                      for rank in range(pool.stages)])
    return next(answer for answer in answers if answer is not None)


def median_pair(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    """The median of each side of (before, after) pairs."""
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
