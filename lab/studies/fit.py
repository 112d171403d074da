"""The paper's Table 1 idea: the largest Transformer whose training step fits a memory budget.

Every candidate size is a real training step (pipelined forward and backward, then an Adam
step), never an extrapolation. On CPU a stage's footprint is what the engine measured for it:
parameters + gradients + Adam's two moments + the activation peak from its ledger. With every
stage on a GPU of its own the budget is a real cap (torch.cuda.set_per_process_memory_fraction,
lifted after each probe), "does not fit" is a real out-of-memory error, and a step fits if no GPU
allocated more than the budget for it; stages that share a GPU are counted as on CPU.
"""
from __future__ import annotations

import gc
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from engine import GPipe
from engine.partition import resolve_balance
from lab import theory, zoo
from lab.config import RunConfig
from lab.runs.experiments import build, devices_for, pipeline, predicted_activation_bytes


def table1_setting(device: str = "cpu", quick: bool = False, seed: int = 0,
                   budget: Optional[int] = None) -> tuple[RunConfig, int, int]:
    """(model template, budget in bytes per device, most blocks searched) for the Table 1 search:
    MiB on a CPU, GiB on GPUs, where a budget must dwarf what a GPU allocates for any step (cuBLAS's
    workspace alone is several MiB). `quick` shrinks it for smoke runs."""
    if device == "cuda":
        base = RunConfig(model="transformer", width=128 if quick else 256, batch=16 if quick else 32,
                         micro_batches=4, seed=seed, device=device)
        return base, budget or (256 if quick else 1024) * 2 ** 20, 256 if quick else 1024
    base = RunConfig(model="transformer", width=32 if quick else 64, batch=8 if quick else 16,
                     micro_batches=4, seed=seed, device=device)
    return base, budget or (3 if quick else 24) * 2 ** 20, 160 if quick else 512


@dataclass(frozen=True)
class Probe:
    """One candidate size and what its step needed."""

    blocks: int
    params: int
    peak_bytes: int          # the largest stage's footprint (CPU) or device peak (CUDA)
    fits: bool


@dataclass(frozen=True)
class Largest:
    """The biggest model that fitted for one way of training it."""

    label: str
    stages: int
    checkpoint: str
    blocks: int
    layers: int
    params: int
    peak_bytes: int
    probes: tuple[Probe, ...]


def breakdown(config: RunConfig) -> list[dict]:
    """Bytes each stage needs for one real training step of `config` (`stage_bytes`)."""
    model, (inputs, targets), loss_fn = build(config)
    pipe = pipeline(config, model, config.stages, record_memory=True)
    try:
        return stage_bytes(pipe, inputs, targets, loss_fn)
    finally:
        pipe.close()


def stage_bytes(pipe: GPipe, inputs, targets, loss_fn) -> list[dict]:
    """Bytes each stage of `pipe` needs for one real training step: parameters, gradients, Adam's
    two moments and the activation peak measured by the engine's ledger (on whatever devices)."""
    parameters = list(pipe.parameters())
    optimizer = torch.optim.Adam(parameters, lr=1e-4) if parameters else None
    pipe.step(inputs, targets, loss_fn)
    if optimizer is not None:
        optimizer.step()
    stages = []
    for stage, memory in zip(pipe.partitions, pipe.trace.memory):
        state = sum(t.numel() * t.element_size() for p in stage.parameters()
                    for t in optimizer.state[p].values() if torch.is_tensor(t) and t.dim() > 0) if optimizer else 0
        stages.append({"parameters": memory.param_bytes, "gradients": memory.grad_bytes,
                       "optimizer state": state, "activations": memory.activation_peak_bytes,
                       "parameter count": sum(p.numel() for p in stage.parameters())})
    return stages


def allocator_peak(config: RunConfig) -> int:
    """The most bytes the CPU allocator held during one steady-state training step of `config` (K=1:
    one process holds every stage, so its allocator cannot tell stages apart): after a step and an
    Adam step have made every state, what is held (weights, Adam's moments) plus the highest the next
    step's allocations rose above it, from torch.profiler's memory events (zeroing the gradients,
    the pipelined step run serially on this thread, Adam's step). What the engine's count is judged
    against: the count adds the ledger's saved tensors to weights, gradients and moments; the
    allocator also sees the backward's working memory, and gradients that do not yet exist at the
    activations' peak."""
    if config.stages != 1 or config.device != "cpu":
        raise ValueError(f"allocator_peak measures one stage on the CPU, got K={config.stages} on {config.device}")
    model, (inputs, targets), loss_fn = build(config)
    pipe = pipeline(config, model, 1)
    try:
        return allocator_peak_of(pipe, inputs, targets, loss_fn)
    finally:
        pipe.close()


def allocator_peak_of(pipe: GPipe, inputs, targets, loss_fn) -> int:
    """`allocator_peak` of any one-stage pipe on the CPU: what is held after a step and an Adam step
    (the weights, the moments, the mini-batch's inputs), plus the highest the next step's allocations
    rose above it (torch.profiler's memory events)."""
    from torch.profiler import ProfilerActivity, profile
    parameters = list(pipe.parameters())
    optimizer = torch.optim.Adam(parameters, lr=1e-4) if parameters else None

    def step() -> None:
        pipe.zero_grad(set_to_none=True)
        pipe.step(inputs, targets, loss_fn, serial=True)  # serial: the profiler sees this thread's allocations
        if optimizer is not None:
            optimizer.step()
    step()
    states = optimizer.state.values() if optimizer is not None else ()
    held = sum(p.nbytes for p in parameters) + sum(t.nbytes for state in states for t in state.values()
                                                   if torch.is_tensor(t)) + inputs.untyped_storage().nbytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        step()
    changes = sorted((e.start_ns(), e.nbytes()) for e in profiler.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type().name == "CPU")
    live = highest = 0
    for _, change in changes:
        live += change
        highest = max(highest, live)
    return held + highest


def footprint(config: RunConfig) -> tuple[int, int]:
    """(parameter count, bytes the most loaded stage needs) for one real training step, counted."""
    stages = breakdown(config)
    totals = [s["parameters"] + s["gradients"] + s["optimizer state"] + s["activations"] for s in stages]
    return sum(s["parameter count"] for s in stages), max(totals)


CUDA_HEADROOM = 1.25  # the cap leaves the caching allocator a quarter more than the budget for fragmentation


def cuda_cap_fraction(budget: int, baseline: int, total: int) -> float:
    """The memory fraction that caps one GPU for a probe: what was allocated before it, plus the
    budget with headroom (the cap counts reserved segments, the verdict only allocated bytes)."""
    return min(1.0, (baseline + CUDA_HEADROOM * budget) / total)


def step_peak(peaks: list[int], baselines: list[int], state_bytes: int = 0) -> int:
    """The most any one GPU allocated for the step, above what it held before. Weights, gradients
    and Adam's moments (`state_bytes` together) are all held when the step ends, so the GPUs' growth
    cannot sum to less: if it does, a baseline counted memory that was freed during the step (a
    previous probe's, say) and the reading is refused rather than reported."""
    grown = [peak - base for peak, base in zip(peaks, baselines)]
    if sum(grown) < state_bytes:
        raise RuntimeError(f"the GPUs grew by {sum(grown)} bytes during a step whose weights, gradients and "
                           f"Adam state alone take {state_bytes}: a baseline held memory freed during the step")
    return max(grown)


def stream_workspace(gpu: int) -> int:
    """Bytes cuBLAS and cuBLASLt allocate on GPU `gpu` for a new stream's first matrix products (a
    workspace per stream, the library's and not the model's, several MiB): measured on a fresh stream,
    then freed."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)
    clear()
    before, stream = torch.cuda.memory_allocated(gpu), torch.cuda.Stream(gpu)
    with torch.cuda.stream(stream):
        a = torch.ones(64, 64, device=torch.device("cuda", gpu), requires_grad=True)
        torch.nn.functional.linear(a, a, a[0]).sum().backward()
    stream.synchronize()
    del a
    grown = torch.cuda.memory_allocated(gpu) - before
    clear()
    return max(grown, 0)


def library_workspaces(devices: list[str], per_stream=stream_workspace) -> dict[int, int]:
    """Bytes per GPU index that the library's workspaces take for stages on `devices` (one stream per
    stage, so two stages on one GPU take two): not counted against a memory budget."""
    stages_on = Counter(torch.device(name).index or 0 for name in devices)
    return {gpu: count * per_stream(gpu) for gpu, count in stages_on.items()}


def footprint_cuda(config: RunConfig, budget: int) -> tuple[int, int, bool]:
    """(parameter count, largest per-GPU peak of a steady-state step, fitted) for training with every
    stage on a GPU of its own, under a real cap (the peak of the second step, Adam's state made by
    the first): "does not fit" is a real out-of-memory error, and
    a step that ran fits if no GPU allocated more than `budget` for it, the stage streams' library
    workspaces not counted (`library_workspaces`). The cap is lifted after."""
    gpus = sorted({torch.device(name).index or 0 for name in devices_for(config)})  # the stages' GPUs only:
    params, pipe = 0, None  # capping another would open a context there (refused if another process holds it)
    try:
        gc.collect()  # an earlier probe's pipe or failure may sit in a reference cycle, its memory still held
        torch.cuda.empty_cache()
        workspaces = library_workspaces(devices_for(config))
        baselines = [torch.cuda.memory_allocated(d) + workspaces.get(d, 0) for d in gpus]
        for d, baseline in zip(gpus, baselines):
            torch.cuda.reset_peak_memory_stats(d)
            torch.cuda.set_per_process_memory_fraction(
                cuda_cap_fraction(budget, baseline, torch.cuda.get_device_properties(d).total_memory), d)
        model, (inputs, targets), loss_fn = build(config)
        params = sum(p.numel() for p in model.parameters())
        pipe = pipeline(config, model, config.stages, record_memory=True)
        optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-4)
        for steady in (False, True):  # the peak of the second step, when Adam's moments exist all along
            if steady:
                optimizer.zero_grad(set_to_none=True)
                for d in gpus:
                    torch.cuda.synchronize(d)
                    torch.cuda.reset_peak_memory_stats(d)
            pipe.step(inputs, targets, loss_fn)
            optimizer.step()
        for d in gpus:
            torch.cuda.synchronize(d)
        state = 4 * sum(p.numel() * p.element_size() for p in model.parameters())  # weights, gradients, 2 moments
        peak = step_peak([torch.cuda.max_memory_allocated(d) for d in gpus], baselines, state)
        return params, peak, peak <= budget
    except torch.cuda.OutOfMemoryError:
        return params, budget, False
    finally:
        if pipe is not None:
            pipe.close()
        del pipe
        for d in gpus:
            torch.cuda.set_per_process_memory_fraction(1.0, d)
            torch.cuda.empty_cache()


def shares_gpus(config: RunConfig) -> bool:
    """Whether some stages of `config` share a GPU, so the allocator cannot tell their memory apart."""
    return config.device == "cuda" and config.stages > torch.cuda.device_count()


def probe(config: RunConfig, budget: int, counted: bool = False) -> Probe:
    """Run one real step of `config` and say whether its most loaded stage stays within `budget`:
    on GPUs of their own, the allocator's real peaks under a real cap; on the CPU, on GPUs that
    stages share, or wherever `counted` asks for it, the engine's count of each stage's bytes."""
    if config.device == "cuda" and not counted and not shares_gpus(config):
        params, peak, fits = footprint_cuda(config, budget)
        return Probe(config.blocks, params, peak, fits)
    params, peak = footprint(config)
    return Probe(config.blocks, params, peak, peak <= budget)


def largest(base: RunConfig, stages: int, checkpoint: str, budget: int, max_blocks: int = 512,
            progress: Optional[Callable[[Probe], None]] = None, label: str = "",
            counted: bool = False) -> Optional[Largest]:
    """Search (doubling, then bisection) the most Transformer blocks that fit `budget` per device
    (each candidate judged by `probe`; `counted`: by the engine's count, even on GPUs of their own).

    Returns None if even the smallest model that can be cut into `stages` stages does not fit.
    """
    probes: list[Probe] = []

    def fits(blocks: int) -> bool:
        result = probe(base.but(blocks=blocks, stages=stages, checkpoint=checkpoint), budget, counted)
        probes.append(result)
        if progress is not None:
            progress(result)
        return result.fits

    low = max(1, stages - zoo.card(base.model).extra_layers)  # fewest blocks that give K layers
    if not fits(low):
        return None
    high = low
    while high < max_blocks:  # double until a size fails
        high = min(2 * high, max_blocks)
        if not fits(high):
            break
        low = high
    else:
        high = low
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    best = max((p for p in probes if p.fits and p.blocks == low), key=lambda p: p.blocks)
    return Largest(label, stages, checkpoint, low, zoo.card(base.model).layer_count(low), best.params,
                   best.peak_bytes, tuple(probes))


LADDER = (("naive, K=1, no recompute", 1, "never"), ("K=1 with recompute", 1, "always"),
          ("pipeline K=2, recompute", 2, "always"), ("pipeline K=4, recompute", 4, "always"),
          ("pipeline K=8, recompute", 8, "always"))


def predict(base: RunConfig, budget: int, stages=(1, 2, 4), micro=(1, 2, 4, 8),
            checkpoints=("never", "always")) -> list[dict]:
    """Predict, before running anything big, each (K, M, recompute): the bytes of the most loaded
    stage (16 bytes per parameter for weights, gradients and Adam's moments, plus the activation
    formula fed with per-layer sizes measured on one micro-batch) and the time per mini-batch in the
    unit-cost model, relative to one device (theory.time_vs_one_device: (M+K-1)/(KM) without
    recompute, a little under (M+K-1)(3+1)/(3KM) with it). Whether each fits `budget` is the
    prediction's verdict, to be checked by a run."""
    model, (inputs, _), _ = build(base)
    layer_params = [sum(p.numel() for p in layer.parameters()) for layer in model]
    rows = []
    for k in stages:
        if k > len(model):
            continue
        counts = resolve_balance(k, len(model))
        edges = [sum(counts[:i]) for i in range(k + 1)]
        for m in micro:
            if m > base.batch:
                continue
            for checkpoint in checkpoints:
                config = base.but(stages=k, micro_batches=m, checkpoint=checkpoint)
                activations = predicted_activation_bytes(config, model, inputs, counts)
                per_stage = [16 * sum(layer_params[a:b]) + act
                             for (a, b), act in zip(zip(edges, edges[1:]), activations)]
                rows.append({"K": k, "M": m, "checkpoint": checkpoint, "predicted bytes (most loaded stage)":
                             round(max(per_stage)), "fits (predicted)": max(per_stage) <= budget,
                             "bubble (theory)": round(theory.bubble(k, m), 3),
                             "time vs one device (theory)": round(theory.time_vs_one_device(k, m, checkpoint), 3)})
    return rows
