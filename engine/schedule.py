"""The GPipe fill-drain schedule as a pure function of (stages, micro-batches, checkpoint mode).

A schedule is one ordered task list per stage. Each worker runs its own list in order; the
data dependencies between stages (activations forward, gradients backward) do the rest. A
different schedule, such as 1F1B, is only a different task order: the engine stays the same.
"""
from __future__ import annotations

from typing import NamedTuple

CHECKPOINT_MODES = ("always", "except_last", "never")


class Task(NamedTuple):
    """One unit of work for one stage: op is "F" (forward), "R" (recompute) or "B" (backward)."""

    op: str
    micro: int

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


def upstream(stage: int, task: Task, stages: int) -> tuple[int, Task] | None:
    """The task on another stage that must finish before `task` can start on `stage`, if any.

    A forward needs the previous stage's forward of the same micro-batch (its input activation);
    a backward needs the next stage's backward of it (the gradient of its output). Recompute uses
    the input the stage kept, so it waits for nothing but the stage's own earlier tasks.
    """
    if task.op == "F" and stage > 0:
        return stage - 1, task
    if task.op == "B" and stage < stages - 1:
        return stage + 1, task
    return None


def gpipe(stages: int, micro_batches: int, checkpoint: str = "except_last") -> list[list[Task]]:
    """Per-stage task lists of GPipe: every forward, then every backward in reverse micro-batch order.

    Backward runs last micro-batch first, mirroring the forward fill as a drain; a checkpointed
    micro-batch gets its recompute "R" immediately before its backward "B".
    """
    if stages < 1 or micro_batches < 1:
        raise ValueError(f"need stages >= 1 and micro_batches >= 1, got {stages} and {micro_batches}")
    forward = [Task("F", m) for m in range(micro_batches)]
    backward = []
    for m in reversed(range(micro_batches)):
        if checkpointed(m, micro_batches, checkpoint):
            backward.append(Task("R", m))
        backward.append(Task("B", m))
    return [forward + backward for _ in range(stages)]


def one_f_one_b(stages: int, micro_batches: int, checkpoint: str = "except_last") -> list[list[Task]]:
    """Per-stage task lists of 1F1B (PipeDream-Flush), the schedule that came after GPipe.

    Stage k runs K-1-k forwards to fill the pipe, then alternates one forward with one backward,
    then drains the remaining backwards, in micro-batch order. Same work and the same synchronous
    update as GPipe, but a stage never holds more than K-k micro-batches' activations, not M.
    """
    if stages < 1 or micro_batches < 1:
        raise ValueError(f"need stages >= 1 and micro_batches >= 1, got {stages} and {micro_batches}")

    def backward(m: int) -> list[Task]:
        return ([Task("R", m)] if checkpointed(m, micro_batches, checkpoint) else []) + [Task("B", m)]

    plans = []
    for k in range(stages):
        warmup = min(stages - 1 - k, micro_batches)
        tasks = [Task("F", m) for m in range(warmup)]
        for i in range(micro_batches - warmup):
            tasks += [Task("F", warmup + i)] + backward(i)
        for i in range(micro_batches - warmup, micro_batches):
            tasks += backward(i)
        plans.append(tasks)
    return plans


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def check_schedule(name: str) -> str:
    """Return `name` if it is a known schedule, else raise a ValueError naming the choices."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r} is not a schedule; expected one of {tuple(SCHEDULES)}")
    return name


def forward_only(stages: int, micro_batches: int) -> list[list[Task]]:
    """Per-stage task lists of an inference pass: forwards only, no graph kept."""
    return [[Task("F", m) for m in range(micro_batches)] for _ in range(stages)]


def timeline(schedule: list[list[Task]], duration) -> list[list[tuple[float, float]]]:
    """Start and end of every task if stage k ran its list back to back, each task starting as soon as
    its stage is free and its upstream task is done. `duration(stage, task)` gives each task's time.

    With unit costs this is the textbook fill-drain diagram; with measured costs it replays a real
    run as if every stage had a device of its own.
    """
    stages = len(schedule)
    times: list[list[tuple[float, float]]] = [[] for _ in range(stages)]
    position = {(k, task): i for k, tasks in enumerate(schedule) for i, task in enumerate(tasks)}
    cursor = [0] * stages
    while any(cursor[k] < len(schedule[k]) for k in range(stages)):
        progressed = False
        for k in range(stages):
            while cursor[k] < len(schedule[k]):
                task = schedule[k][cursor[k]]
                ready = times[k][-1][1] if times[k] else 0.0
                dependency = upstream(k, task, stages)
                if dependency is not None:
                    other, needed = dependency
                    index = position[(other, needed)]
                    if index >= len(times[other]):
                        break  # its input is not produced yet; try the other stages first
                    ready = max(ready, times[other][index][1])
                times[k].append((ready, ready + duration(k, task)))
                cursor[k] += 1
                progressed = True
        if not progressed:
            raise ValueError("the schedule deadlocks: some task waits for one that can never run")
    return times
