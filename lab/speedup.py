"""Sweeps over K and M: the paper's speedup table and the bubble-vs-M curve, on this host.

A cell is *measured* when the host can run its K stages at once (K GPUs, or K cores at one
thread per stage); otherwise it is the *ideal replay* of task times measured one at a time, and
says so. Throughput is normalized to K=1, M=1 (the paper's single-device baseline) and to K=1 at
the same M.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from . import replay
from .experiments import RunConfig, RunRecord, parallel_devices, run


@dataclass(frozen=True)
class Cell:
    stages: int
    micro_batches: int
    samples_per_second: float
    vs_single: float          # over K=1, M=1
    vs_same_m: float          # over K=1 at the same M
    how: str                  # "measured" or "ideal replay"
    bubble: float


def throughput(record: RunRecord) -> tuple[float, str, float]:
    """(samples/s, how, bubble) of a record: measured if the host ran its stages at once, else replayed."""
    config = RunConfig(**record.config)
    if config.stages <= parallel_devices(config):
        return record.samples_per_second, "measured", record.bubble
    line = replay.of_record(record, "ideal replay")
    return config.batch / line.makespan, "ideal replay", line.bubble


def table(base: RunConfig, stages: Iterable[int] = (1, 2, 4, 8), micro: Iterable[int] = (1, 4, 32),
          progress: Optional[Callable[[str], None]] = None) -> list[Cell]:
    """Every valid (K, M) of the grid, each normalized to the K=1 runs of the same model and batch.

    K larger than the model's layers, or M larger than the batch, is left out."""
    stages, micro = list(stages), list(micro)
    single: dict[int, float] = {}
    cells = []
    for m in micro:
        if m > base.batch:
            continue
        for k in sorted(set([1] + stages)):
            if k > base.layers:
                continue
            if progress is not None:
                progress(f"K={k}, M={m}")
            rate, how, bubble = throughput(run(base.but(stages=k, micro_batches=m), replay=True))
            single.setdefault(m, rate if k == 1 else single.get(m))
            if k in stages:
                cells.append(Cell(k, m, rate, 0.0, rate / single[m], how, bubble))
    baseline = single.get(1) or min(single.values())
    return [Cell(c.stages, c.micro_batches, c.samples_per_second, c.samples_per_second / baseline,
                 c.vs_same_m, c.how, c.bubble) for c in cells]


def bubble_points(base: RunConfig, micro: Iterable[int] = (1, 2, 4, 8, 16, 32)) -> list[tuple[int, float, str]]:
    """(M, bubble, how) for each M <= batch at the configuration's K: measured or replayed."""
    points = []
    for m in micro:
        if m <= base.batch:
            _, how, bubble = throughput(run(base.but(micro_batches=m), replay=True))
            points.append((m, bubble, how))
    return points
