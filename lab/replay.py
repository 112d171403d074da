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

from engine.schedule import gpipe, timeline

THEORY_COSTS = {"F": 1.0, "B": 2.0, "R": 1.0}


@dataclass(frozen=True)
class Bar:
    stage: int
    micro: int
    op: str
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """Bars of one step, with what they are (`label`) and the unit of time (`unit`)."""

    label: str
    stages: int
    bars: tuple[Bar, ...]
    unit: str = "s"

    @property
    def makespan(self) -> float:
        return max((b.end for b in self.bars), default=0.0)

    @property
    def busy(self) -> list[float]:
        totals = [0.0] * self.stages
        for b in self.bars:
            totals[b.stage] += b.end - b.start
        return totals

    @property
    def bubble(self) -> float:
        """Idle fraction: 1 - sum(busy) / (K * makespan)."""
        span = self.makespan
        return 1.0 - sum(self.busy) / (self.stages * span) if span > 0 else 0.0


def measured(events: list[dict], stages: int, label: str = "measured") -> Timeline:
    """The events of a run as a timeline (seconds from the step's start)."""
    bars = tuple(Bar(e["stage"], e["micro"], e["op"], e["start"], e["end"]) for e in events)
    return Timeline(label, stages, bars)


def ideal_replay(events: list[dict], stages: int, micro_batches: int, checkpoint: str,
                 label: str = "ideal replay") -> Timeline:
    """Measured task durations replayed on K independent devices along the GPipe schedule."""
    durations = {(e["stage"], e["op"], e["micro"]): e["end"] - e["start"] for e in events}
    return _laid_out(stages, micro_batches, checkpoint, lambda k, task: durations[(k, task.op, task.micro)],
                     label, "s")


def theory(stages: int, micro_batches: int, checkpoint: str = "never",
           costs: Optional[dict] = None) -> Timeline:
    """The textbook fill-drain diagram with unit costs (forward 1, backward 2, recompute 1)."""
    costs = costs or THEORY_COSTS
    return _laid_out(stages, micro_batches, checkpoint, lambda k, task: costs[task.op],
                     "theory (unit costs)", "time units")


def of_record(record, view: str) -> Timeline:
    """The timeline of a lab RunRecord for `view`: "measured", "ideal replay" or "theory"."""
    config = record.config
    if view == "measured":
        return measured(record.events, record.stages)
    if view == "ideal replay":
        events = record.solo_events or record.events
        label = "ideal replay of tasks timed alone" if record.solo_events else "ideal replay of measured tasks"
        return ideal_replay(events, record.stages, record.micro_batches, config["checkpoint"], label)
    if view == "theory":
        return theory(record.stages, record.micro_batches, config["checkpoint"])
    raise ValueError(f"unknown view {view!r}; expected 'measured', 'ideal replay' or 'theory'")


def _laid_out(stages: int, micro_batches: int, checkpoint: str, duration, label: str, unit: str) -> Timeline:
    schedule = gpipe(stages, micro_batches, checkpoint)
    times = timeline(schedule, duration)
    bars = tuple(Bar(k, task.micro, task.op, start, end)
                 for k, tasks in enumerate(schedule) for task, (start, end) in zip(tasks, times[k]))
    return Timeline(label, stages, bars, unit)
