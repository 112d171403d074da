"""What each stage of your model holds in a training step: weights, gradients, Adam's moments and
activations as the step holds them (the engine's ledger), and Adam's update (on the CPU it updates
one parameter at a time, with two temporaries of its size), for GPipe and 1F1B with and without
recompute; and each stage's count against the CPU allocator's peak for that stage run alone."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from engine import GPipe
from lab.studies.fit import allocator_peak_of, stage_bytes
from lab.yours.model import Yours


@dataclass
class StageMemory:
    """One stage's bytes in one configuration, and (for the check) the allocator's peak of it alone."""

    schedule: str
    checkpoint: str
    stage: int
    layers: str
    weights: int
    gradients: int
    optimizer: int
    activations: int
    update: int = 0                  # Adam's update: two temporaries the size of its largest parameter
    allocator: Optional[int] = None

    @property
    def total(self) -> int:
        """The step's high-water mark: the weights and moments all along, with the gradients and
        either the activations (the backward) or the update's temporaries (Adam's step), the larger."""
        return self.weights + self.optimizer + self.gradients + max(self.activations, self.update)


def update_bytes(layers: nn.Module) -> int:
    """Adam's update on the CPU: two temporaries the size of the largest parameter (the second
    moment's square root, then the step), one parameter at a time."""
    return 2 * max((p.numel() * p.element_size() for p in layers.parameters()), default=0)


def edges_of(balance: list[int]) -> list[tuple[int, int]]:
    ends = list(itertools.accumulate(balance, initial=0))
    return list(zip(ends, ends[1:]))


def per_stage(yours: Yours, balance: list[int], micro: int, checkpoint: str, schedule: str) -> list[StageMemory]:
    """One real step (and an Adam step) of the pipe as threads, the ledger on: each stage's bytes."""
    pipe = GPipe(yours.fresh(), balance, chunks=micro, checkpoint=checkpoint, schedule=schedule, seed=0,
                 threads_per_stage=1)
    try:
        counted = stage_bytes(pipe, yours.inputs, yours.targets, yours.loss_fn)
    finally:
        pipe.close()
    model = yours.model
    return [StageMemory(schedule, checkpoint, k, f"{a}-{b - 1}", c["parameters"], c["gradients"],
                        c["optimizer state"], c["activations"], update_bytes(model[a:b]))
            for k, ((a, b), c) in enumerate(zip(edges_of(balance), counted))]


class Upstream(torch.autograd.Function):
    """A stand-in for the next stage: its backward hands the stage `gradient`, as the next stage's
    message would, and it saves nothing of the output (the next stage would hold that)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gradient)
        return output.new_zeros(())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (gradient,) = ctx.saved_tensors
        return gradient * grad, None


def upstream_gradient(output: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
    """The loss of a stage run alone (not the last): the gradient the next stage would send back."""
    return Upstream.apply(output, gradient)


def stage_alone(yours: Yours, balance: list[int], stage: int) -> tuple[nn.Sequential, torch.Tensor, object, object]:
    """Stage `stage`'s layers as a model of their own, with the input the stages before hand it, and
    a loss: the real one on the last stage, else its output against a fixed upstream gradient."""
    model = yours.fresh()
    a, b = edges_of(balance)[stage]
    x = yours.inputs
    with torch.no_grad():
        for layer in list(model)[:a]:
            x = layer(x)
        layers = nn.Sequential(*list(model)[a:b])
        out = layers(x)
    if a and x.is_floating_point():  # as a stage after the first gets it: a gradient flows back through it,
        x.requires_grad_(True)       # each micro-batch's sent on (and freed) as soon as it is made
        x.register_post_accumulate_grad_hook(lambda tensor: setattr(tensor, "grad", None))
    if b == len(model):
        return layers, x, yours.targets, yours.loss_fn
    return layers, x, torch.randn_like(out), upstream_gradient


def checked(yours: Yours, balance: list[int], micro: int, checkpoint: str) -> list[StageMemory]:
    """GPipe's stages, each counted (weights, gradients, moments, the ledger's activations) and
    measured by the CPU allocator (torch.profiler), run alone as a one-stage pipe on its own input."""
    rows = []
    for k in range(len(balance)):
        layers, x, targets, loss_fn = stage_alone(yours, balance, k)
        pipe = GPipe(layers, 1, chunks=micro, checkpoint=checkpoint, seed=0, threads_per_stage=1)
        try:
            [counted] = stage_bytes(pipe, x, targets, loss_fn)
            peak = allocator_peak_of(pipe, x, targets, loss_fn)
        finally:
            pipe.close()
        a, b = edges_of(balance)[k]
        rows.append(StageMemory("gpipe", checkpoint, k, f"{a}-{b - 1}", counted["parameters"], counted["gradients"],
                                counted["optimizer state"], counted["activations"], update_bytes(layers), peak))
    return rows
