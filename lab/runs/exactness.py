"""Checks that pipelining changes the schedule and not the math, as tables a notebook can show."""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from lab.config import RunConfig
from lab.runs.experiments import build, stepper_for, training_curve


def pipeline_gradients(config: RunConfig, stages: int, checkpoint: str) -> list[torch.Tensor]:
    """Gradients of one pipelined step of the configuration cut into `stages` even stages, as threads."""
    setting = config.but(stages=stages, checkpoint=checkpoint, transport="threads")
    model, (inputs, targets), loss_fn = build(setting)
    with stepper_for(setting, stages, model=model) as stepper:
        stepper.step(inputs, targets, loss_fn)
    return [p.grad.clone() for p in model.parameters()]


def unpipelined_gradients(model: nn.Module, inputs, targets, loss_fn, dtype: Optional[torch.dtype] = None) \
        -> list[torch.Tensor]:
    """The reference a pipelined step is checked against: the gradients of `loss_fn` on the whole
    mini-batch through `model`, one device, no pipeline (model and floating-point data in `dtype`
    if given). Without dropout only: its masks depend on the random stream, which differs from the
    pipeline's by design."""
    if dtype is not None:
        model = model.to(dtype)
        inputs, targets = (t.to(dtype) if t.is_floating_point() else t for t in (inputs, targets))
    model.zero_grad(set_to_none=True)
    loss_fn(model(inputs), targets).backward()
    return [p.grad.detach() for p in model.parameters()]


def compare(config: RunConfig, stage_counts: Iterable[int] = (1, 2, 4),
            checkpoints: Iterable[str] = ("never", "always")) -> list[dict]:
    """For every K and checkpoint mode: bitwise equal to K=1 without recompute? And the largest
    difference from the unpipelined whole-batch gradients (only meaningful without dropout)."""
    reference = pipeline_gradients(config, 1, "never")
    model, (inputs, targets), loss_fn = build(config)
    whole = None if has_dropout(model) else unpipelined_gradients(model, inputs, targets, loss_fn)
    rows = []
    for stages in stage_counts:
        for checkpoint in checkpoints:
            grads = pipeline_gradients(config, stages, checkpoint)
            rows.append({"K": stages, "checkpoint": checkpoint,
                         "bitwise equal to K=1": all(torch.equal(a, b) for a, b in zip(grads, reference)),
                         "max |diff| vs whole batch": None if whole is None else
                         max((a - b).abs().max().item() for a, b in zip(grads, whole))})
    return rows


def batch_norm_statistics(config: RunConfig, stages: int) -> dict:
    """Run one pipelined step of a BN model with deferred batch norm and compare each BN layer's
    running mean/var with nn.BatchNorm applied once to everything that layer saw."""
    model, (inputs, targets), loss_fn = build(config)
    layers = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    seen = {layer: [] for layer in layers}
    before = {layer: {k: v.clone() for k, v in layer.state_dict().items()} for layer in layers}
    hooks = [layer.register_forward_pre_hook(lambda mod, args: seen[mod].append(args[0].detach())) for layer in layers]
    try:
        with stepper_for(config.but(stages=stages, checkpoint="never", transport="threads"), stages,
                         model=model) as stepper:
            stepper.step(inputs, targets, loss_fn)
    finally:
        for hook in hooks:
            hook.remove()
    worst_mean = worst_var = 0.0
    for layer in layers:
        reference = type(layer)(layer.num_features, momentum=layer.momentum)
        reference.load_state_dict(before[layer])
        reference.train()(torch.cat(seen[layer]))
        worst_mean = max(worst_mean, (layer.running_mean - reference.running_mean).abs().max().item())
        worst_var = max(worst_var, (layer.running_var - reference.running_var).abs().max().item())
    return {"batch norm layers": len(layers), "max |running mean diff|": worst_mean,
            "max |running var diff|": worst_var,
            "updates counted": sorted({int(layer.num_batches_tracked) for layer in layers})}


def loss_curves(config: RunConfig, stage_counts: Iterable[int], steps: int) -> dict[str, list[float]]:
    """Training curves of the same model, data and seed for several K."""
    return {f"K={k}": training_curve(config.but(stages=k), steps) for k in stage_counts}


def has_dropout(model: nn.Module) -> bool:
    """Whether the model draws dropout masks (its pipelined gradients then differ from an unpipelined
    step's by design)."""
    return any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())


def thread_counts(config: RunConfig, stages: int = 2) -> dict:
    """The same step with one and with two intra-op threads per stage: CPU kernels split their
    sums by thread, and float addition is not associative, so the last bits change."""
    one = pipeline_gradients(config.but(threads_per_stage=1), stages, "never")
    two = pipeline_gradients(config.but(threads_per_stage=2), stages, "never")
    return {"bitwise equal": all(torch.equal(a, b) for a, b in zip(one, two)),
            "max |diff|": max((a - b).abs().max().item() for a, b in zip(one, two))}


def batch_norm_by_m(config: RunConfig, stage_counts: Iterable[int] = (1, 2),
                    micro: Iterable[int] = (2, 4)) -> list[dict]:
    """Gradients of a batch-norm model for several K and M: the same for every K at one M (the
    micro-batches are the same), but not across M, since each micro-batch is normalized with its
    own statistics: M changes what the model computes."""
    micro = list(micro)
    grads = {(k, m): pipeline_gradients(config.but(micro_batches=m), k, "never") for k in stage_counts for m in micro}
    first_k, first_m = min(stage_counts), micro[0]
    return [{"K": k, "M": m, "bitwise equal to K=1 at this M": all(torch.equal(a, b) for a, b in
                                                                zip(grads[(k, m)], grads[(first_k, m)])),
             f"max |diff| vs M={first_m}": max((a - b).abs().max().item() for a, b in
                                               zip(grads[(k, m)], grads[(k, first_m)]))}
            for m in micro for k in stage_counts]
