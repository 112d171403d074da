"""Sweeps over K and M: the paper's speedup table and the bubble-vs-M curve, on this host.

A cell is *measured* when the host can run its K stages at once (K GPUs, or K cores at one
thread per stage); otherwise it is the *ideal replay* of task times measured one at a time, and
says so. Throughput is normalized to K=1, M=1 (one device; the paper's Table 2 has no such cell, it
normalizes to K=2, M=1, which a cell also carries as `vs_pair`) and to K=1 at
the same M, like with like: a measured cell by the measured K=1 step, a replayed cell by the
K=1 step's own task times laid end to end (a replay has no per-step overhead, so comparing it
with a measured step would flatter it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional

from . import replay
from .experiments import MEASURE_WARMUP, RunConfig, RunRecord, parallel_devices, run

# The recompute setting of every speedup table: each micro-batch re-materialized, as in the paper.
# One setting for the whole table; "except_last" would recompute nothing at M=1 and 31 of 32
# micro-batches at M=32, so rows would differ in work, not only in M.
TABLE_CHECKPOINT = "always"


def table_setting(device: str = "cpu", quick: bool = False, model: str = "transformer", seed: int = 0,
                  transport: str = "threads") -> RunConfig:
    """The model every speedup table trains (8 layers, so K runs up to 8), sized for the device:
    small enough for a CPU core per stage, wide enough on a GPU that a task is more than kernel
    launches. `quick` shrinks it for smoke runs."""
    gpu = device == "cuda"
    if model == "cnn":
        width, batch = (32 if quick else 64, 64 if quick else 128) if gpu else (8 if quick else 32, 32 if quick else 64)
    else:
        width, batch = (256 if quick else 1024, 32 if quick else 128) if gpu else (32 if quick else 128, 32 if quick else 64)
    return RunConfig(model=model, blocks=6, width=width, batch=batch, checkpoint=TABLE_CHECKPOINT, seed=seed,
                     device=device, transport=transport)


@dataclass(frozen=True)
class Cell:
    stages: int
    micro_batches: int
    samples_per_second: float
    vs_single: float          # over K=1 at the first M of the sweep (one device, M=1)
    vs_same_m: float          # over K=1 at the same M
    how: str                  # "measured" or "ideal replay"
    bubble: float
    transport: str = "threads"  # how the stages of a measured cell ran
    vs_pair: Optional[float] = None  # over K=2 at the first M: the paper's own normalization
    replayed_vs_same_m: Optional[float] = None  # the ideal replay's speedup over K=1 at the same M,
    # on any host (with replay_all): what claims about scaling are checked on

    @property
    def label(self) -> str:
        """"measured (threads)", "measured (processes)" or "ideal replay", as tables show it."""
        return f"measured ({self.transport})" if self.how == "measured" else self.how


def throughput(record: RunRecord) -> tuple[float, str, float]:
    """(samples/s, how, bubble) of a record: measured if the host ran its stages at once, else replayed."""
    config = RunConfig(**record.config)
    if config.stages <= parallel_devices(config):
        return record.samples_per_second, "measured", record.bubble
    line = replay.of_record(record, "ideal replay")
    return config.batch / line.makespan, "ideal replay", line.bubble


def measure_table(base: RunConfig, stages: Iterable[int] = (1, 2, 4, 8), micro: Iterable[int] = (1, 4, 32),
                  progress: Optional[Callable[[str], None]] = None, replay_all: bool = False) -> Iterator[Cell]:
    """Yield the cells of the grid as they are measured (K=1 first at each M, since the others are
    normalized to it). K larger than the model's layers, or M larger than the batch, is left out.
    With `base.transport="processes"` the cells the host can measure run one process per stage;
    K=1 (one stage, nothing crosses) and the replayed cells run their steps as threads. With
    `replay_all`, every cell also gets its ideal replay's speedup, whatever the host."""
    stages, micro = list(stages), list(micro)
    single: dict[tuple[int, str], float] = {}  # (M, how) -> K=1 samples/s
    pair: dict[str, float] = {}                # how -> K=2 samples/s at the first M (measured and replayed)
    for m in micro:
        if m > base.batch:
            continue
        for k in sorted(set([1] + stages)):
            if k > base.layers:
                continue
            if progress is not None:
                progress(f"K={k}, M={m}")
            transport = base.transport if 1 < k <= parallel_devices(base) else "threads"
            record = run(base.but(stages=k, micro_batches=m, transport=transport), replay="always" if replay_all else True)
            rate, how, bubble = throughput(record)
            replayed = base.batch / replay.of_record(record, "ideal replay").makespan
            if k == 1:
                single[(m, "measured")] = rate
                single[(m, "ideal replay")] = replayed
            if k == 2 and m == micro[0]:
                pair["ideal replay"] = replayed
                if how == "measured":
                    pair["measured"] = rate
            if k in stages:
                first = micro[0] if (micro[0], how) in single else m
                yield Cell(k, m, rate, rate / single[(first, how)], rate / single[(m, how)], how, bubble, transport,
                           rate / pair[how] if how in pair else None,
                           replayed / single[(m, "ideal replay")] if replay_all else None)


def table(base: RunConfig, stages: Iterable[int] = (1, 2, 4, 8), micro: Iterable[int] = (1, 4, 32),
          progress: Optional[Callable[[str], None]] = None, replay_all: bool = False) -> list[Cell]:
    """All cells of `measure_table`, normalized to K=1 at the first M (one device, M=1), to K=2 at
    the first M (the paper's normalization) and to K=1 at the same M."""
    return list(measure_table(base, stages, micro, progress, replay_all))


def bubble_point(record: RunRecord) -> tuple[int, float, str]:
    """(M, bubble, how) of one record: "measured (threads)" or "measured (processes)" when the host
    ran its K stages at once, else "ideal replay" (of the task times measured alone)."""
    _, how, bubble = throughput(record)
    return record.micro_batches, bubble, f"measured ({record.transport})" if how == "measured" else how


def bubble_points(base: RunConfig, micro: Iterable[int] = (1, 2, 4, 8, 16, 32)) -> list[tuple[int, float, str]]:
    """`bubble_point` for each M <= batch at the configuration's K."""
    return [bubble_point(run(base.but(micro_batches=m), replay=True)) for m in micro if m <= base.batch]


def transports(config: RunConfig, rounds: int, progress: Optional[Callable[[str], None]] = None,
               kinds: Iterable[str] = ("threads", "processes")) -> list[dict]:
    """Threads against processes (or one of them, `kinds`) at one configuration, measured as the app
    measures: for each, warm-up steps, then `rounds` steps, each followed by a K=1 step in this
    process (the two share the host's noise); a speedup is the median of the per-round ratios, shown
    with its range."""
    rows = []
    for name in kinds:
        if progress is not None:
            progress(f"{rounds} round(s), stages as {name}")
        record = run(config.but(transport=name), rounds=rounds, baseline=True, warmup=MEASURE_WARMUP)
        step, speed = record.spread("step"), record.spread("speedup")
        rows.append({"stages run as": name, "K": config.stages, "M": config.micro_batches,
                     "step ms": round(step[0] * 1e3, 1), "step ms range": f"{step[1] * 1e3:.1f} to {step[2] * 1e3:.1f}",
                     "speedup over K=1": round(speed[0], 2), "speedup range": f"{speed[1]:.2f} to {speed[2]:.2f}",
                     "communication share": round(record.spread("communication_share")[0], 3)})
    return rows
