"""Where the time of a measured step went: its makespan taken apart into named parts that add up to
it exactly, and the critical path, the chain of tasks and hand-overs that set the makespan.

    record = breakdown.measure(config)           # a step, its tasks timed alone, and a K=1 step beside it
    parts = breakdown.of_record(record)          # the median step's Breakdown (parts in seconds)
    one = breakdown.of_baseline(record)          # the K=1 step's, for the speedup's shortfall from K

It reads the trace the engine records (every task's start and end, and, between stage processes,
every message's) and the same tasks run one at a time (a serial step, experiments.solo_events).
Nothing is fitted: every stretch of the step's time is put in exactly one part (Breakdown says how).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

from engine.schedule import Schedule, Task, timeline, upstream
from engine.trace import Event, Trace
from lab.config import MEASURE_ROUNDS, MEASURE_WARMUP, RunConfig
from lab.timelines import replay

PARTS = ("compute", "recompute", "contention", "schedule bubble", "unequal stages", "messages", "gaps")
STEP = "measured step"


@dataclass(frozen=True)
class Piece:
    """A stretch [start, end] (seconds from the step's start) of a chain of the step: a task
    ("task", its `event`), the hand-over from a task of another stage to the one it fed
    ("hand-over"), the stretch between two tasks of one stage ("gap"), or the time before the
    chain's first task ("start"). `stage` is where the stretch was spent (the receiving stage, for
    a hand-over)."""

    kind: str
    stage: int
    start: float
    end: float
    event: Optional[Event] = None

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Breakdown:
    """One measured step taken apart: `step` is its makespan T (seconds from its start to the end of
    its last task, the step time the app and lab.reproduce show); `parts` are seconds in the order
    of PARTS, each >= 0, and they add up to T.

    The critical stage c is the stage with the most work at one-task-alone speed. At every instant
    of [0, T] stage c is running a task, waiting for a task of another stage, or in between its own
    tasks, so T = its task time + its waiting + its own gaps. A task's times: d, as measured;
    a = min(d, its time in the serial run, alone); and a_mean, the mean alone time of the same op on
    the same micro-batch over all stages (what every stage would take if the stages were equal).
    From its start, a task's d is read as min(a, a_mean), then a - min(a, a_mean), then d - a; a
    stretch of it that is counted (all of c's tasks; the part of another stage's task that c was
    waiting through, its end) counts what it covers of those three:

    - compute       = over c's F, B, W tasks, sum of min(a, a_mean): its own work at an average
                      stage's one-task-alone speed;
    - recompute     = over the R tasks counted (c's, and those c waited through), a;
    - contention    = over the tasks counted, d - a: how much slower they ran beside the other
                      stages than alone (cores, caches, memory bandwidth, the interpreter lock, and
                      whatever else loads the host);
    - schedule bubble = over the F, B, W tasks of other stages that c waited through, min(a, a_mean),
                      but at most U, the idle of c when every stage runs its tasks in this step's
                      order, each taking a_mean (the stages made equal: the unit-cost diagram of the
                      step's schedule with its task times; schedule_idle): the fill and drain the
                      schedule itself makes;
    - unequal stages = over the tasks counted, a - min(a, a_mean) (what tasks slower alone than the
                      average stage's added: c's own excess, and that of the tasks it waited through),
                      plus what c waited through at a_mean beyond U: the stages did not keep one pace
                      (unequal work per op, or one stage sending while the other reads);
    - messages      = the hand-overs c waited through (from the end of the task that fed a task to
                      that task's start, where that feeder set its start), plus the time a stage's
                      thread spent sending and reading messages inside the gaps counted below;
    - gaps          = the rest of the stretches between consecutive tasks of one stage, and before
                      its first: dispatch, hooks, bookkeeping.

    What c waited for is found on the chain that released it: walk back from the task whose output
    c waited for, each time to whichever of its releasers ended later (the previous task of its
    stage, or the task whose output it needed); that chain covers [0, its end] with no hole, so
    each instant of c's wait falls in exactly one of its pieces (a task, a hand-over, a gap). After
    c's last task, the wait is the critical path's (`path`: that chain from the step's last task).
    A wait that ends with a slowed task of another stage is that task's slowdown first: had it run
    at its alone speed, that much of the wait would not have been. With one stage nothing is
    waited for and the step runs one task at a time: its own times are the alone times, so
    contention, schedule bubble and unequal stages are 0.

    `slowdown` is sum(d) / sum(alone) - 1 over all the step's tasks: how much longer the step's
    tasks took than the same tasks alone (0 when the tasks were not also timed alone)."""

    label: str
    step: float
    parts: dict[str, float]
    critical_stage: int
    path: tuple[Piece, ...]
    slowdown: float

    @property
    def total(self) -> float:
        """The parts' sum: the step, up to float rounding."""
        return sum(self.parts.values())

    def rows(self, setting: str) -> list[dict]:
        """One row per part and one for the measured step: setting, component, ms."""
        return ([{"setting": setting, "component": name, "ms": round(seconds * 1e3, 3)}
                 for name, seconds in self.parts.items()]
                + [{"setting": setting, "component": STEP, "ms": round(self.step * 1e3, 3)}])


def in_order(events: list[Event]) -> dict[int, list[Event]]:
    """Each stage's tasks in the order they ran."""
    lines: dict[int, list[Event]] = {}
    for e in sorted(events, key=lambda e: (e.start, e.end)):
        lines.setdefault(e.stage, []).append(e)
    return lines


def feeders(events: list[Event]) -> dict[Event, Optional[Event]]:
    """For each task, the task of another chunk whose output it needed (engine.schedule.upstream),
    or None."""
    chunks = 1 + max((e.chunk for e in events), default=0)
    by_task = {(e.op, e.micro, e.chunk): e for e in events}
    needed = {e: upstream(Task(e.op, e.micro, e.chunk), chunks) for e in events}
    return {e: by_task.get(tuple(task)) if task else None for e, task in needed.items()}


def releasers(events: list[Event]) -> dict[Event, Optional[Event]]:
    """For each task, the task that released it: of the previous task on its stage and the task of
    another chunk whose output it needed, the one that ended later (on a tie, the other stage's:
    its hand-over is what the task waited for); None for a task that waited for neither."""
    previous = {e: before for line in in_order(events).values() for before, e in zip([None] + line[:-1], line)}
    found = {}
    for e, feeder in feeders(events).items():
        before = previous[e]
        found[e] = before if feeder is None or (before is not None and before.end > feeder.end) else feeder
    return found


def backwards(last: Event, released: dict[Event, Optional[Event]]) -> Iterator[Piece]:
    """The chain that released `last`, as pieces from its end back to the step's start: they tile
    [0, last.end] with no hole and no overlap (a releaser that ends after the start of the task it
    released, as clocks of two processes can show by microseconds, is cut at that start)."""
    cursor, task = last.end, last
    while True:
        start = min(task.start, cursor)
        yield Piece("task", task.stage, start, cursor, task)
        cursor, before = start, released[task]
        if before is None:
            break
        end = min(before.end, cursor)
        yield Piece("gap" if before.stage == task.stage else "hand-over", task.stage, end, cursor)
        cursor, task = end, before
    yield Piece("start", task.stage, 0.0, max(cursor, 0.0))


def critical_path(trace: Trace) -> list[Piece]:
    """The chain of tasks, hand-overs and gaps that set the step's makespan, in time order: from the
    step's start to the end of its last task."""
    if not trace.events:
        return []
    last = max(trace.events, key=lambda e: (e.end, e.stage))
    return list(backwards(last, releasers(trace.events)))[::-1]


class _Ledger:
    """The parts as they are summed: what each counted stretch of a task, hand-over or gap adds."""

    def __init__(self, critical: int, alone: dict, mean: dict, messages: dict[int, list]):
        self.critical, self.alone, self.mean, self.messages = critical, alone, mean, messages
        self.parts = dict.fromkeys(PARTS, 0.0)

    def task(self, event: Event, low: float, high: float) -> None:
        """Count the stretch [low, high] of a task: from its start, its time at an average stage's
        alone speed, then its excess alone, then its slowdown beside the other stages."""
        d = event.duration
        a = min(self.alone.get(_key(event), d), d)
        base = a if event.op == "R" else min(a, self.mean.get((event.op, event.micro), a))
        first = "recompute" if event.op == "R" else "compute" if event.stage == self.critical else "schedule bubble"
        edge = event.start
        for name, length in ((first, base), ("unequal stages", a - base), ("contention", d - a)):
            self.parts[name] += max(0.0, min(high, edge + length) - max(low, edge))
            edge += length

    def gap(self, stage: int, start: float, end: float) -> None:
        """A stretch between tasks of `stage`: its messages' time in it, and the rest."""
        if end <= start:
            return
        busy = sum(max(0.0, min(end, b) - max(start, a)) for a, b in self.messages.get(stage, ()))
        busy = min(busy, end - start)
        self.parts["messages"] += busy
        self.parts["gaps"] += end - start - busy

    def waited(self, chain: Iterator[Piece], start: float, end: float) -> None:
        """Count the pieces of `chain` (going back in time) that fall in [start, end]."""
        for piece in chain:
            low, high = max(piece.start, start), min(piece.end, end)
            if high > low:
                if piece.kind == "task":
                    self.task(piece.event, low, high)
                elif piece.kind == "hand-over":
                    self.parts["messages"] += high - low
                elif piece.kind == "gap":
                    self.gap(piece.stage, low, high)
                else:
                    self.parts["gaps"] += high - low
            if piece.start <= start:
                return


def schedule_idle(events: list[Event], stage: int, mean: dict) -> float:
    """How long `stage` idles when every stage runs its tasks in the order they ran in this step, each
    task taking `mean[(op, micro)]` (the stages made equal): the unit-cost diagram of the step's own
    schedule, with the step's task times (engine.schedule.timeline, as lab.timelines.replay lays out replays)."""
    lines = in_order(events)
    order = [[Task(e.op, e.micro, e.chunk) for e in lines.get(k, [])] for k in range(1 + max(lines))]
    ran_on = {e.chunk: e.stage for e in events}  # the step's own placement: a loop, or ZB-V's V
    times = timeline(Schedule(order, tuple(ran_on[c] for c in range(1 + max(ran_on)))),
                     lambda k, task: mean[(task.op, task.micro)])
    makespan = max((end for line in times for _, end in line), default=0.0)
    return makespan - sum(end - start for start, end in times[stage])


def _key(event: Event) -> tuple:
    return event.chunk, event.op, event.micro


def of_trace(trace: Trace, alone: Optional[list[dict]] = None, label: str = "") -> Breakdown:
    """The Breakdown of a step's trace (its events and, between processes, its messages), with
    `alone` the same tasks timed one at a time (records as experiments.solo_events gives them).
    Without `alone` the step's own task times are taken as the alone times, which holds only for a
    step that ran one task at a time (one stage, or a serial step): with more stages it is refused."""
    events = trace.events
    if not events:
        raise ValueError("the trace has no tasks: take apart a step that ran")
    stages = 1 + max(e.stage for e in events)
    if alone is None and stages > 1:
        raise ValueError(f"a step of {stages} stages needs its tasks timed alone (alone=, a serial step's "
                         f"events: experiments.run(..., replay='always') keeps them as solo_events)")
    times = {_key(e): e.duration for e in events} if alone is None else \
        {(r.get("chunk", r["stage"]), r["op"], r["micro"]): r["end"] - r["start"] for r in alone}
    missing = [key for key in map(_key, events) if key not in times]
    if missing:
        raise ValueError(f"no alone time for task {missing[0]} (chunk, op, micro): `alone` must time the same tasks")
    mean: dict = {}
    for (_, op, micro), seconds in times.items():
        total, count = mean.get((op, micro), (0.0, 0))
        mean[(op, micro)] = (total + seconds, count + 1)
    mean = {key: total / count for key, (total, count) in mean.items()}
    work = [0.0] * stages
    for e in events:
        work[e.stage] += times[_key(e)]
    critical = max(range(stages), key=lambda k: (work[k], k))
    messages: dict[int, list] = {}
    for m in trace.messages:
        messages.setdefault(m.stage, []).append((m.start, m.end))
    ledger = _Ledger(critical, times, mean, messages)
    released, fed_by = releasers(events), feeders(events)
    cursor = 0.0
    for e in in_order(events)[critical]:
        feeder, start = fed_by[e], max(e.start, cursor)
        if feeder is not None and feeder.stage != critical and feeder.end > cursor:
            until = min(feeder.end, start)
            ledger.waited(backwards(feeder, released), cursor, until)
            ledger.parts["messages"] += start - until
        else:
            ledger.gap(critical, cursor, start)
        ledger.task(e, start, e.end)
        cursor = max(cursor, e.end)
    path = critical_path(trace)
    makespan = trace.makespan
    ledger.waited(iter(path[::-1]), cursor, makespan)
    waited = ledger.parts["schedule bubble"]
    ledger.parts["schedule bubble"] = min(waited, schedule_idle(events, critical, mean))
    ledger.parts["unequal stages"] += waited - ledger.parts["schedule bubble"]
    measured = sum(e.duration for e in events)
    alone_total = sum(times[_key(e)] for e in events)
    return Breakdown(label, makespan, ledger.parts, critical, tuple(path),
                     0.0 if alone is None else measured / alone_total - 1)


def of_record(record, alone: Optional[list[dict]] = None) -> Breakdown:
    """The Breakdown of a lab RunRecord's step (the median of its rounds), with its tasks timed alone:
    `alone`, else the record's own solo_events (a step of one stage needs neither)."""
    line = replay.measured(record.events, record.stages, replay.how_obtained("measured", record.transport),
                           record.messages)
    return of_trace(line.trace, alone if alone is not None else record.solo_events, line.label)


def of_baseline(record) -> Breakdown:
    """The Breakdown of the K=1 step measured beside the record's median step (run with
    baseline=True): one stage on one thread, one task at a time."""
    if not record.baseline_events:
        raise ValueError("the record has no K=1 step: measure it with experiments.run(..., baseline=True)")
    return of_trace(replay.measured(record.baseline_events, 1).trace, label="K=1")


def alone_events(record) -> list[dict]:
    """The record's tasks timed alone: its solo_events, or, if it has none, a serial step of its
    configuration and balance run now in this process (the shortest of two, per task). A step of
    one stage ran one task at a time: its own events are."""
    if record.solo_events:
        return record.solo_events
    if record.stages == 1:
        return record.events
    from lab.runs.experiments import solo_run  # torch loads only when a step runs

    return solo_run(RunConfig(**record.config), record.balance)


def measure(config: RunConfig, rounds: int = MEASURE_ROUNDS, warmup: int = MEASURE_WARMUP):
    """Measure a configuration as the app does (warm-up steps, then rounds of one step beside one
    K=1 step) and time its tasks alone too: a RunRecord that of_record and of_baseline take apart."""
    from lab.runs.experiments import run  # torch loads only when a step runs

    return run(config, replay="always", rounds=rounds, warmup=warmup, baseline=True)


def shortfall(step: Breakdown, single: Breakdown, stages: int) -> dict[str, float]:
    """Why the step is not the K=1 step divided by K, part by part: each part of the step minus the
    same part of the K=1 step over K (seconds; negative where the step spends less). They add up
    to step.step - single.step / K: what keeps the speedup from K."""
    return {name: step.parts[name] - single.parts[name] / stages for name in PARTS}

