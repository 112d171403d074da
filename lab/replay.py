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
from engine.trace import Event, Message, Trace

THEORY_COSTS = {"F": 1.0, "B": 2.0, "R": 1.0}


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
    def messages(self) -> list[Message]:
        return self.trace.messages


def _timeline(label: str, stages: int, events: list[Event], unit: str = "s", messages=()) -> Timeline:
    return Timeline(label, Trace(stages=stages, events=sorted(events, key=lambda e: (e.start, e.stage)),
                                 messages=list(messages)), unit)


def measured(events: list[dict], stages: int, label: str = "measured", messages: list[dict] = ()) -> Timeline:
    """The events of a run as a timeline (seconds from the step's start), with the messages
    between stage processes if there were any."""
    return _timeline(label, stages, [Event(e["stage"], e["micro"], e["op"], e["start"], e["end"], e.get("device", ""))
                                     for e in events], messages=[Message(**m) for m in messages])


def ideal_replay(events: list[dict], stages: int, micro_batches: int, checkpoint: str,
                 label: str = "ideal replay", schedule: str = "gpipe") -> Timeline:
    """Measured task durations replayed on K independent devices along the schedule."""
    durations = {(e["stage"], e["op"], e["micro"]): e["end"] - e["start"] for e in events}
    return _laid_out(stages, micro_batches, checkpoint, lambda k, task: durations[(k, task.op, task.micro)],
                     label, "s", schedule)


def theory(stages: int, micro_batches: int, checkpoint: str = "never", costs: Optional[dict] = None,
           schedule: str = "gpipe") -> Timeline:
    """The textbook diagram with unit costs (forward 1, backward 2, recompute 1), for GPipe's
    fill-drain order or another schedule of the engine (\"1f1b\")."""
    costs = costs or THEORY_COSTS
    label = "theory (unit costs)" if schedule == "gpipe" else f"theory (unit costs), {schedule}"
    return _laid_out(stages, micro_batches, checkpoint, lambda k, task: costs[task.op], label, "time units",
                     schedule)


def of_record(record, view: str) -> Timeline:
    """The timeline of a lab RunRecord for `view`: "measured", "ideal replay" or "theory"."""
    config = record.config
    if view == "measured":
        return measured(record.events, record.stages, f"measured ({record.transport})", record.messages)
    if view == "ideal replay":
        events = record.solo_events or record.events
        label = "ideal replay of tasks timed alone" if record.solo_events else "ideal replay of measured tasks"
        return ideal_replay(events, record.stages, record.micro_batches, config["checkpoint"], label,
                            config["schedule"])
    if view == "theory":
        return theory(record.stages, record.micro_batches, config["checkpoint"], schedule=config["schedule"])
    raise ValueError(f"unknown view {view!r}; expected 'measured', 'ideal replay' or 'theory'")


def task_order(stages: int, micro_batches: int, checkpoint: str, schedule: str, stage: int) -> str:
    """One stage's task list under a schedule, as text ("F0 F1 B0 ...")."""
    return " ".join(map(str, SCHEDULES[check_schedule(schedule)](stages, micro_batches, checkpoint)[stage]))


def _laid_out(stages: int, micro_batches: int, checkpoint: str, duration, label: str, unit: str,
              schedule: str = "gpipe") -> Timeline:
    plan = SCHEDULES[check_schedule(schedule)](stages, micro_batches, checkpoint)
    times = timeline(plan, duration)
    events = [Event(k, task.micro, task.op, start, end, "")
              for k, tasks in enumerate(plan) for task, (start, end) in zip(tasks, times[k])]
    return _timeline(label, stages, events, unit)
