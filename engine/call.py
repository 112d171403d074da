"""One call of a pipe, a training step or a forward pass, planned once before any stage runs it.

The first stage decides two numbers for a call, the mini-batch's size and the base seed of its
random streams (`Decision`); every other figure follows from them and the pipe's settings, so a
stage in another process needs only the decision (it travels in the header of the first
activation) to plan the very same call. `GPipe` makes the `Call`; runners only execute it.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Optional

from .schedule import Task


@dataclass(frozen=True)
class Decision:
    """What the first stage decides for a call: samples in the mini-batch, base seed (64-bit)."""

    batch: int
    seed: int


def micro_batch_sizes(batch: int, micro_batches: int) -> list[int]:
    """Samples per micro-batch as torch.chunk cuts `batch` into at most `micro_batches` pieces (it
    may give fewer: 5 in 4 gives 2, 2, 1; 3 in 4 gives 1, 1, 1)."""
    size = -(-batch // micro_batches)
    return [min(size, batch - start) for start in range(0, batch, size)]


@dataclass(frozen=True)
class Call:
    """Everything the stages need to know about one call, shared read-only by them."""

    kind: str                        # "step" (forward and backward) or "forward"
    decision: Decision
    sizes: tuple[int, ...]           # samples per micro-batch
    schedule: list[list[Task]]       # every stage's task list
    checkpoint: object               # the pipe's checkpoint mode, or one per stage (for the trace)
    recomputed: frozenset            # (chunk, micro-batch) pairs kept as their input, recomputed before backward
    record_memory: bool
    inputs: Optional[list] = None    # micro-batch inputs, where the first chunk runs
    targets: Optional[list] = None   # micro-batch targets, where the last chunk runs (steps only)
    loss_fn: Optional[Callable] = None
    micro_offset: int = 0            # this replica's first micro-batch in the global numbering (random streams)

    @property
    def training(self) -> bool:
        return self.kind == "step"

    @property
    def micro_batches(self) -> int:
        return len(self.sizes)

    @cached_property
    def weights(self) -> list[float]:
        """Each micro-batch's share of the mini-batch: its loss is scaled by it, so the gradients are
        those of the mean loss over the whole mini-batch."""
        return [n / self.decision.batch for n in self.sizes]

    @cached_property
    def split_backward(self) -> bool:
        """Whether the schedule has separate W tasks (then B computes no weight gradients)."""
        return any(task.op == "W" for tasks in self.schedule for task in tasks)
