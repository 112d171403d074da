"""The GPU table's Transformer, sized by arithmetic on measured rates so that the GPU sets each task's pace.

A stage's tasks are issued by a host thread; a small model's kernels finish before Python launches
the next, and the table would then time Python. So the table's model is chosen, among sizes of
width, sequence length, batch and depth, as the cheapest whose every stage at the table's hardest
cell (K=8, M=32: the fewest tokens per task) keeps the GPU busy GPU_TARGET times as long as the host
takes to issue it, and whose every cell fits the GPUs at hand.

1. **Rates, probed per stage.** For a (width, context), two short gated steps (engine.device.Gate:
   each task's kernels run back to back once the host has issued it) of a stage of one block and of
   two, on PROBE_TOKENS tokens: a block's GPU seconds per token, the host's seconds per block and per
   stage, and the bytes a block and the rest of a stage hold per token at their peak. Never the whole
   batch at once, and never a model of the table's depth.
2. **Arithmetic** (`ratios`, `peak_bytes`): each candidate's ratio per stage at K=8, M=32, and its
   bytes per GPU at every cell of the table (weights and gradients, the inputs GPipe keeps for every
   micro-batch, one micro-batch's recomputed blocks), stages sharing a GPU summed.
3. **A check.** The cheapest candidate that meets the target and fits is probed once more per stage
   composition at its own tokens; it is chosen if the measured ratios meet the target too.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from typing import Callable, NamedTuple, Optional, Sequence

from lab import zoo
from lab.config import RunConfig
from lab.machine import host

GPU_TARGET = 10.0     # GPU time over host time per task the table's model is sized for, on every stage
FIT_SHARE = 0.8       # of each GPU's free memory the arithmetic lets a cell use (the rest: allocator slack, libraries)
HOST_SHARE = 0.7      # of the host memory free at sizing, what the table's models may take to build
TABLE_STAGES, TABLE_MICRO = (1, 2, 4, 8), (1, 4, 32)   # the paper's Table 2 grid, which every cell must fit
WIDTHS = (1024, 2048, 3072, 4096)
CONTEXTS = (128, 256, 512, 1024)   # tokens per sequence: the paper's Transformers read hundreds
BATCHES = (32, 64, 128, 256, 512)  # at least 32, so that M=32 has a sequence per micro-batch
DEPTHS, DEPTHS_QUICK = (24, 16), (16,)  # blocks: 3 or 2 per stage at K=8
PROBE_TOKENS = 4096
PROCESS_BYTES = 2 ** 30  # a stage process's CUDA context and libraries' workspaces on its GPU, about
CHECKS = 3            # candidates checked at most: past that, the best measured
SIZING_FILE = "GPIPE_LAB_SIZING_FILE"  # environment variable: where a sizing is kept for later processes


class Probe(NamedTuple):
    """One gated K=1, M=1 step, recompute on: GPU and host seconds of its F, R and B, and its peak."""

    gpu: float
    host: float
    peak_bytes: float   # held above the weights and gradients (the allocator's on a GPU, the ledger's on a CPU)
    tokens: int


@dataclass(frozen=True)
class Rates:
    """A Transformer block at one (width, context) on the GPU at hand, from two probes."""

    gpu_per_token: float    # GPU seconds per token of one block's F, R and B
    host_per_block: float   # host seconds to issue one block's F, R and B
    host_per_stage: float   # host seconds per stage's F, R and B beside its blocks (the task loop, embedding, head)
    block_per_token: float  # bytes a block adds to its stage's peak per token of a micro-batch
    stage_per_token: float  # bytes per token the rest of a stage holds at the peak (logits, the embedding's output)


def rates_from(one: Probe, two: Probe) -> Rates:
    """Rates from probes of a stage of one block and of two on the same tokens (the difference is a block)."""
    per_block = max(two.host - one.host, 0.0)
    block_bytes = max(two.peak_bytes - one.peak_bytes, 0.0)
    return Rates(max(two.gpu - one.gpu, 0.0) / one.tokens, per_block, one.host - per_block,
                 block_bytes / one.tokens, max(one.peak_bytes - block_bytes, 0.0) / one.tokens)


@dataclass(frozen=True)
class Shape:
    """What the arithmetic knows of one candidate without building it: its parameters per layer."""

    width: int
    context: int
    batch: int
    blocks: int
    block_parameters: int
    extra_parameters: tuple[int, int]   # the embedding's and the head's

    def tokens(self, micro: int) -> int:
        """Tokens per micro-batch at M=`micro` (torch.chunk's pieces: the largest)."""
        return -(-self.batch // micro) * self.context

    def stage_blocks(self, stages: int) -> list[int]:
        """Blocks per stage in the GPU table's cut, equal block counts (balance="blocks")."""
        from engine.partition import even_balance
        return even_balance(self.blocks, stages)

    def forward_flops_per_token(self) -> float:
        """A block's forward FLOPs per token: 2 per weight of its matrix products, and causal
        attention's scores and weighted sum (2 x 2 x context x width, halved by the mask)."""
        return 2 * self.block_parameters + 2 * self.context * self.width

    def step_flops(self) -> float:
        """One step's FLOPs (forward, recompute, backward: 4 forwards): how the candidates are ordered."""
        return 4 * self.forward_flops_per_token() * self.blocks * self.batch * self.context


def shape_of(width: int, context: int, batch: int, blocks: int, model: str = "transformer") -> Shape:
    """A candidate's parameters per layer, counted on the meta device (nothing allocated)."""
    counts = _parameter_counts(model, width, context)
    return Shape(width, context, batch, blocks, counts[1], (counts[0], counts[2]))


@lru_cache(maxsize=None)
def _parameter_counts(model: str, width: int, context: int) -> tuple[int, int, int]:
    import torch
    with torch.device("meta"):
        layers = zoo.build(model, 1, width, 0, context)
    return tuple(sum(p.numel() for p in layer.parameters()) for layer in layers)


def ratios(shape: Shape, rates: Rates, stages: int = 8, micro: int = 32) -> list[float]:
    """Each stage's GPU time over host time per task set at K=`stages`, M=`micro`, by arithmetic."""
    tokens = shape.tokens(micro)
    return [n * rates.gpu_per_token * tokens / (rates.host_per_stage + n * rates.host_per_block) if n else 0.0
            for n in shape.stage_blocks(stages)]


def peak_bytes(shape: Shape, rates: Rates, gpus: int, bf16: bool = False, per_process: float = 0.0,
               grid: tuple[Sequence[int], Sequence[int]] = (TABLE_STAGES, TABLE_MICRO)) -> dict[tuple[int, int], float]:
    """(K, M) -> the bytes the busiest GPU holds at that cell, stage s on GPU s % `gpus`: per stage its
    weights and gradients (float32; with bf16 autocast, its weights' bfloat16 copies too) and the
    inputs GPipe keeps for all M micro-batches until their backward (ids on the first stage, float32
    activations after); and one micro-batch's recomputed blocks (and the rest of its peak) for as many
    of the GPU's stages as can hold one at once: at most M, one micro-batch each; and `per_process`
    on every GPU, the CUDA context of a stage process of the shared pool, up from cell to cell."""
    per_parameter = 8 + (2 if bf16 else 0)
    cells = {}
    for stages in grid[0]:
        if stages > shape.blocks:
            continue
        for micro in grid[1]:
            tokens, graphs = shape.tokens(micro), [[] for _ in range(gpus)]
            held = [per_process] * min(gpus, stages)   # the shared pool's processes stay up from cell to cell
            for stage, blocks in enumerate(shape.stage_blocks(stages)):
                parameters = blocks * shape.block_parameters + shape.extra_parameters[0] * (stage == 0) \
                    + shape.extra_parameters[1] * (stage == stages - 1)
                kept = shape.batch * shape.context * (8 if stage == 0 else 4 * shape.width)
                held[stage % gpus] += per_parameter * parameters + kept
                graphs[stage % gpus].append(tokens * (blocks * rates.block_per_token + rates.stage_per_token))
            cells[(stages, micro)] = max(h + sum(sorted(g)[-micro:]) for h, g in zip(held, graphs))
    return cells


def host_bytes_to_build(config: RunConfig, stages: int) -> int:
    """Host memory the table needs to build `config`'s model: its float32 weights in this process
    (built on the host, then moved to the GPUs), and in each of `stages` stage processes too when the
    stages are processes (each builds the whole model, then keeps its part). Counted on the meta
    device: nothing is allocated."""
    import torch
    with torch.device("meta"):
        model = zoo.build(config.model, config.blocks, config.width, config.seed, config.context)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return weights * (1 + (stages if config.transport == "processes" else 0))


@dataclass(frozen=True)
class Sizing:
    """What the sizing chose and why: the setting, each stage's measured ratio at the hardest cell
    (K=8, M=32), the FLOPs and TFLOP/s behind them, and what it made of each candidate it weighed."""

    config: RunConfig
    ratios: tuple[float, ...]   # per stage: GPU over host time per task set, measured by the check
    met: bool
    tokens: int                 # per micro-batch at M=32
    task_flops: float           # of the fewest-block stage's F task there
    tflops: tuple[float, ...]   # per stage, the TFLOP/s its checked tasks reached
    tried: tuple[str, ...]      # one line per candidate weighed

    def describe(self) -> str:
        """One line for a table's header."""
        c = self.config
        verdict = "met" if self.met else "NOT met: the best that fits"
        return (f"sized for the GPU by arithmetic on measured rates: width {c.width}, context {c.context}, batch "
                f"{c.batch}, {c.blocks} blocks; at K=8, M=32 {self.tokens} tokens per micro-batch, "
                f"{self.task_flops / 1e9:.1f} GFLOP per F task of the smallest stage; GPU time over host time per "
                f"task, per stage: {', '.join(f'{r:.1f}' for r in self.ratios)} (target {GPU_TARGET:g}x: {verdict}); "
                f"TFLOP/s per stage: {', '.join(f'{t:.1f}' for t in self.tflops)}; {precision_said(c.precision)}")


def precision_said(precision: str) -> str:
    """The table's arithmetic as a reader needs it said: float32 with TF32 matrix products on or off, or bf16."""
    import torch
    if precision == "bf16":
        return "precision: bfloat16 autocast around every task, recompute included (float32 weights)"
    matmul = torch.backends.cuda.matmul
    chosen = getattr(matmul, "fp32_precision", "none")   # the newer setting, read first: once it is set,
    tf32 = chosen == "tf32" if chosen != "none" else matmul.allow_tf32   # reading the older flag raises
    return f"precision: float32, TF32 matrix products {'on' if tf32 else 'off'} (torch.backends.cuda.matmul)"


def sized(start: RunConfig, probe: Callable[[RunConfig], Probe], free_bytes: Sequence[int],
          quick: bool = False, host_bytes: Callable[[], int] = host.available_host_bytes) -> Sizing:
    """The cheapest candidate (by step FLOPs) whose every stage meets GPU_TARGET at K=8, M=32 and
    whose every cell fits `free_bytes` (each GPU's, FIT_SHARE of it), by the arithmetic on rates
    `probe` measured (runs of `RunConfig`s of one stage), checked by `probe` at its own tokens (a check
    that measures other than predicted scales the predictions after it); where none does, of those
    that fit, the one the arithmetic put highest, checked."""
    rates: dict = {}
    tried, best, fallback, refused = [], None, None, {"fit": 0, "build": 0}
    shapes = sorted((shape_of(w, c, b, n, start.model) for w in WIDTHS for c in CONTEXTS for b in BATCHES
                     for n in (DEPTHS_QUICK if quick else DEPTHS)), key=Shape.step_flops)
    budget, calibration = FIT_SHARE * min(free_bytes), 1.0
    for shape in shapes:
        config = start.but(width=shape.width, context=shape.context, batch=shape.batch, blocks=shape.blocks)
        if 8 * shape.blocks * shape.block_parameters > budget:   # the weights and gradients at K=1 alone
            refused["fit"] += 1
            continue
        if host_bytes_to_build(config, min(8, len(free_bytes))) > HOST_SHARE * host_bytes():  # processes: K <= GPUs
            refused["build"] += 1
            continue
        key = (shape.width, shape.context)
        if key not in rates:
            rates[key] = rates_from(*(probe(_probe_config(config, n, PROBE_TOKENS)) for n in (1, 2)))
        cells = peak_bytes(shape, rates[key], len(free_bytes), start.precision == "bf16",
                           PROCESS_BYTES if start.transport == "processes" else 0.0)
        if max(cells.values()) > budget:
            refused["fit"] += 1
            continue
        predicted = min(ratios(shape, rates[key])) * calibration
        if predicted < GPU_TARGET:
            fallback = max(fallback or (predicted, shape, config), (predicted, shape, config), key=lambda f: f[0])
            continue
        checked = _check(config, shape, probe)
        tried.append(f"{_label(shape)}: predicted {predicted:.1f}x, measured {min(checked.ratios):.1f}x")
        calibration *= min(checked.ratios) / predicted   # what the arithmetic missed, applied to the sizes after
        best = max(best or checked, checked, key=lambda s: min(s.ratios))
        if checked.met or len(tried) == CHECKS:
            break
    if best is None and fallback is not None:
        best = _check(fallback[2], fallback[1], probe)
        tried.append(f"{_label(fallback[1])}: predicted {fallback[0]:.1f}x (the highest of any that fit), "
                     f"measured {min(best.ratios):.1f}x")
    tried.append(f"{refused['fit']} sizes would not fit {FIT_SHARE:.0%} of the GPU's free "
                 f"{min(free_bytes) / 2 ** 30:.1f} GiB at some cell; {refused['build']} not the host's memory")
    if best is None:
        raise RuntimeError(f"no size of the GPU table's model fits this host's GPUs: {'; '.join(tried)}")
    return replace(best, tried=tuple(tried))


def _label(shape: Shape) -> str:
    return f"width {shape.width}, context {shape.context}, batch {shape.batch}, {shape.blocks} blocks"


def _check(config: RunConfig, shape: Shape, probe: Callable[[RunConfig], Probe]) -> Sizing:
    """Each stage composition of K=8 probed at M=32's tokens: the ratios and TFLOP/s it measured."""
    tokens, blocks = shape.tokens(32), shape.stage_blocks(8)
    measured = {n: probe(_probe_config(config, n, tokens)) for n in sorted(set(blocks))}
    flops = {n: 4 * n * shape.forward_flops_per_token() * tokens for n in measured}
    found = tuple(measured[n].gpu / measured[n].host for n in blocks)
    tflops = tuple(flops[n] / measured[n].gpu / 1e12 for n in blocks)
    return Sizing(config, found, min(found) >= GPU_TARGET, tokens, flops[min(blocks)] / 4, tflops, ())


def _probe_config(config: RunConfig, blocks: int, tokens: int) -> RunConfig:
    """One stage of `blocks` blocks (with the embedding and head) on about `tokens` tokens, recompute on."""
    return config.but(blocks=blocks, batch=max(1, tokens // config.context), stages=1, micro_batches=1,
                      checkpoint="always", transport="threads")


def probe_on_gpu(config: RunConfig) -> Probe:
    """`Probe` of one configuration of one stage, built on its device (a wide block takes seconds to
    initialise on the host): after a warm-up, the allocator's peak of one step above what it held
    before, less autocast's weight copies (on a CPU, the ledger's peak), then the
    gated task times of five (lab.runs.experiments.solo_events) after a gated warm-up."""
    import torch

    from lab.runs.experiments import build, devices_for, pipeline, solo_events
    device = devices_for(config)[0]
    model, (inputs, targets), loss_fn = build(config, on=device)
    pipe = pipeline(config, model, [config.layers], record_memory=True)
    try:
        pipe.step(inputs, targets, loss_fn)        # libraries' workspaces and the allocator's pools made
        pipe.zero_grad(set_to_none=True)           # as the table's steps start: no gradients yet
        held = torch.cuda.memory_allocated(device) if config.device == "cuda" else 0
        pipe.step(inputs, targets, loss_fn)
        memory = pipe.trace.memory[0]
        copies = memory.param_bytes // 2 if config.precision == "bf16" else 0   # autocast's bfloat16 weights
        peak = (memory.device_peak_bytes - held - copies   # gradients left in: at R's end some exist, at B's all
                if memory.device_peak_bytes is not None else memory.activation_peak_bytes)
        pipe.record_memory = False
        pipe.step(inputs, targets, loss_fn, serial="gated")   # the gate learns the host's time per task
        events = solo_events(pipe, inputs, targets, loss_fn, serial="gated")
    finally:
        pipe.close()
        del pipe, model
        host.free_gpu_memory()
    (gpu,), (issued,) = stage_seconds(events, 1)
    return Probe(gpu, issued, float(peak), config.batch * config.context)


def gpu_start(quick: bool = False, model: str = "transformer", seed: int = 0, transport: str = "threads",
              precision: str = "float32") -> RunConfig:
    """The GPU table's Transformer before sizing: the smallest candidate, recompute on, cut in equal
    block counts (at K=8 a stage of the embedding or the head and fewer blocks would set the ratio)."""
    from lab.studies.speedup import TABLE_CHECKPOINT
    return RunConfig(model=model, blocks=(DEPTHS_QUICK if quick else DEPTHS)[-1], width=WIDTHS[0],
                     context=CONTEXTS[0], batch=BATCHES[0], checkpoint=TABLE_CHECKPOINT, seed=seed, device="cuda",
                     transport=transport, balance="blocks", precision=precision)


def gpu_sizing(quick: bool = False, model: str = "transformer", seed: int = 0,
               transport: Optional[str] = None, precision: str = "float32") -> Optional[Sizing]:
    """The sizing of the GPU table's model on this host's GPUs (once per process, and once per
    doctor run: `kept_sizing`), for stages as `transport` (default: as the table runs them); None
    where there is no GPU, or for a model whose card fixes its GPU sizes."""
    import torch
    if zoo.card(model).gpu_table is not None or not torch.cuda.is_available():
        return None
    from lab.studies.speedup import table_transport
    start = gpu_start(quick, model, seed, transport or table_transport("cuda"), precision)
    return kept_sizing(start, quick, lambda: _sized_here(start, quick))


@lru_cache(maxsize=None)
def _sized_here(start: RunConfig, quick: bool) -> Sizing:
    import torch
    host.free_gpu_memory()
    free, total = torch.cuda.mem_get_info(0)   # the probes' GPU: a context here opens none on the others
    return sized(start, probe_on_gpu, [torch.cuda.get_device_properties(index).total_memory - _used(index, total - free)
                                       for index in range(torch.cuda.device_count())], quick)


def _used(index: int, here: int) -> int:
    """What GPU `index` has in use, read through NVML where torch can (no context opened), else what
    GPU 0 has (this process's context and libraries), assumed alike on every GPU."""
    import torch
    try:
        return max(torch.cuda.device_memory_used(index), here if index == 0 else 0)
    except Exception:  # no NVML binding installed, or an older torch
        return here


def kept_sizing(start: RunConfig, quick: bool, size: Callable[[], Sizing]) -> Sizing:
    """`size()`, or the sizing a process before this one found for the same start on these GPUs, kept
    in the file SIZING_FILE names (the doctor sets it for its run: its sizing row, then reproduce
    --quick, size once, not twice, within the report's minutes)."""
    import torch
    path = os.environ.get(SIZING_FILE)
    key = {"start": asdict(start), "quick": quick, "gpus": host.gpus(), "torch": torch.__version__}
    if path and os.path.exists(path):
        with open(path) as file:
            kept = json.load(file)
        if kept["key"] == key:
            fields = kept["sizing"]
            return Sizing(**{**fields, "config": RunConfig(**fields["config"]),
                             **{name: tuple(fields[name]) for name in ("ratios", "tflops", "tried")}})
    sizing = size()
    if path:
        with open(path, "w") as file:
            json.dump({"key": key, "sizing": asdict(sizing)}, file)
    return sizing


def stage_tflops(config: RunConfig, events: list[dict]) -> tuple[float, ...]:
    """Per stage of a GPU table's step, the TFLOP/s its tasks reached: its blocks' F, R and B FLOPs
    over the batch (4 forwards) over the seconds of its tasks in `events` (timed one at a time)."""
    shape = shape_of(config.width, config.context, config.batch, config.blocks, config.model)
    busy, _ = stage_seconds(events, config.stages)
    work = [4 * n * shape.forward_flops_per_token() * config.batch * config.context
            for n in shape.stage_blocks(config.stages)]
    return tuple(w / b / 1e12 if b > 0 else math.nan for w, b in zip(work, busy))


def stage_seconds(events: list[dict], stages: int) -> tuple[list[float], list[float]]:
    """Per stage, the seconds its tasks took on their device (GPU events on a GPU) and the seconds the
    host spent issuing them (Event.host; a task's own time where none was recorded, as on a CPU)."""
    device, issued = [0.0] * stages, [0.0] * stages
    for e in events:
        device[e["stage"]] += e["end"] - e["start"]
        issued[e["stage"]] += e.get("host", 0.0) or (e["end"] - e["start"])
    return device, issued
