"""The host's share of a task: Python calls, ATen operators and microseconds per F, R and B task of
a pipeline stage, the engine's beside plain PyTorch running the same layers on the same micro-batches.

On a GPU a task's kernels run as fast as the host issues them once the task is small (tens of
microseconds), so what a pipeline adds on the host per task is what it loses there. Counts say
what that is on any host (`sys.setprofile` sees every Python call; a dispatch mode every ATen
operator); microseconds say what it costs on this one. Per task means the slope over M of a step's
count (a step of M=8 minus one of M=4, over 4), so that a call's fixed cost stands apart.

The stage: a Transformer of the zoo (embedding, 3 blocks, head) as one stage, recompute on every
micro-batch, the memory ledger off (as in every timed run), seeded dropout: per micro-batch a
no-grad forward (F), a forward with its graph and the loss (R) and the backward (B), which is what
plain PyTorch is timed doing too. Threads: the stage runs on its worker thread; processes: a
one-rank group in a stage process of its own (gloo on loopback).
"""
from __future__ import annotations

import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import GPipe
from engine.chunk import Chunk
from lab.machine.loopback import Meeting, join
from lab.processes.children import Children
from lab.zoo import transformer

TASKS = ("F", "R", "B")
BATCH, BLOCKS, SMALL_M, LARGE_M = 32, 3, 4, 8
_TASK_CODE = Chunk.run.__code__  # a frame of this code is one task running


@dataclass(frozen=True)
class PerTask:
    """What one task costs, by op ("F", "R", "B"), and "between": the task loop's own per task."""

    engine: dict
    plain: dict

    def ratio(self) -> float:
        """The engine's total per micro-batch (F + R + B + between) over plain PyTorch's (F + R + B)."""
        return sum(self.engine.values()) / sum(self.plain.values())


class _Tally:
    """A profile function (sys.setprofile) counting Python calls by the task each thread is in."""

    def __init__(self):
        self.calls: Counter = Counter()
        self.inside: dict[int, str] = {}  # thread -> the op of the task it runs
        self.on = False

    def __call__(self, frame, event, arg) -> None:
        if not self.on or event not in ("call", "return"):
            return
        thread = threading.get_ident()
        if frame.f_code is _TASK_CODE:
            if event == "return":
                self.inside.pop(thread, None)
                return
            self.inside[thread] = frame.f_locals["task"].op
        if event == "call":
            self.calls[self.inside.get(thread, "between")] += 1

    def counting(self, run) -> Counter:
        """Python calls of `run()` by task op ("between" outside tasks), itself left out."""
        self.calls, self.on = Counter(), True
        try:
            run()
        finally:
            self.on = False
        self.calls["between"] -= 1
        return self.calls


class _OperatorTally(TorchDispatchMode):
    """ATen operators by the task op `tally` says this thread is in."""

    def __init__(self, tally: _Tally):
        super().__init__()
        self.tally, self.ops = tally, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[self.tally.inside.get(threading.get_ident(), "between")] += 1
        return func(*args, **(kwargs or {}))


class Stage:
    """The measured stage: the zoo's Transformer at `width` as one stage, its batch, and the pipes."""

    def __init__(self, width: int, group=None):
        torch.manual_seed(0)
        self.model = transformer.build(BLOCKS, width)
        self.x, self.y = transformer.batch(BATCH)
        self.group = group
        self.pipes: dict[int, GPipe] = {}

    def engine_step(self, micro: int, serial: bool = False) -> None:
        """One step of the pipe of `micro` micro-batches (made on first use: its worker thread too)."""
        if micro not in self.pipes:
            self.pipes[micro] = GPipe(self.model, 1, chunks=micro, checkpoint="always", record_memory=False, seed=0,
                                      threads_per_stage=1, group=self.group)
        self.pipes[micro].step(self.x, self.y, transformer.loss, serial=serial)

    def plain_tasks(self, micro: int) -> list[tuple[str, Callable]]:
        """Plain PyTorch's step of `micro` micro-batches as (op, callable) pairs in the engine's order
        (every F, then R and B of the last micro-batch to the first): a task's time depends on what
        ran just before it (the caches), so both run the same sequence."""
        pairs, losses = list(zip(self.x.chunk(micro), self.y.chunk(micro))), {}

        def forward(a):
            with torch.no_grad():
                self.model(a)

        def recompute(m):
            losses[m] = transformer.loss(self.model(pairs[m][0]), pairs[m][1])

        def backward(m):
            losses.pop(m).backward(torch.tensor(1.0 / micro))
        tasks = [("F", partial(forward, a)) for a, _ in pairs]
        for m in reversed(range(micro)):
            tasks += [("R", partial(recompute, m)), ("B", partial(backward, m))]
        return tasks

    def plain_step(self, micro: int) -> None:
        for _, task in self.plain_tasks(micro):
            task()

    def close(self) -> None:
        """Close the pipes (and their worker threads); a later step makes new ones."""
        for pipe in self.pipes.values():
            pipe.close()
        self.pipes.clear()


def _slope(small: Counter, large: Counter) -> dict:
    return {op: (large[op] - small[op]) / (LARGE_M - SMALL_M) for op in (*TASKS, "between")}


def engine_counts(stage: Stage, tally: _Tally, serial: bool, operators: bool = False) -> dict:
    """Per task op, the engine's Python calls (or, with `operators`, ATen operators), as slopes over M."""
    found = {}
    for micro in (SMALL_M, LARGE_M):
        stage.engine_step(micro, serial)  # a warm-up: the first call learns which layers draw
        if operators:
            mode = _OperatorTally(tally)
            with mode:
                tally.counting(lambda: stage.engine_step(micro, serial))
            found[micro] = mode.ops
        else:
            found[micro] = tally.counting(lambda: stage.engine_step(micro, serial))
    return _slope(found[SMALL_M], found[LARGE_M])


def plain_counts(stage: Stage, operators: bool = False) -> dict:
    """Plain PyTorch's Python calls (or ATen operators) per F, R and B of one micro-batch."""
    stage.plain_step(LARGE_M)
    found: dict = {op: [] for op in TASKS}
    tally, previous = _Tally(), sys.getprofile()
    for op, task in stage.plain_tasks(LARGE_M):
        if operators:
            with _OperatorTally(tally) as mode:
                task()
            found[op].append(mode.ops["between"])
            continue
        sys.setprofile(tally)
        try:
            found[op].append(tally.counting(task)["between"])
        finally:
            sys.setprofile(previous)
    return {op: statistics.median(found[op]) for op in TASKS}


def counted(stage: Stage) -> tuple[PerTask, PerTask]:
    """(Python calls, ATen operators) per task. With threads the calls are counted on the stage's
    worker thread (it inherits the profile function when it starts), the operators on a serial step
    (the chunk's own on any runner); in a stage process both on this thread, which runs the tasks."""
    tally, previous, threads = _Tally(), sys.getprofile(), stage.group is None
    threading.setprofile(tally) if threads else sys.setprofile(tally)
    try:
        calls = engine_counts(stage, tally, serial=False)
    finally:
        threading.setprofile(None)
        sys.setprofile(previous)
    stage.close()  # the worker threads keep the profile function: timed steps get new ones
    sys.setprofile(tally)
    try:
        ops = engine_counts(stage, tally, serial=threads, operators=True)
    finally:
        sys.setprofile(previous)
    stage.close()
    return PerTask(calls, plain_counts(stage)), PerTask(ops, plain_counts(stage, operators=True))


def timed(stage: Stage, rounds: int) -> dict[str, list[float]]:
    """Per round, seconds of the engine's and plain PyTorch's at M=8: each op's mean task ("engine F",
    "plain F", ...; the engine's from its trace) and the time per micro-batch ("engine per
    micro-batch": from its first task's start to its last task's end, so the loop between tasks is
    in and the call's fixed ends are out; plain PyTorch's whole step). Steps alternate engine, plain,
    so that a noisy host slows both alike."""
    found: dict[str, list[float]] = {}
    for _ in range(2):
        stage.engine_step(LARGE_M)
        stage.plain_step(LARGE_M)
    for _ in range(rounds):
        stage.engine_step(LARGE_M)
        events, tasks = stage.pipes[LARGE_M].trace.events, {f"plain {op}": [] for op in TASKS}
        for op in TASKS:
            tasks[f"engine {op}"] = [e.end - e.start for e in events if e.op == op]
        start = time.perf_counter()
        for op, task in stage.plain_tasks(LARGE_M):
            begun = time.perf_counter()
            task()
            tasks[f"plain {op}"].append(time.perf_counter() - begun)
        tasks["plain per micro-batch"] = [time.perf_counter() - start]
        tasks["engine per micro-batch"] = [max(e.end for e in events) - min(e.start for e in events)]
        for name, durations in tasks.items():
            per = LARGE_M if name.endswith("micro-batch") else 1
            found.setdefault(name, []).append(statistics.fmean(durations) / per)
    return found


def measure_here(width: int, rounds: int, group=None) -> dict:
    """Counts and times per task in this process (threads, or with `group` a one-rank stage process)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    stage = Stage(width, group)
    try:
        calls, ops = counted(stage)
        seconds = timed(stage, rounds)
    finally:
        stage.close()
        torch.set_num_threads(previous)
    return dict(calls=calls, ops=ops, seconds=seconds)


class StageProcess:
    """A stage process of its own (a one-rank gloo group): answers (width, rounds) with measure_here's."""

    def __init__(self, store: str):
        join(store, 0, 1, timeout=60)

    def __call__(self, command: tuple[int, int]) -> dict:
        import torch.distributed as dist

        width, rounds = command
        return measure_here(width, rounds, group=dist.group.WORLD)

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


def measure_in_process(widths, rounds: int, timeout: float = 300.0) -> dict[int, dict]:
    """measure_here's figures at each width, in a stage process of its own."""
    meeting = Meeting()
    try:
        child = Children(StageProcess, [(meeting.path,)], name="host-time", timeout=timeout, env=meeting.env)
        try:
            return {width: child.ask([(width, rounds)])[0] for width in widths}
        finally:
            child.close()
    finally:
        meeting.close()


def rows(widths=(16, 64), rounds: int = 7) -> list[tuple[str, str, str]]:
    """The host-time rows of lab.bench: per width and runner, Python calls and ATen operators per
    task beside plain PyTorch's, and microseconds per task and per micro-batch with their ratios."""
    found = {("threads", w): measure_here(w, rounds) for w in widths}
    found.update({("processes", w): figures for w, figures in measure_in_process(widths, rounds).items()})
    table = []
    for (runner, width), figures in found.items():
        what = f"host time per task, Transformer stage ({BLOCKS} blocks, width {width}, batch {BATCH}), {runner}"
        table += [(f"{what}: Python calls, engine / plain PyTorch", said(figures["calls"]),
                   "goal: at most 1.25x per micro-batch"),
                  (f"{what}: ATen operators, engine / plain PyTorch", said(figures["ops"]), "the same layers' work"),
                  (f"{what}: microseconds, engine / plain PyTorch", said_seconds(figures["seconds"]),
                   "goal at width 16: at most 1.3x per micro-batch; medians, ratios of the same rounds")]
    return table


def said(per_task: PerTask) -> str:
    """'F 263 / 245, R 259 / 241, B 17 / 15, loop 15; per micro-batch 1.11x'."""
    parts = [f"{op} {per_task.engine[op]:.0f} / {per_task.plain[op]:.0f}" for op in TASKS]
    return ", ".join(parts) + f", loop {per_task.engine['between']:.0f}; per micro-batch {per_task.ratio():.2f}x"


def said_seconds(seconds: dict[str, list[float]]) -> str:
    """Each op's and the micro-batch's engine / plain microseconds and their per-round ratio."""
    def one(name: str) -> str:
        engine, plain = seconds[f"engine {name}"], seconds[f"plain {name}"]
        ratio = statistics.median(e / p for e, p in zip(engine, plain))
        return f"{name} {statistics.median(engine) * 1e6:.0f} / {statistics.median(plain) * 1e6:.0f} ({ratio:.2f}x)"
    return ", ".join(one(op) for op in (*TASKS, "per micro-batch"))
