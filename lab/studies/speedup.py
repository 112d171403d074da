"""Sweeps over K and M: the paper's speedup table and the bubble-vs-M curve, on this host.

A cell is *measured* when the host can run its K stages at once (K GPUs, or K cores at one
thread per stage); otherwise it is the *ideal replay* of task times measured one at a time, and
says so. Throughput is normalized to K=1, M=1 (one device; the paper's Table 2 has no such cell, it
normalizes to K=2, M=1, which a cell also carries as `vs_pair`) and to K=1 at
the same M, like with like: a measured cell by the measured K=1 step, a replayed cell by the
K=1 step's own task times laid end to end (a replay has no per-step overhead, so comparing it
with a measured step would flatter it).

On a GPU a task is worth timing only if the GPU, not Python, sets its pace: each stage's tasks
are issued by a host thread, and a small model's kernels finish before the next one is launched.
So the GPU table's model is sized for the GPU at hand (lab.studies.gpu_sizing), and a cell whose
stages fall under GPU_FLOOR (`stage_ratios` of its tasks timed alone) is not called measured, nor
replayed as if its task times were the GPU's.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional

from lab import zoo
from lab.config import MEASURE_WARMUP, RunConfig
from lab.machine import host
from lab.processes.sources import OWN, SHARED, Pools
from lab.runs.experiments import RunRecord, build, parallel_devices, run
from lab.studies.gpu_sizing import gpu_sizing, gpu_start, stage_seconds, stage_tflops
from lab.timelines import replay

# The recompute setting of every speedup table: each micro-batch re-materialized (GPipe as the
# paper describes it, §2.3).
# One setting for the whole table; "except_last" would recompute nothing at M=1 and 31 of 32
# micro-batches at M=32, so rows would differ in work, not only in M.
TABLE_CHECKPOINT = "always"


GPU_FLOOR = 3.0    # under this a cell is launch-bound: not measured, nor replayed as the GPU's time


def table_setting(device: str = "cpu", quick: bool = False, model: str = "transformer", seed: int = 0,
                  transport: str = "threads", precision: str = "float32") -> RunConfig:
    """The model every speedup table trains, sized for the device by its card (lab.zoo): 8 layers, so
    that K=8 holds one each, at the card's widths and batches (small enough on a CPU for a core per
    stage); for a card that leaves its GPU sizes to the GPU, the size lab.studies.gpu_sizing finds
    for the GPUs present (its smallest candidate where there are none). `quick` shrinks it for smoke runs."""
    card = zoo.card(model)
    if device == "cuda" and card.gpu_table is None:
        sizing = gpu_sizing(quick, model, seed, transport, precision)
        return sizing.config if sizing is not None else gpu_start(quick, model, seed, transport, precision)
    width, batch = (card.cpu_table if device == "cpu" else card.gpu_table)[0 if quick else 1]
    return RunConfig(model=model, blocks=max(1, 8 - card.extra_layers), width=width, batch=batch,
                     checkpoint=TABLE_CHECKPOINT, seed=seed, device=device, transport=transport, precision=precision)


def block_shares(config: RunConfig) -> list[float]:
    """Each stage's share of the work when the configuration's Transformer is cut as its balance says
    (the GPU table's: equal block counts), counted in blocks: the embedding does no multiply-adds and
    the head well under 1 % of a block's at the GPU table's widths (lab.runs.counts.layer_flops)."""
    from lab.runs.experiments import choose_balance
    model, (inputs, _), _ = build(config.but(width=8, batch=config.micro_batches, device="cpu"))
    blocks = [type(layer).__name__ == "Block" for layer in model]
    edges = list(itertools.accumulate(choose_balance(config, model, inputs), initial=0))
    return [sum(blocks[a:b]) / sum(blocks) for a, b in zip(edges, edges[1:])]


def table_transport(device: str) -> str:
    """How a GPU table's measured cells run their stages unless told: one process per GPU where there
    are two GPUs or more (as torch.distributed.pipelining runs them), unless the GPUs are
    EXCLUSIVE_PROCESS (the table measures on them in its own process too); else threads."""
    import torch
    several = device == "cuda" and torch.cuda.device_count() >= 2
    return "processes" if several and not host.exclusive_gpus() else "threads"


def stage_ratios(events: list[dict], stages: int) -> list[float]:
    """Per stage, the GPU seconds of its tasks over the host seconds spent issuing them (Event.host),
    from a step run one task at a time. Gated (`serial="gated"`, engine.device.Gate, as the sizing's
    probes run it), each task's kernels wait until the host has issued them all, then run back to back, so
    the GPU seconds are the GPU's work alone and the ratio reads below 1 where the host sets the pace;
    timed from an idle stream without the gate (a record's solo events), the GPU never takes less
    than the host, and the ratio reads 1.0 however launch-bound. 1.0 for a stage on a CPU, where the
    host thread is the device."""
    gpu, issued = stage_seconds(events, stages)
    return [g / h if h > 0 else 1.0 for g, h in zip(gpu, issued)]


@dataclass(frozen=True)
class Cell:
    stages: int
    micro_batches: int
    samples_per_second: float
    vs_single: float          # over K=1 at the first M of the sweep (one device, M=1)
    vs_same_m: float          # over K=1 at the same M
    how: str                  # "measured", "ideal replay" or "launch-bound"
    bubble: float
    transport: str = "threads"  # how the stages of a measured cell ran
    vs_pair: Optional[float] = None  # over K=2 at the first M: the paper's own normalization
    replayed_vs_same_m: Optional[float] = None  # the ideal replay's speedup over K=1 at the same M,
    # on any host (with replay_all): what claims about scaling are checked on
    gpu_ratio: Optional[float] = None  # on GPUs: the lowest stage's GPU time over host time per task
    threads_vs_same_m: Optional[float] = None  # on GPUs, a cell measured with processes: threads' speedup beside
    tflops: Optional[tuple[float, ...]] = None  # on GPUs, for the GPU table's model: each stage's TFLOP/s, tasks alone
    equal_stages: Optional[float] = None  # with replay_all: the replay with every op at its mean time (stages made
    # equal) over one device running the same tasks; it depends only on the schedule and the ops' cost
    # ratios, so claims about the shape of the table are judged on it on any host

    @property
    def label(self) -> str:
        """"measured (threads)", "measured (processes)", "ideal replay" or, on a GPU whose tasks
        are mostly launching, why the cell is neither, as tables show it."""
        if self.how == "launch-bound":
            return (f"not measured: launch-bound (GPU busy {self.gpu_ratio:.1f}x the host's time per task, "
                    f"{GPU_FLOOR:g}x needed, and K x for threads)")
        return replay.how_obtained(self.how, self.transport)


def cell_ratio(record: RunRecord) -> Optional[float]:
    """On GPUs, the lowest stage's GPU-over-host ratio of the record's tasks timed alone; else None."""
    if record.config["device"] != "cuda" or not record.solo_events:
        return None
    return min(stage_ratios(record.solo_events, record.stages))


def gpu_floor(config: RunConfig) -> float:
    """The GPU-over-host ratio under which a GPU cell is launch-bound: GPU_FLOOR, and for K stage
    threads at least K, since they share one interpreter: K GPUs stay busy only if each task keeps
    its GPU busy for as long as the K threads together take to issue their tasks."""
    return max(GPU_FLOOR, config.stages) if config.transport == "threads" else GPU_FLOOR


def launch_bound_notes(record: RunRecord) -> list[str]:
    """On GPUs, a sentence saying that a record's step was launch-bound, with its ratio (none when its
    tasks kept the GPUs busy, or on a CPU): shown wherever the record's figures are."""
    ratio = cell_ratio(record)
    floor = gpu_floor(RunConfig(**record.config))
    if ratio is None or ratio >= floor:
        return []
    return [f"Launch-bound: each task's GPU work took {ratio:.1f}x the host's time to issue it (under {floor:g}x), "
            f"so Python and kernel launches, not the GPU, set this step's pace; a faster GPU would not run it "
            f"faster. More work per task (width, batch, sequence length) gives the GPU the lead."]


def throughput(record: RunRecord) -> tuple[float, str, float]:
    """(samples/s, how, bubble) of a record: measured if the host ran its stages at once, else
    replayed; on GPUs "launch-bound" (the replay's figures, not to be read as the GPU's) when its
    tasks are under `gpu_floor`."""
    config = RunConfig(**record.config)
    ratio = cell_ratio(record)
    launch_bound = ratio is not None and ratio < gpu_floor(config)
    if not launch_bound and config.stages <= parallel_devices(config):
        return record.samples_per_second, "measured", record.bubble
    line = replay.of_record(record, "ideal replay")
    return config.batch / line.makespan, "launch-bound" if launch_bound else "ideal replay", line.bubble


def measure_table(base: RunConfig, stages: Iterable[int] = (1, 2, 4, 8), micro: Iterable[int] = (1, 4, 32),
                  progress: Optional[Callable[[str], None]] = None, replay_all: bool = False,
                  pools: Pools = SHARED) -> Iterator[Cell]:
    """Yield the cells of the grid as they are measured: K=1 at every M first, since the others are
    normalized to it, then each K at every M, so that one start of K stage processes serves all of
    K's cells. K larger than the model's layers, or M larger than the batch, is left out.
    With `base.transport="processes"` the cells the host can measure run one process per stage;
    K=1 (one stage, nothing crosses) and the replayed cells run their steps as threads. With
    `replay_all`, every cell also gets its ideal replay's speedup, whatever the host. On GPUs every
    cell is also run one task at a time, for its GPU-over-host ratio (`Cell.gpu_ratio`), and a cell
    measured with processes is measured with threads too (`Cell.threads_vs_same_m`). The cells'
    stage processes come from `pools`: by default the shared pool, kept up from cell to cell (on GPUs
    it drops its pipe before each cell: the GPUs hold one model at a time)."""
    stages, micro = list(stages), list(micro)
    sized_here = base.device == "cuda" and zoo.card(base.model).gpu_table is None  # the sized Transformer
    single: dict[tuple[int, str], float] = {}  # (M, how) -> K=1 samples/s
    pair: dict[str, float] = {}                # how -> K=2 samples/s at the first M (measured and replayed)
    for k in sorted(set([1] + stages)):
        for m in micro:
            if k > base.layers or m > base.batch:
                continue
            if base.device == "cuda":  # every run finds the GPUs as free as the sizing found them
                pools.free_gpus()
                host.free_gpu_memory()
            if progress is not None:
                progress(f"K={k}, M={m}")
            transport = base.transport if 1 < k <= parallel_devices(base) else "threads"
            record = run(base.but(stages=k, micro_batches=m, transport=transport),
                         replay="always" if replay_all or base.device == "cuda" else True, pools=pools)
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
                norm = "measured" if how == "measured" else "ideal replay"  # a launch-bound cell is a replay
                first = micro[0] if (micro[0], norm) in single else m
                threads = None
                if base.device == "cuda" and transport == "processes" and how == "measured":
                    beside = run(base.but(stages=k, micro_batches=m, transport="threads"), pools=pools)
                    threads = beside.samples_per_second / single[(m, "measured")]
                yield Cell(k, m, rate, rate / single[(first, norm)], rate / single[(m, norm)], how, bubble, transport,
                           rate / pair[norm] if norm in pair else None,
                           replayed / single[(m, "ideal replay")] if replay_all else None, cell_ratio(record), threads,
                           stage_tflops(RunConfig(**record.config), record.solo_events) if sized_here else None,
                           replay.with_mean_costs(record, per_stage=False).over_one_device if replay_all else None)


def table(base: RunConfig, stages: Iterable[int] = (1, 2, 4, 8), micro: Iterable[int] = (1, 4, 32),
          progress: Optional[Callable[[str], None]] = None, replay_all: bool = False) -> list[Cell]:
    """All cells of `measure_table`, normalized to K=1 at the first M (one device, M=1), to K=2 at
    the first M (the paper's normalization) and to K=1 at the same M."""
    return list(measure_table(base, stages, micro, progress, replay_all))


def bubble_point(record: RunRecord) -> tuple[int, float, str]:
    """(M, bubble, how) of one record: "measured (threads)" or "measured (processes)" when the host
    ran its K stages at once, else "ideal replay" (of the task times measured alone), or on GPUs
    "launch-bound (GPU 0.4x the host's time per task), replayed"."""
    _, how, bubble = throughput(record)
    if how == "launch-bound":
        how = f"launch-bound (GPU {cell_ratio(record):.1f}x the host's time per task), replayed"
    return record.micro_batches, bubble, replay.how_obtained(how, record.transport)


def bubble_points(base: RunConfig, micro: Iterable[int] = (1, 2, 4, 8, 16, 32),
                  pools: Pools = OWN) -> list[tuple[int, float, str]]:
    """`bubble_point` for each M <= batch at the configuration's K."""
    return [bubble_point(run(base.but(micro_batches=m), replay=True, pools=pools)) for m in micro if m <= base.batch]


def transports(config: RunConfig, rounds: int, progress: Optional[Callable[[str], None]] = None,
               kinds: Iterable[str] = ("threads", "processes"), pools: Pools = SHARED) -> list[dict]:
    """Threads against processes (or one of them, `kinds`) at one configuration, measured as the app
    measures: for each, warm-up steps, then `rounds` steps, each followed by a K=1 step in this
    process (the two share the host's noise); a speedup is the median of the per-round ratios, shown
    with its range."""
    rows = []
    for name in kinds:
        if progress is not None:
            progress(f"{rounds} round(s), stages as {name}")
        record = run(config.but(transport=name), rounds=rounds, baseline=True, warmup=MEASURE_WARMUP, pools=pools)
        step, speed = record.spread("step"), record.spread("speedup")
        rows.append({"stages run as": name, "K": config.stages, "M": config.micro_batches,
                     "step ms": round(step[0] * 1e3, 1), "step ms range": f"{step[1] * 1e3:.1f} to {step[2] * 1e3:.1f}",
                     "speedup over K=1": round(speed[0], 2), "speedup range": f"{speed[1]:.2f} to {speed[2]:.2f}",
                     "communication share": round(record.spread("communication_share")[0], 3)})
    return rows
