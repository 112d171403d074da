"""Timelines to draw: what was measured, an ideal replay of it, and the textbook diagram.

- measured: the tasks as they ran on this host;
- ideal replay: the measured task times laid onto the schedule's dependency graph as if every
  stage had a device of its own (each task starts once its stage is free and its input exists);
  this is how a 2-core laptop still shows K = 8 honestly;
- theory: the same graph with unit costs (F = 1, B = 2, R = 1), the paper's picture.
Each carries its label so charts never mix them up.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from engine.schedule import SCHEDULES, check_schedule, timeline
from engine.trace import Event, Message, Reduction, Trace
from lab import theory


@dataclass(frozen=True)
class Timeline:
    """The tasks of one step as an engine Trace (which derives makespan, busy time and bubble),
    with what they are (`label`) and the unit of time (`unit`)."""

    label: str
    trace: Trace
    unit: str = "s"

    @property
    def stages(self) -> int:
        return self.trace.stages

    @property
    def bars(self) -> list[Event]:
        return self.trace.events

    @property
    def makespan(self) -> float:
        return self.trace.makespan

    @property
    def busy(self) -> list[float]:
        return self.trace.busy

    @property
    def bubble(self) -> float:
        return self.trace.bubble

    @property
    def work(self) -> float:
        """The tasks' time added up: how long one device would take to run them one after another."""
        return sum(self.trace.busy)

    @property
    def over_one_device(self) -> float:
        """The work over the makespan: the speedup of these K stages over one device running the same
        tasks. On a mean-cost replay it depends only on the schedule and the ops' cost ratios."""
        return self.work / self.makespan

    @property
    def messages(self) -> list[Message]:
        return self.trace.messages

    @property
    def reductions(self) -> list[Reduction]:
        return self.trace.reductions


def _timeline(label: str, stages: int, events: list[Event], unit: str = "s", messages=(), reductions=()) -> Timeline:
    return Timeline(label, Trace(stages=stages, events=sorted(events, key=lambda e: (e.start, e.stage)),
                                 messages=list(messages), reductions=list(reductions)), unit)


def how_obtained(how: str, transport: str) -> str:
    """A figure's label saying how it was obtained: "measured (threads)" or "measured (processes)"
    when `how` is "measured", else `how` itself ("ideal replay", ...). Tables and charts all use it."""
    return f"measured ({transport})" if how == "measured" else how


def measured(events: list[dict], stages: int, label: str = "measured", messages: list[dict] = (),
             reductions: list[dict] = ()) -> Timeline:
    """The events of a run as a timeline (seconds from the step's start), with the messages
    between stage processes and the gradient all-reduces with replicas, if there were any."""
    return _timeline(label, stages, [Event(e["stage"], e["micro"], e["op"], e["start"], e["end"], e.get("device", ""),
                                           e.get("chunk", e["stage"])) for e in events],
                     messages=[Message(**m) for m in messages], reductions=[Reduction(**r) for r in reductions])


def ideal_replay(events: list[dict], stages: int, micro_batches: int, checkpoint: str,
                 label: str = "ideal replay", schedule: str = "gpipe", virtual: int = 1) -> Timeline:
    """Measured task durations replayed on K independent devices along the schedule."""
    durations = {(e.get("chunk", e["stage"]), e["op"], e["micro"]): e["end"] - e["start"] for e in events}
    return _laid_out(stages, micro_batches, checkpoint, lambda k, task: durations[(task.chunk, task.op, task.micro)],
                     label, "s", schedule, virtual)


def unit_cost(stages: int, micro_batches: int, checkpoint: str = "never", costs: Optional[dict] = None,
              schedule: str = "gpipe", virtual: int = 1, label: Optional[str] = None) -> Timeline:
    """The textbook diagram with unit costs (a stage's forward 1, backward 2, recompute 1; with
    zb-h1 the backward splits into B 1 and W 1; an interleaved chunk does 1/v of it), for any
    schedule of the engine. Given `costs` (op -> seconds, e.g. `mean_costs` of a record) and a
    `label`, the same diagram in seconds: every stage equal, each op at that cost."""
    if costs is not None and label is None:
        raise ValueError("costs given without a label: say what they are (e.g. 'GPipe's mean task times')")
    unit = "time units" if costs is None else "s"
    costs = costs or theory.unit_costs(schedule, virtual)
    label = label or ("theory (unit costs)" if schedule == "gpipe" else f"theory (unit costs), {schedule}")
    return _laid_out(stages, micro_batches, checkpoint, lambda k, task: costs[task.op], label, unit, schedule, virtual)


def of_record(record, view: str) -> Timeline:
    """The timeline of a lab RunRecord for `view`: "measured", "ideal replay" or "theory"."""
    config = record.config
    virtual = config.get("virtual_stages", 1)
    if view == "measured":
        return measured(record.events, record.stages, how_obtained(view, record.transport), record.messages)
    if view == "ideal replay":
        events = record.solo_events or record.events
        label = "ideal replay of tasks timed alone" if record.solo_events else "ideal replay of measured tasks"
        return ideal_replay(events, record.stages, record.micro_batches, config["checkpoint"], label,
                            config["schedule"], virtual)
    if view == "theory":
        return unit_cost(record.stages, record.micro_batches, config["checkpoint"], schedule=config["schedule"],
                      virtual=virtual)
    raise ValueError(f"unknown view {view!r}; expected 'measured', 'ideal replay' or 'theory'")


def mean_costs(record, per_stage: bool = False) -> dict:
    """The mean time of each op over the record's tasks timed alone (or as measured): keyed by op,
    or with `per_stage` by (chunk, op)."""
    totals: dict = {}
    for e in record.solo_events or record.events:
        key = (e.get("chunk", e["stage"]), e["op"]) if per_stage else e["op"]
        total, count = totals.get(key, (0.0, 0))
        totals[key] = (total + e["end"] - e["start"], count + 1)
    return {key: total / count for key, (total, count) in totals.items()}


def with_mean_costs(record, per_stage: bool) -> Timeline:
    """The ideal replay of a record with every task taking the mean measured time of its op: each
    stage's own mean (`per_stage`: differences between stages kept, task-to-task jitter gone) or
    one mean over all stages (the stages made equal). Comparing the two with the plain replay
    tells which of the two makes a bubble exceed (K-1)/(M+K-1). Claims that must hold on any host
    are judged on these: with equal stages the bubble depends only on the schedule and the ops'
    cost ratios."""
    mean = mean_costs(record, per_stage)
    label = "ideal replay, each stage's mean task times" if per_stage else "ideal replay, all stages' mean task times"
    return with_costs(record, lambda k, task: mean[(task.chunk, task.op) if per_stage else task.op], label)


def with_costs(record, cost, label: str, unit: str = "s") -> Timeline:
    """The record's schedule laid out with `cost(stage, task)` as each task's duration: measured
    means, or counts (FLOPs, operator calls) whose replay is the same on every host."""
    config = record.config
    return _laid_out(record.stages, record.micro_batches, config["checkpoint"], cost, label, unit,
                     config["schedule"], config.get("virtual_stages", 1))


def task_order(stages: int, micro_batches: int, checkpoint: str, schedule: str, stage: int, virtual: int = 1) -> str:
    """One stage's task list under a schedule, as text ("F0 F1 B0 ..."; with several chunks per
    stage each task says its chunk: "F0@2")."""
    tasks = SCHEDULES[check_schedule(schedule)](stages, micro_batches, checkpoint, virtual)[stage]
    return " ".join(f"{task}@{task.chunk}" if virtual > 1 else str(task) for task in tasks)


def _laid_out(stages: int, micro_batches: int, checkpoint: str, duration, label: str, unit: str,
              schedule: str = "gpipe", virtual: int = 1) -> Timeline:
    plan = SCHEDULES[check_schedule(schedule)](stages, micro_batches, checkpoint, virtual)
    times = timeline(plan, duration)
    events = [Event(k, task.micro, task.op, start, end, "", task.chunk)
              for k, tasks in enumerate(plan) for task, (start, end) in zip(tasks, times[k])]
    return _timeline(label, stages, events, unit)
