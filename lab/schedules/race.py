"""The same configuration under every schedule, for side-by-side views: GPipe, 1F1B, interleaved
1F1B and ZB-H1 on one model, one K and one M, each measured (or replayed), with the theory beside."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Union

from engine.schedule import SCHEDULES
from lab import theory
from lab.config import SCHEDULE_ORDER, RunConfig, check
from lab.processes.sources import OWN, Pools
from lab.runs.experiments import RunRecord, parallel_devices, run
from lab.timelines import replay


@dataclass(frozen=True)
class ScheduleRun:
    """One schedule's step: how it was obtained, its timeline and what it held."""

    schedule: str
    virtual: int
    how: str                       # "measured (threads)", "measured (processes)" or "ideal replay"
    timeline: replay.Timeline
    record: RunRecord

    @property
    def peaks(self) -> list[int]:
        """Activation peak per stage (bytes), measured by the ledger."""
        return [m["activation_peak_bytes"] for m in self.record.memory]

    @property
    def theory_bubble(self) -> float:
        return theory.schedule_bubble(self.schedule, self.record.stages, self.record.micro_batches, self.virtual)

    def theory_in_flight(self) -> list[float]:
        """Peak micro-batches held per stage in the unit-cost model (in whole stages' worth)."""
        return [theory.peak_in_flight(self.schedule, self.record.stages, self.record.micro_batches, k, self.virtual)
                for k in range(self.record.stages)]


def variant(config: RunConfig, schedule: str, virtual: int = 2) -> RunConfig:
    """The configuration run under `schedule`, with `virtual` chunks per stage where the schedule
    places a number of them of one's choosing, else the number it places."""
    kind = SCHEDULES[schedule]
    return config.but(schedule=schedule, virtual_stages=virtual if kind.most_chunks is None else kind.fewest_chunks)


def compare(config: RunConfig, virtual: int = 2, progress: Optional[Callable[[str], None]] = None,
            skipped: Optional[list[str]] = None, replay_tasks: Union[bool, str] = True,
            pools: Pools = OWN) -> Iterator[ScheduleRun]:
    """Run `config` under each schedule in turn. Measured when the host has a core (or GPU) per
    stage, else the ideal replay of task times measured one at a time; each says which. A schedule
    the configuration cannot run (interleaved needs M a multiple of K and K*v layers) is left out,
    with the reason appended to `skipped`. `replay_tasks="always"` also times every task alone on
    hosts that measure, so claims checked on the ideal replays hold on any host. Stage processes
    come from `pools`."""
    for name in SCHEDULE_ORDER:
        each = variant(config, name, virtual)
        try:
            check(each)
        except ValueError as error:
            if skipped is not None:
                skipped.append(f"{name}: {error}")
            continue
        if progress is not None:
            progress(name)
        record = run(each, replay=replay_tasks, pools=pools)
        view = "measured" if each.stages <= parallel_devices(each) else "ideal replay"
        yield ScheduleRun(name, each.virtual_stages, replay.how_obtained(view, each.transport),
                          replay.of_record(record, view), record)
