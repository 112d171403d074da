"""The paper's Table 1 idea: the largest Transformer whose training step fits a memory budget.

Every candidate size is a real training step (pipelined forward and backward, then an Adam
step), never an extrapolation. On CPU a stage's footprint is what the engine measured for it:
parameters + gradients + Adam's two moments + the activation peak from its ledger. On CUDA the
budget is a real cap (torch.cuda.set_per_process_memory_fraction) and "does not fit" is a real
out-of-memory error.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from engine import GPipe
from engine.partition import resolve_balance

from . import models, theory
from .experiments import RunConfig, build, devices_for, predicted_activation_bytes


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
    """Bytes each stage needs for one real training step on CPU: parameters, gradients, Adam's
    two moments and the activation peak measured by the engine's ledger."""
    model, (inputs, targets), loss_fn = build(config)
    pipe = GPipe(model, config.stages, devices=devices_for(config), chunks=config.micro_batches,
                 checkpoint=config.checkpoint, seed=config.seed, threads_per_stage=config.threads_per_stage)
    try:
        optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-4)
        pipe.step(inputs, targets, loss_fn)
        optimizer.step()
        stages = []
        for stage, memory in zip(pipe.partitions, pipe.trace.memory):
            state = sum(t.numel() * t.element_size() for p in stage.parameters()
                        for t in optimizer.state[p].values() if torch.is_tensor(t) and t.dim() > 0)
            stages.append({"parameters": memory.param_bytes, "gradients": memory.grad_bytes,
                           "optimizer state": state, "activations": memory.activation_peak_bytes,
                           "parameter count": sum(p.numel() for p in stage.parameters())})
    finally:
        pipe.close()
    return stages


def footprint(config: RunConfig) -> tuple[int, int]:
    """(parameter count, bytes the most loaded stage needs) for one real training step on CPU."""
    stages = breakdown(config)
    totals = [s["parameters"] + s["gradients"] + s["optimizer state"] + s["activations"] for s in stages]
    return sum(s["parameter count"] for s in stages), max(totals)


def footprint_cuda(config: RunConfig, budget: int) -> tuple[int, int, bool]:
    """(parameter count, largest device peak, fitted) for one training step under a real cap."""
    count = torch.cuda.device_count()
    for device in range(count):
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / torch.cuda.get_device_properties(device).total_memory),
                                                   device)
    params, pipe = 0, None
    try:
        model, (inputs, targets), loss_fn = build(config)
        params = sum(p.numel() for p in model.parameters())
        pipe = GPipe(model, config.stages, devices=devices_for(config), chunks=config.micro_batches,
                     checkpoint=config.checkpoint, seed=config.seed)
        optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-4)
        pipe.step(inputs, targets, loss_fn)
        optimizer.step()
        torch.cuda.synchronize()
        peak = max(torch.cuda.max_memory_allocated(d) for d in range(count))
        return params, peak, peak <= budget
    except torch.cuda.OutOfMemoryError:
        return params, budget, False
    finally:
        if pipe is not None:
            pipe.close()
        del pipe
        for device in range(count):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)


def probe(config: RunConfig, budget: int) -> Probe:
    """Run one real step of `config` and say whether its most loaded device stays within `budget`."""
    if config.device == "cuda":
        params, peak, fits = footprint_cuda(config, budget)
        return Probe(config.blocks, params, peak, fits)
    params, peak = footprint(config)
    return Probe(config.blocks, params, peak, peak <= budget)


def largest(base: RunConfig, stages: int, checkpoint: str, budget: int, max_blocks: int = 512,
            progress: Optional[Callable[[Probe], None]] = None, label: str = "") -> Optional[Largest]:
    """Search (doubling, then bisection) the most Transformer blocks that fit `budget` per device.

    Returns None if even the smallest model that can be cut into `stages` stages does not fit.
    """
    probes: list[Probe] = []

    def fits(blocks: int) -> bool:
        result = probe(base.but(blocks=blocks, stages=stages, checkpoint=checkpoint), budget)
        probes.append(result)
        if progress is not None:
            progress(result)
        return result.fits

    low = max(1, stages - models.get(base.model).extra_layers)  # fewest blocks that give K layers
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
    return Largest(label, stages, checkpoint, low, models.get(base.model).layer_count(low), best.params,
                   best.peak_bytes, tuple(probes))


LADDER = (("naive, K=1, no recompute", 1, "never"), ("K=1 with recompute", 1, "always"),
          ("pipeline K=2, recompute", 2, "always"), ("pipeline K=4, recompute", 4, "always"),
          ("pipeline K=8, recompute", 8, "always"))


def plan(base: RunConfig, budget: int, stages=(1, 2, 4), micro=(1, 2, 4, 8), checkpoints=("never", "always")) -> list[dict]:
    """Predict, before running anything big, each (K, M, recompute): the bytes of the most loaded
    stage (16 bytes per parameter for weights, gradients and Adam's moments, plus the activation
    formula fed with per-layer sizes measured on one micro-batch) and the time per mini-batch in the
    unit-cost model, relative to one device: (M+K-1)(3+r)/(3KM), r = 1 with recompute (one more
    forward) else 0. Whether each fits `budget` is the prediction's verdict, to be checked by a run."""
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
                per_stage = [16 * sum(layer_params[a:b]) + act for (a, b), act in zip(zip(edges, edges[1:]), activations)]
                rows.append({"K": k, "M": m, "checkpoint": checkpoint, "predicted bytes (most loaded stage)":
                             round(max(per_stage)), "fits (predicted)": max(per_stage) <= budget,
                             "bubble (theory)": round(theory.bubble(k, m), 3),
                             "time vs one device (theory)": round((m + k - 1) * (3 + (checkpoint != "never")) /
                                                                  (3 * k * m), 3)})
    return rows
