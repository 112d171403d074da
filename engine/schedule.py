"""Pipeline schedules as pure functions of (stages K, micro-batches M, checkpoint mode, chunks v).

A schedule is one ordered task list per stage. Each stage runs its own list in order;
the data dependencies between chunks (activations forward, gradients backward) do the rest. A
different schedule is only a different task order: the engine stays the same.

The model is cut into K*v consecutive chunks of layers; chunk c lives on stage c % K (v = 1: chunk k
is stage k). A task is (op, micro-batch, chunk) with op "F" (forward), "R" (recompute the forward of
a micro-batch kept only as its input), "B" (backward; with a separate "W" it computes only the
gradient of the chunk's input and of what lies between its layers) or "W" (the gradient of the
weights, deferred).

The five named schedules, each function's docstring saying how it orders tasks: gpipe (fill,
drain: Huang et al., 2019); 1f1b (PipeDream-Flush: Narayanan et al., 2021); interleaved (v chunks
per stage: Megatron-LM, Narayanan et al., 2021); zb-h1 (W split off: Qi et al., 2023, "Zero Bubble
Pipeline Parallelism"); zb-v (a V of two chunks per stage: Qi et al., 2024, "Pipeline Parallelism
with Controllable Memory").

A `Schedule` is the task lists with a placement of chunks on stages (loop by default: chunk c on
stage c % K); `check` explains the first thing wrong with one, or reports its unit-cost makespan,
bubble and the most micro-batches a stage holds. (lab/schedules/writer.py reads and writes them as text.)
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, NamedTuple, Optional

CHECKPOINT_MODES = ("always", "except_last", "never", "as_written")


class Task(NamedTuple):
    """One unit of work for one stage: op "F", "R", "B" or "W" on micro-batch `micro` of `chunk`."""

    op: str
    micro: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.op}{self.micro}"


def check_checkpoint_mode(mode, stages: Optional[int] = None):
    """Return `mode` if it is a checkpoint mode, or a tuple of one mode per stage (a list becomes a
    tuple; `stages`, when given, is how many it must name), else raise a ValueError naming the choices.
    "as_written" recomputes exactly the micro-batches a written schedule runs an R for."""
    if isinstance(mode, (list, tuple)):
        if stages is not None and len(mode) != stages:
            raise ValueError(f"checkpoint={tuple(mode)!r} names {len(mode)} modes for {stages} stages: expected one "
                             f"mode, or one per stage")
        return tuple(check_checkpoint_mode(each) for each in mode)
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint={mode!r} is not a checkpoint mode; expected one of {CHECKPOINT_MODES}, or one "
                         f"of them per stage")
    return mode


def stage_mode(mode, stage: int) -> str:
    """The checkpoint mode of one stage: `mode` itself, or its entry for `stage` in a per-stage tuple."""
    return mode[stage] if isinstance(mode, tuple) else mode


def checkpointed(micro: int, micro_batches: int, mode, stage: int = 0) -> bool:
    """Whether a micro-batch is re-materialized on `stage` (forward without graph, recomputed before
    backward) under `mode` (one mode, or one per stage).

    "except_last" spares the last micro-batch: its backward starts right after its forward on the
    last stage, so keeping its activations costs little and saves one recompute (torchgpipe's choice).
    "as_written" is the schedule's to say, by its R tasks: there is no rule to build one from.
    """
    mode = stage_mode(check_checkpoint_mode(mode), stage)
    if mode == "as_written":
        raise ValueError("checkpoint='as_written' recomputes what a written schedule's R tasks say: a built-in "
                         "schedule needs 'always', 'except_last' or 'never' (one, or one per stage)")
    return mode == "always" or (mode == "except_last" and micro < micro_batches - 1)


def recomputed(schedule: list[list[Task]]) -> frozenset:
    """The (chunk, micro-batch) pairs a schedule re-materializes: those it runs an R task for. The
    engine keeps only the input of exactly these forwards."""
    return frozenset((t.chunk, t.micro) for tasks in schedule for t in tasks if t.op == "R")


def owner(chunk: int, stages: int) -> int:
    """The stage that holds `chunk`: chunks are dealt round-robin (Megatron's loop placement)."""
    return chunk % stages


def loop(stages: int, chunks: int) -> tuple[int, ...]:
    """Loop placement: chunk c on stage c % K (Megatron's interleaved schedule)."""
    return tuple(owner(c, stages) for c in range(chunks))


def v_shape(stages: int, chunks: int) -> tuple[int, ...]:
    """V placement (ZB-V, DualPipe-V): chunks go down the stages and back up, so stage k holds
    chunks k and 2K-1-k, and the last chunk sits with the first, on stage 0."""
    return tuple(c % stages if (c // stages) % 2 == 0 else stages - 1 - c % stages for c in range(chunks))


class Schedule(list):
    """One task list per stage (a list, as every runner reads it) and `placement`, the stage of each
    chunk (loop placement unless given)."""

    def __init__(self, tasks, placement: Optional[tuple] = None):
        super().__init__(list(stage) for stage in tasks)
        placement = getattr(tasks, "placement", None) if placement is None else placement
        chunks = -(-(1 + max((t.chunk for stage in self for t in stage), default=0)) // max(len(self), 1)) * len(self)
        self.placement = tuple(loop(len(self), chunks) if placement is None else placement)

    def label(self, task: Task) -> str:
        """A task's name: "F3", or "F3@5" where its stage holds several chunks."""
        several = 0 <= task.chunk < len(self.placement) and self.placement.count(self.placement[task.chunk]) > 1
        return f"{task}@{task.chunk}" if several else str(task)


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
                 layers: Optional[int] = None, checkpoint=None) -> None:
    """The one check of how chunks are laid out, for the pipe, the schedules and the lab: the chunks
    per stage (v) and the M that schedule `name` accepts (its entry in SCHEDULES; a written schedule
    any v), K*v chunks need at least as many layers, and `checkpoint`, where given, is a mode or
    one per stage ("as_written" only for a written schedule: a built-in one has no R's of its own)."""
    if checkpoint is not None:
        modes = check_checkpoint_mode(checkpoint, stages)
        if name != "written" and "as_written" in (modes if isinstance(modes, tuple) else (modes,)):
            raise ValueError(f"checkpoint={checkpoint!r}: 'as_written' recomputes what a written schedule's R tasks "
                             f"say, but schedule={name!r} is built by rule: use 'always', 'except_last' or 'never'")
    if isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < 1:
        raise ValueError(f"virtual_stages={virtual!r}: expected an int >= 1 (chunks of layers per stage)")
    if micro_batches is not None and (stages < 1 or micro_batches < 1):
        raise ValueError(f"need stages >= 1 and micro_batches >= 1, got {stages} and {micro_batches}")
    kind = None if name == "written" else SCHEDULES[check_schedule(name)]
    if kind is not None and not kind.fewest_chunks <= virtual <= (kind.most_chunks or virtual):
        several = ", ".join(f"{other!r}" for other, k in SCHEDULES.items() if k.most_chunks != 1)
        hint = f"; several chunks per stage: schedule={several}" if kind.most_chunks == 1 else ""
        raise ValueError(f"virtual_stages={virtual}: schedule={name!r} places {kind.chunks_said()} on a stage{hint}")
    if kind is not None and kind.micro_multiple_of_stages and micro_batches is not None and micro_batches % stages:
        raise ValueError(f"schedule={name!r} needs M (micro-batches, chunks=) to be a multiple of K={stages}, as "
                         f"Megatron-LM requires; got M={micro_batches}: use M={stages * -(-micro_batches // stages)}")
    if virtual > 1 and layers is not None and stages * virtual > layers:
        raise ValueError(f"{stages} stages x virtual_stages={virtual} = {stages * virtual} chunks but the model has "
                         f"only {layers} layers; expected at most one chunk per layer")


def _backward(micro: int, micro_batches: int, checkpoint, chunk: int, stage: int) -> list[Task]:
    """A micro-batch's backward on a chunk of `stage`, preceded by its recompute if it was checkpointed."""
    recompute = [Task("R", micro, chunk)] if checkpointed(micro, micro_batches, checkpoint, stage) else []
    return recompute + [Task("B", micro, chunk)]


def gpipe(stages: int, micro_batches: int, checkpoint="except_last", virtual: int = 1) -> list[list[Task]]:
    """GPipe: every forward, then every backward in reverse micro-batch order (the drain mirrors the
    fill); a checkpointed micro-batch gets its recompute "R" immediately before its backward "B"."""
    check_layout("gpipe", stages, micro_batches, virtual, checkpoint=checkpoint)
    return [[Task("F", m, k) for m in range(micro_batches)] +
            [t for m in reversed(range(micro_batches)) for t in _backward(m, micro_batches, checkpoint, k, k)]
            for k in range(stages)]


def one_f_one_b(stages: int, micro_batches: int, checkpoint="except_last", virtual: int = 1) -> list[list[Task]]:
    """1F1B (PipeDream-Flush): stage k runs K-1-k forwards to fill the pipe, then alternates one
    forward with one backward, then drains the remaining backwards, in micro-batch order. Same work
    and the same synchronous update as GPipe, but a stage never holds more than K-k micro-batches."""
    check_layout("1f1b", stages, micro_batches, virtual, checkpoint=checkpoint)
    plans = []
    for k in range(stages):
        warmup = min(stages - 1 - k, micro_batches)
        tasks = [Task("F", m, k) for m in range(warmup)]
        for i in range(micro_batches - warmup):
            tasks += [Task("F", warmup + i, k)] + _backward(i, micro_batches, checkpoint, k, k)
        for i in range(micro_batches - warmup, micro_batches):
            tasks += _backward(i, micro_batches, checkpoint, k, k)
        plans.append(tasks)
    return plans


def interleaved(stages: int, micro_batches: int, checkpoint="except_last", virtual: int = 2) -> list[list[Task]]:
    """Interleaved 1F1B (Megatron-LM): stage k holds chunks k, k+K, ..., k+(v-1)K. Forwards go in
    groups of K micro-batches through one chunk after the other; backwards in the same groups from
    the last chunk back. Stage k fills with 2(K-1-k) + (v-1)K forwards, then alternates, then drains.
    Megatron requires M to be a multiple of K, so that every group is full; so does this engine."""
    check_layout("interleaved", stages, micro_batches, virtual, checkpoint=checkpoint)
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
        backward = [_backward(micro_of(i), micro_batches, checkpoint, chunk_of(i, k, True), k) for i in range(total)]
        tasks = forward[:warmup]
        for i in range(total - warmup):
            tasks += [forward[warmup + i]] + backward[i]
        for i in range(total - warmup, total):
            tasks += backward[i]
        plans.append(tasks)
    return plans


def zb_h1(stages: int, micro_batches: int, checkpoint="except_last", virtual: int = 1) -> list[list[Task]]:
    """ZB-H1: 1F1B's order with each backward split into B (input gradient, sent upstream at once)
    and W (weight gradient). Stage k keeps its first k W's pending, so in the drain, where 1F1B's
    stage k idles while it waits for gradients, it has W's to run; every later B is followed by the
    oldest pending W. At most K micro-batches are in flight on a stage (forward done, W not yet)."""
    check_layout("zb-h1", stages, micro_batches, virtual, checkpoint=checkpoint)
    plans = []
    for k in range(stages):
        warmup = min(stages - 1 - k, micro_batches)
        tasks = [Task("F", m, k) for m in range(warmup)]
        backwards = weights = 0

        def next_backward() -> None:
            nonlocal backwards, weights
            tasks.extend(_backward(backwards, micro_batches, checkpoint, k, k))
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


def zb_v(stages: int, micro_batches: int, checkpoint="except_last", virtual: int = 2) -> Schedule:
    """ZB-V: chunks in a V (stage k holds chunks k and 2K-1-k), each backward split into B and W.
    Built as the paper builds its schedules, by laying tasks onto a unit-cost clock (F = B = W = 1):
    a free stage runs a ready B (the critical path; its recompute first), else a ready F, the later
    chunk first, unless the stage already holds K micro-batches (2K chunk halves; the first chunk
    leaves one of them to the second), else its oldest pending W, else it waits."""
    check_layout("zb-v", stages, micro_batches, virtual, checkpoint=checkpoint)
    count, limit, plans = 2 * stages, 2 * stages, Schedule([[] for _ in range(stages)], v_shape(stages, 2 * stages))
    done, free, held, weights = {}, [0] * stages, [0] * stages, [[] for _ in range(stages)]  # done: Task -> end
    forwards, backwards = [0] * count, [0] * count  # the next micro-batch to forward, backward per chunk
    clock, total = 0, count * micro_batches

    def ready(task: Task) -> bool:
        needed = upstream(task, count)
        return done.get(task._replace(op="F"), clock + 1) <= clock if task.op == "B" and needed is None \
            else needed is None or done.get(needed, clock + 1) <= clock

    while sum(backwards) < total or any(weights):
        for k in (k for k in range(stages) if free[k] <= clock):
            high, low = count - 1 - k, k  # the stage's chunks, the later one first
            b = [Task("B", backwards[c], c) for c in (high, low) if backwards[c] < forwards[c]]
            f = [Task("F", forwards[c], c) for c in (high, low) if forwards[c] < micro_batches and
                 held[k] < limit - (c == low and low != high)]
            for task in [t for t in b if ready(t)][:1] or [t for t in f if ready(t)][:1] or weights[k][:1]:
                work = _backward(task.micro, micro_batches, checkpoint, task.chunk, k) if task.op == "B" else [task]
                plans[k] += work
                free[k] = done[task] = clock + len(work)
                if task.op == "F":
                    forwards[task.chunk] += 1
                    held[k] += 1
                elif task.op == "B":
                    backwards[task.chunk] += 1
                    weights[k].append(Task("W", task.micro, task.chunk))
                else:
                    held[k] -= 1
                    weights[k].pop(0)
        clock += 1
    return plans


@dataclass(frozen=True)
class Kind:
    """A built-in schedule, all that the engine and the lab need of it in one place: how to build
    its task lists (called as the builder is: K, M, checkpoint mode, v), how pages name it, where it
    comes from, its unit-cost bubble (K, M, v; None: read off its unit-cost timeline) and the most
    micro-batches stage k holds (K, M, k, v; in whole stages' worth), the chunks of layers per stage
    (v) it places (`most_chunks` None: no limit), whether M must be a multiple of K, whether it
    splits each backward into B and W, and whether the lab races it beside the others."""
    build: Callable[..., list[list[Task]]]
    label: str
    paper: str
    bubble: Optional[Callable[[int, int, int], float]]
    held: Callable[[int, int, int, int], float]
    fewest_chunks: int = 1
    most_chunks: Optional[int] = 1
    micro_multiple_of_stages: bool = False
    splits_backward: bool = False
    compared: bool = True

    def __call__(self, stages: int, micro_batches: int, checkpoint="except_last",
                 virtual: int = 1) -> list[list[Task]]:
        return self.build(stages, micro_batches, checkpoint, virtual)

    def chunks_said(self) -> str:
        """The chunks per stage it places, in words: "1 chunk", "exactly 2 chunks", "at least 2 chunks"."""
        if self.most_chunks == 1:
            return "1 chunk"
        return f"{'exactly' if self.most_chunks == self.fewest_chunks else 'at least'} {self.fewest_chunks} chunks"


def fill_drain_bubble(stages: int, micro_batches: int, virtual: int = 1) -> float:
    """(K-1)/(M+K-1): GPipe's idle share with unit costs, and 1F1B's (the same idle time in another order)."""
    return (stages - 1) / (micro_batches + stages - 1)


SCHEDULES: dict[str, Kind] = {  # GPipe, then the orders that came after it
    "gpipe": Kind(gpipe, "GPipe (fill, drain)", "Huang et al., GPipe: Efficient Training of Giant Neural Networks "
                  "using Pipeline Parallelism, 2019", fill_drain_bubble, lambda k, m, s, v: m),
    "1f1b": Kind(one_f_one_b, "1F1B", "Narayanan et al., Memory-Efficient Pipeline-Parallel DNN Training, ICML 2021 "
                 "(the synchronous schedule PipeDream-Flush)", fill_drain_bubble, lambda k, m, s, v: min(k - s, m)),
    "interleaved": Kind(interleaved, "interleaved 1F1B", "Narayanan et al., Efficient Large-Scale Language Model "
                        "Training on GPU Clusters Using Megatron-LM, 2021", lambda k, m, v: (k - 1) / (v * m + k - 1),
                        lambda k, m, s, v: min(2 * (k - 1 - s) + (v - 1) * k + 1, m * v) / v,  # Megatron's fill
                        fewest_chunks=2, most_chunks=None, micro_multiple_of_stages=True),
    "zb-h1": Kind(zb_h1, "zero bubble (ZB-H1)", "Qi et al., Zero Bubble Pipeline Parallelism, 2023 (schedule ZB-H1)",
                  lambda k, m, v: (k - 1) / (3 * m + k - 1), lambda k, m, s, v: min(k, m), splits_backward=True),
    "zb-v": Kind(zb_v, "zero bubble V (ZB-V)", "Qi et al., Pipeline Parallelism with Controllable Memory, 2024 "
                 "(schedule ZB-V)", None, lambda k, m, s, v: min(k, m), fewest_chunks=2, most_chunks=2,
                 splits_backward=True, compared=False)}


def check_schedule(name: str) -> str:
    """Return `name` if it is a known schedule, else raise a ValueError naming the choices."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r} is not a schedule; expected one of {tuple(SCHEDULES)}")
    return name


def forward_only(placement: tuple, micro_batches: int) -> Schedule:
    """Per-stage task lists of an inference pass: forwards only, in (micro-batch, chunk) order."""
    return Schedule([[Task("F", m, c) for m in range(micro_batches) for c, at in enumerate(placement) if at == k]
                     for k in range(1 + max(placement))], placement)


def timeline(schedule: list[list[Task]], duration, latency: float = 0.0) -> list[list[tuple[float, float]]]:
    """Start and end of every task if stage k ran its list back to back, each task starting as soon as
    its stage is free and its upstream task is done (`latency` later from another stage: a message).
    `duration(stage, task)` gives each task's time. With unit costs this is the textbook diagram;
    with measured costs it replays a real run as if every stage had a device of its own. Raises
    ValueError naming the cycle of waits if it deadlocks."""
    schedule = schedule if isinstance(schedule, Schedule) else Schedule(schedule)
    stages, chunks = len(schedule), len(schedule.placement)
    times: list[list[tuple[float, float]]] = [[] for _ in range(stages)]
    position = {task: i for tasks in schedule for i, task in enumerate(tasks)}
    cursor = [0] * stages
    while any(cursor[k] < len(schedule[k]) for k in range(stages)):
        progressed, waits = False, {}
        for k in range(stages):
            while cursor[k] < len(schedule[k]):
                task = schedule[k][cursor[k]]
                ready = times[k][-1][1] if times[k] else 0.0
                needed = upstream(task, chunks)
                if needed is not None:
                    if needed not in position:
                        raise ValueError(f"the schedule never runs {schedule.label(needed)}, which "
                                         f"{schedule.label(task)} on stage {k} needs")
                    other = schedule.placement[needed.chunk]
                    if position[needed] >= len(times[other]):
                        waits[k] = (needed, other)
                        break  # its input is not produced yet; try the other stages first
                    ready = max(ready, times[other][position[needed]][1] + (latency if other != k else 0.0))
                times[k].append((ready, ready + duration(k, task)))
                cursor[k] += 1
                progressed = True
        if not progressed:
            raise ValueError(f"the schedule deadlocks: {_cycle(schedule, waits)}")
    return times


def _cycle(schedule: Schedule, waits: dict) -> str:
    """The stuck stages' cycle of waits: "stage 0 waits for B3 from stage 1, which waits for F4 from stage 0"."""
    path, k = [], min(waits)
    while k not in path:
        path.append(k)
        k = waits[k][1]
    cycle = path[path.index(k):] + [k]
    return f"stage {k} " + ", which ".join(f"waits for {schedule.label(waits[a][0])} from "
                                           f"{'itself' if a == b else f'stage {b}'}" for a, b in zip(cycle, cycle[1:]))


class Report(NamedTuple):
    """`check`'s prediction: with unit costs (a stage's F = 1, B = 2 or B = W = 1 with W split off,
    R = 1; a chunk 1/v) unless given the tasks' own durations, then in their unit."""

    makespan: float
    bubble: float       # the stages' idle fraction
    held: float         # the most micro-batches a stage holds (forward done, backward or W not yet)


def check(schedule: list[list[Task]], micro_batches: int, checkpoint: str = "except_last",
          duration: Optional[Callable[[int, Task], float]] = None, latency: float = 0.0) -> Report:
    """Check that `schedule` runs micro-batches 0..M-1 under `checkpoint` (else a ValueError names the
    first problem in words); report its makespan, bubble and memory with unit costs, or with a model's
    own: `duration(stage, task)` and `latency` per message between stages."""
    schedule = schedule if isinstance(schedule, Schedule) else Schedule(schedule)
    place, stages = schedule.placement, len(schedule)
    mode = check_checkpoint_mode(checkpoint, stages)
    if stages < 1 or micro_batches < 1:
        raise ValueError(f"need at least one stage and one micro-batch, got {stages} and M={micro_batches}")
    for k in sorted(set(range(stages)) ^ set(place)):
        raise ValueError(f"the placement {place} puts a chunk on stage {k}, but there are stages 0..{stages - 1}"
                         if k in place else f"the placement {place} puts no chunk on stage {k}")
    if len(set(held := [place.count(k) for k in range(stages)])) > 1:
        raise ValueError(f"the placement {place} gives the stages {held} chunks: every stage holds the same number")
    split, where = any(t.op == "W" for tasks in schedule for t in tasks), {}
    for k, tasks in enumerate(schedule):
        for i, task in enumerate(tasks):
            name = f"stage {k} runs {schedule.label(task)}"
            if task.op not in ("F", "R", "B", "W") or not 0 <= task.micro < micro_batches:
                raise ValueError(f"{name}: expected F, R, B or W, and a micro-batch 0..{micro_batches - 1}")
            if not 0 <= task.chunk < len(place) or place[task.chunk] != k:
                raise ValueError(f"{name}, but the placement {place} does not put chunk {task.chunk} on stage {k}")
            if task in where:
                raise ValueError(f"{name} twice")
            own = stage_mode(mode, k)
            if task.op == "R" and own != "as_written" and not checkpointed(task.micro, micro_batches, own):
                raise ValueError(f"{name}, a recompute of micro-batch {task.micro}, which kept its activations under "
                                 f"checkpoint={own!r}{f' on stage {k}' if isinstance(mode, tuple) else ''} "
                                 f"(checkpoint='as_written' recomputes what the R's say)")
            where[task] = i
    for c, k in enumerate(place):
        own = stage_mode(mode, k)
        for m in range(micro_batches):
            steps = [Task(op, m, c) for op in "FRBW" if (op != "R" or (Task("R", m, c) in where if own == "as_written"
                     else checkpointed(m, micro_batches, own))) and (op != "W" or split)]
            for task in steps:
                if task not in where:
                    why = {"R": f": checkpoint={own!r} keeps only its input, so its backward needs the recompute "
                                f"first", "W": ": once W is split off, every B leaves its weight gradient to a W"}
                    top = max((t.micro for t in where), default=-1)  # a schedule written for fewer micro-batches
                    why = {o: f": written for M={top + 1}, not {micro_batches}" for o in "FB"} if top < m else why
                    raise ValueError(f"stage {k} never runs {schedule.label(task)}{why.get(task.op, '')}")
            for before, after in zip(steps, steps[1:]):
                if where[after] < where[before]:
                    raise ValueError(f"stage {k} runs {schedule.label(after)} before {schedule.label(before)}")
    share, costs = stages / len(place), {"F": 1.0, "R": 1.0, "B": 1.0 if split else 2.0, "W": 1.0}
    times = timeline(schedule, duration or (lambda k, task: costs[task.op] * share), latency)
    makespan = max(end for stage in times for _, end in stage)
    busy = sum(end - start for stage in times for start, end in stage)
    held = [n for tasks in schedule for n in accumulate((t.op == "F") - (t.op == "WB"[not split]) for t in tasks)]
    return Report(makespan, 1 - busy / (stages * makespan), max(held) * share)
