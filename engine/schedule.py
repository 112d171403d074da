"""Pipeline schedules as pure functions of (stages K, micro-batches M, checkpoint mode, chunks v).

A schedule is one ordered task list per stage. Each stage runs its own list in order;
the data dependencies between chunks (activations forward, gradients backward) do the rest. A
different schedule is only a different task order: the engine stays the same.

The model is cut into K*v consecutive chunks of layers; chunk c lives on stage c % K (v = 1: chunk k
is stage k). A task is (op, micro-batch, chunk) with op "F" (forward), "R" (recompute the forward of
a micro-batch kept only as its input), "B" (backward; with a separate "W" it computes only the
gradient of the chunk's input and of what lies between its layers) or "W" (the gradient of the
weights, deferred).

- gpipe: every forward, then every backward (fill, drain): Huang et al., 2019.
- 1f1b: one forward, one backward after a short fill (PipeDream-Flush: Narayanan et al., ICML 2021,
  "Memory-Efficient Pipeline-Parallel DNN Training"): the same time as GPipe, but stage k holds at
  most K-k micro-batches instead of M.
- interleaved: 1F1B over v chunks per stage (Narayanan et al., 2021, Megatron-LM): the fill and
  drain pass through smaller chunks, so the bubble shrinks about v-fold; needs M a multiple of K.
- zb-h1: 1F1B with each backward split into B and W, the first W's of stage k deferred to fill
  the drain (Qi et al., 2023, "Zero Bubble Pipeline Parallelism", schedule ZB-H1): at most K
  micro-batches in flight on any stage, 1F1B's bound, and about a third of its bubble.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

CHECKPOINT_MODES = ("always", "except_last", "never")


class Task(NamedTuple):
    """One unit of work for one stage: op "F", "R", "B" or "W" on micro-batch `micro` of `chunk`."""

    op: str
    micro: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.op}{self.micro}"


def check_checkpoint_mode(mode: str) -> str:
    """Return `mode` if it is a known checkpoint mode, else raise a ValueError naming the choices."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint={mode!r} is not a checkpoint mode; expected one of {CHECKPOINT_MODES}")
    return mode


def checkpointed(micro: int, micro_batches: int, mode: str) -> bool:
    """Whether a micro-batch is re-materialized (forward without graph, recomputed before backward).

    "except_last" spares the last micro-batch: its backward starts right after its forward on the
    last stage, so keeping its activations costs little and saves one recompute (torchgpipe's choice).
    """
    check_checkpoint_mode(mode)
    return mode == "always" or (mode == "except_last" and micro < micro_batches - 1)


def owner(chunk: int, stages: int) -> int:
    """The stage that holds `chunk`: chunks are dealt round-robin (Megatron's loop placement)."""
    return chunk % stages


def upstream(task: Task, chunks: int) -> Optional[Task]:
    """The task of another chunk that must finish before `task` can start, if any.

    A forward needs the previous chunk's forward of the same micro-batch (its input activation);
    a backward needs the next chunk's backward of it (the gradient of its output). Recompute and
    weight-gradient tasks use what their own chunk kept, so they wait only for its earlier tasks.
    """
    if task.op == "F" and task.chunk > 0:
        return Task("F", task.micro, task.chunk - 1)
    if task.op == "B" and task.chunk < chunks - 1:
        return Task("B", task.micro, task.chunk + 1)
    return None


def check_layout(name: str, stages: int, micro_batches: Optional[int], virtual: int,
                 layers: Optional[int] = None) -> None:
    """The one check of how chunks are laid out, for the pipe, the schedules and the lab: several
    chunks per stage (v) only with "interleaved", which needs v >= 2 and M a multiple of K
    (Megatron-LM's rule); K*v chunks need at least as many layers."""
    if isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < 1:
        raise ValueError(f"virtual_stages={virtual!r}: expected an int >= 1 (chunks of layers per stage)")
    if micro_batches is not None and (stages < 1 or micro_batches < 1):
        raise ValueError(f"need stages >= 1 and micro_batches >= 1, got {stages} and {micro_batches}")
    if name != "interleaved":
        if virtual != 1:
            raise ValueError(f"virtual_stages={virtual}: only schedule='interleaved' places several chunks on a stage")
        return
    if virtual < 2:
        raise ValueError(f"virtual_stages={virtual}: schedule='interleaved' needs at least 2 chunks per stage")
    if micro_batches is not None and micro_batches % stages:
        raise ValueError(f"schedule='interleaved' needs M (micro-batches, chunks=) to be a multiple of K={stages}, "
                         f"as Megatron-LM requires; got M={micro_batches}: use M={stages * -(-micro_batches // stages)}")
    if layers is not None and stages * virtual > layers:
        raise ValueError(f"{stages} stages x virtual_stages={virtual} = {stages * virtual} chunks but the model has "
                         f"only {layers} layers; expected at most one chunk per layer")


def _backward(micro: int, micro_batches: int, checkpoint: str, chunk: int) -> list[Task]:
    """A micro-batch's backward on a chunk, preceded by its recompute if it was checkpointed."""
    recompute = [Task("R", micro, chunk)] if checkpointed(micro, micro_batches, checkpoint) else []
    return recompute + [Task("B", micro, chunk)]


def gpipe(stages: int, micro_batches: int, checkpoint: str = "except_last", virtual: int = 1) -> list[list[Task]]:
    """GPipe: every forward, then every backward in reverse micro-batch order (the drain mirrors the
    fill); a checkpointed micro-batch gets its recompute "R" immediately before its backward "B"."""
    check_layout("gpipe", stages, micro_batches, virtual)
    return [[Task("F", m, k) for m in range(micro_batches)] +
            [t for m in reversed(range(micro_batches)) for t in _backward(m, micro_batches, checkpoint, k)]
            for k in range(stages)]


def one_f_one_b(stages: int, micro_batches: int, checkpoint: str = "except_last", virtual: int = 1) -> list[list[Task]]:
    """1F1B (PipeDream-Flush): stage k runs K-1-k forwards to fill the pipe, then alternates one
    forward with one backward, then drains the remaining backwards, in micro-batch order. Same work
    and the same synchronous update as GPipe, but a stage never holds more than K-k micro-batches."""
    check_layout("1f1b", stages, micro_batches, virtual)
    plans = []
    for k in range(stages):
        warmup = min(stages - 1 - k, micro_batches)
        tasks = [Task("F", m, k) for m in range(warmup)]
        for i in range(micro_batches - warmup):
            tasks += [Task("F", warmup + i, k)] + _backward(i, micro_batches, checkpoint, k)
        for i in range(micro_batches - warmup, micro_batches):
            tasks += _backward(i, micro_batches, checkpoint, k)
        plans.append(tasks)
    return plans


def interleaved(stages: int, micro_batches: int, checkpoint: str = "except_last", virtual: int = 2) -> list[list[Task]]:
    """Interleaved 1F1B (Megatron-LM): stage k holds chunks k, k+K, ..., k+(v-1)K. Forwards go in
    groups of K micro-batches through one chunk after the other; backwards in the same groups from
    the last chunk back. Stage k fills with 2(K-1-k) + (v-1)K forwards, then alternates, then drains.
    Megatron requires M to be a multiple of K, so that every group is full; so does this engine."""
    check_layout("interleaved", stages, micro_batches, virtual)
    total = micro_batches * virtual

    def micro_of(i: int) -> int:
        return (i // (stages * virtual)) * stages + i % stages

    def chunk_of(i: int, k: int, backward: bool) -> int:
        local = (i // stages) % virtual
        return (virtual - 1 - local if backward else local) * stages + k

    plans = []
    for k in range(stages):
        warmup = min(2 * (stages - 1 - k) + (virtual - 1) * stages, total)
        forward = [Task("F", micro_of(i), chunk_of(i, k, False)) for i in range(total)]
        backward = [_backward(micro_of(i), micro_batches, checkpoint, chunk_of(i, k, True)) for i in range(total)]
        tasks = forward[:warmup]
        for i in range(total - warmup):
            tasks += [forward[warmup + i]] + backward[i]
        for i in range(total - warmup, total):
            tasks += backward[i]
        plans.append(tasks)
    return plans


def zb_h1(stages: int, micro_batches: int, checkpoint: str = "except_last", virtual: int = 1) -> list[list[Task]]:
    """ZB-H1: 1F1B's order with each backward split into B (input gradient, sent upstream at once)
    and W (weight gradient). Stage k keeps its first k W's pending, so in the drain, where 1F1B's
    stage k idles while it waits for gradients, it has W's to run; every later B is followed by the
    oldest pending W. At most K micro-batches are in flight on a stage (forward done, W not yet)."""
    check_layout("zb-h1", stages, micro_batches, virtual)
    plans = []
    for k in range(stages):
        warmup = min(stages - 1 - k, micro_batches)
        tasks = [Task("F", m, k) for m in range(warmup)]
        backwards = weights = 0

        def next_backward() -> None:
            nonlocal backwards, weights
            tasks.extend(_backward(backwards, micro_batches, checkpoint, k))
            backwards += 1
            if backwards - weights > k:  # more than k W's pending: run the oldest
                tasks.append(Task("W", weights, k))
                weights += 1

        for forward in range(warmup, micro_batches):
            tasks.append(Task("F", forward, k))
            next_backward()
        while backwards < micro_batches:
            next_backward()
        tasks += [Task("W", m, k) for m in range(weights, micro_batches)]
        plans.append(tasks)
    return plans


SCHEDULES: dict[str, Callable[..., list[list[Task]]]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zb-h1": zb_h1}


def check_schedule(name: str) -> str:
    """Return `name` if it is a known schedule, else raise a ValueError naming the choices."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r} is not a schedule; expected one of {tuple(SCHEDULES)}")
    return name


def forward_only(stages: int, micro_batches: int, virtual: int = 1) -> list[list[Task]]:
    """Per-stage task lists of an inference pass: forwards only, in (micro-batch, chunk) order."""
    return [[Task("F", m, c) for m in range(micro_batches) for c in range(k, stages * virtual, stages)]
            for k in range(stages)]


def timeline(schedule: list[list[Task]], duration) -> list[list[tuple[float, float]]]:
    """Start and end of every task if stage k ran its list back to back, each task starting as soon as
    its stage is free and its upstream task is done. `duration(stage, task)` gives each task's time.

    With unit costs this is the textbook diagram; with measured costs it replays a real run as if
    every stage had a device of its own. Raises ValueError if the order can deadlock.
    """
    stages = len(schedule)
    chunks = 1 + max((task.chunk for tasks in schedule for task in tasks), default=0)
    times: list[list[tuple[float, float]]] = [[] for _ in range(stages)]
    position = {task: i for tasks in schedule for i, task in enumerate(tasks)}
    cursor = [0] * stages
    while any(cursor[k] < len(schedule[k]) for k in range(stages)):
        progressed = False
        for k in range(stages):
            while cursor[k] < len(schedule[k]):
                task = schedule[k][cursor[k]]
                ready = times[k][-1][1] if times[k] else 0.0
                needed = upstream(task, chunks)
                if needed is not None:
                    other = owner(needed.chunk, stages)
                    if needed not in position:
                        raise ValueError(f"the schedule never runs {needed}, which {task} on stage {k} needs")
                    index = position[needed]
                    if index >= len(times[other]):
                        break  # its input is not produced yet; try the other stages first
                    ready = max(ready, times[other][index][1])
                times[k].append((ready, ready + duration(k, task)))
                cursor[k] += 1
                progressed = True
        if not progressed:
            raise ValueError("the schedule deadlocks: some task waits for one that can never run")
    return times
