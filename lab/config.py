"""What a run of the lab is, without torch: its settings (RunConfig) and their checks, and the
app's defaults (a model's own ranges are on its card, lab.zoo).

Nothing here imports torch, which takes seconds to load on a cold start: the app draws its
controls and the theory diagram from this module (and lab.timelines.replay, lab.views.charts) while it loads.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

from engine.schedule import SCHEDULES, check_checkpoint_mode, check_layout, check_schedule
from lab.zoo import card

BALANCES = ("uniform", "blocks", "time", "size")
TRANSPORTS = ("threads", "processes")
PRECISIONS = ("float32", "bf16")
SCHEDULE_ORDER = tuple(name for name, kind in SCHEDULES.items() if kind.compared)  # the ones the lab races


@dataclass(frozen=True)
class RunConfig:
    """One point of the lab: which model, how big, and how it is pipelined."""

    model: str = "transformer"
    blocks: int = 6              # blocks of the zoo model; the pipeline sees blocks + extra layers
    width: int = 64
    batch: int = 32              # N, the mini-batch
    stages: int = 4              # K
    micro_batches: int = 8       # M
    checkpoint: str = "except_last"
    schedule: str = "gpipe"      # or another name in engine.schedule.SCHEDULES: the orders that came after GPipe
    virtual_stages: int = 1      # chunks of layers per stage (v): as many as the schedule places (its Kind says)
    balance: str = "uniform"     # uniform (by layer count), blocks (equal block counts), time or size
    seed: int = 0
    device: str = "cpu"          # "cpu": every stage on the CPU; "cuda": stages spread over the GPUs
    threads_per_stage: int = 1   # on CPU: one core per stage, as the paper has one chip per stage
    transport: str = "threads"   # stages as threads of this process, or "processes" (one each, gloo)
    context: int = 0             # a sequence model's tokens per sample; 0: its card's (the zoo's 32 characters)
    precision: str = "float32"   # or "bf16": every task under torch.autocast in bfloat16, recompute included

    @property
    def layers(self) -> int:
        return card(self.model).layer_count(self.blocks)

    def but(self, **changes) -> "RunConfig":
        """A copy with some fields changed."""
        return replace(self, **changes)


# What the app opens with. Its stages run as processes: measured at these settings on 2 cores, one
# process per stage beats threads of one interpreter (python -m lab.reproduce transports; docs/benchmarks.md).
APP_DEFAULT = RunConfig(model="transformer", blocks=6, width=128, batch=32, stages=2, micro_batches=16,
                        checkpoint="except_last", transport="processes")
# How the app (and `python -m lab.reproduce transports`) measures a setting: warm-up steps, then
# rounds of one step beside one K=1 step, every figure the median over the rounds with its range.
MEASURE_WARMUP, MEASURE_ROUNDS, MAX_ROUNDS = 4, 11, 100

# What a page of the app may ask for: its controls' ranges, capped so that any setting runs in
# seconds on 2 CPU cores (the defaults, the last widths, make ops big enough that two stage threads
# overlap well). The app checks every setting against them again (check_page), whatever the
# request said: a hand-edited session or request cannot start work beyond them.
PAGE_STAGES, PAGE_MICRO, PAGE_VIRTUAL, PAGE_SEED = 8, 64, (2, 4), 10_000  # the most K, M; v's range; the last seed
PAGE_PINS = 8  # pinned runs a session keeps (the latest)


def measure_rounds() -> int:
    """The rounds a setting is measured over: MEASURE_ROUNDS, or GPIPE_LAB_ROUNDS=n (more for
    steadier figures on a noisy host, fewer for a quick look on a slow one)."""
    asked = os.environ.get("GPIPE_LAB_ROUNDS")
    if asked is None:
        return MEASURE_ROUNDS
    if not asked.isdigit() or not 1 <= int(asked) <= MAX_ROUNDS:
        raise ValueError(f"GPIPE_LAB_ROUNDS={asked!r}: expected a whole number of rounds from 1 to {MAX_ROUNDS}")
    return int(asked)


def micro_batch_count(config: RunConfig) -> int:
    """How many micro-batches the pipeline runs: what torch.chunk makes of N in M pieces (it can
    be fewer than M)."""
    return len(range(config.batch)[::-(-config.batch // config.micro_batches)])


def baseline_of(config: RunConfig) -> RunConfig:
    """K=1 at the same M: one stage, in this process, on one thread (one stage needs no transport,
    nor a schedule, so every setting compares with the same run)."""
    return config.but(stages=1, balance="uniform", transport="threads", schedule="gpipe", virtual_stages=1)


def check(config: RunConfig) -> None:
    """Raise ValueError with a message a learner can act on if the configuration cannot run."""
    card(config.model)
    if config.blocks < 1 or config.width < 1 or config.batch < 1:
        raise ValueError("blocks, width and batch must all be at least 1")
    if config.threads_per_stage < 1:
        raise ValueError(f"threads_per_stage={config.threads_per_stage}: expected at least 1")
    if config.stages < 1:
        raise ValueError(f"K={config.stages}: a pipeline needs at least one stage")
    if config.stages > config.layers:
        raise ValueError(f"K={config.stages} stages but the {config.model} has only {config.layers} layers "
                         f"({config.blocks} blocks + {config.layers - config.blocks}): use K <= {config.layers} "
                         f"or more blocks")
    if config.micro_batches < 1:
        raise ValueError(f"M={config.micro_batches}: a mini-batch is cut into at least one micro-batch")
    check_checkpoint_mode(config.checkpoint)  # the engine's own checks (engine.schedule needs no torch)
    check_schedule(config.schedule)
    check_layout(config.schedule, config.stages, config.micro_batches, config.virtual_stages, config.layers)
    if config.balance not in BALANCES:
        raise ValueError(f"balance={config.balance!r}: expected one of {BALANCES}")
    if config.balance == "blocks" and config.stages * config.virtual_stages > config.blocks:
        raise ValueError(f"balance='blocks' with {config.stages * config.virtual_stages} chunks but {config.blocks} "
                         f"blocks: expected at most one chunk per block")
    if config.device not in ("cpu", "cuda"):
        raise ValueError(f"device={config.device!r}: expected 'cpu' or 'cuda'")
    if config.transport not in TRANSPORTS:
        raise ValueError(f"transport={config.transport!r}: expected one of {TRANSPORTS}")
    if config.precision not in PRECISIONS:
        raise ValueError(f"precision={config.precision!r}: expected one of {PRECISIONS}")
    if config.context < 0 or (config.context and not card(config.model).sequence):
        raise ValueError(f"context={config.context}: " + ("expected a length of at least 1, or 0 for the model's own"
                         if config.context < 0 else f"the {config.model} has no sequence; leave context at 0"))
    if config.device == "cuda" and not _cuda_available():
        raise ValueError("device='cuda' but this host has no CUDA GPU (torch.cuda.is_available() is False)")
    if config.device == "cuda" and config.transport == "processes":
        import torch

        from lab.machine.host import stage_processes_refused_here  # what ProcessPool would refuse, said before a run
        refused = stage_processes_refused_here(config.stages, torch.cuda.is_initialized())
        if refused:
            raise ValueError(f"K={config.stages} stage processes on GPUs: {refused}")


def chunks_offered(schedule: str):
    """The chunks per stage (v) the app offers for `schedule`: the page's range where the schedule
    leaves the number to the user (interleaved), else the one number it places."""
    kind = SCHEDULES[check_schedule(schedule)]
    if kind.most_chunks == kind.fewest_chunks:
        return (kind.fewest_chunks,)
    most = min(kind.most_chunks or PAGE_VIRTUAL[1], PAGE_VIRTUAL[1])
    return range(max(kind.fewest_chunks, PAGE_VIRTUAL[0]), most + 1)


def check_page(config: RunConfig) -> None:
    """Raise ValueError if `config` is beyond what the app's controls offer (PAGE_*)."""
    model = card(config.model)
    offered = {"blocks": (config.blocks, range(1, model.page_blocks + 1)),
               "width": (config.width, model.page_widths), "batch": (config.batch, model.page_batches),
               "K": (config.stages, range(1, PAGE_STAGES + 1)), "M": (config.micro_batches, range(1, PAGE_MICRO + 1)),
               "v": (config.virtual_stages, chunks_offered(config.schedule)),
               "seed": (config.seed, range(PAGE_SEED + 1)), "threads per stage": (config.threads_per_stage, (1,)),
               "context": (config.context, (0,)), "precision": (config.precision, ("float32",))}
    for name, (value, allowed) in offered.items():
        if value not in allowed:
            offers = f"{allowed[0]} to {allowed[-1]}" if isinstance(allowed, range) else ", ".join(map(str, allowed))
            raise ValueError(f"{name}={value!r} is beyond what this page offers for the {config.model} ({offers})")


def _cuda_available() -> bool:
    import torch  # the one check that needs torch, loaded only when a GPU is asked for
    return torch.cuda.is_available()


check_page(APP_DEFAULT)  # the page opens with what it offers
