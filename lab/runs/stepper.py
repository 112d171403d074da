"""One training step of a pipe, its stages as threads of this process or as stage processes: the
one way the lab runs a step (lab.runs.experiments' runs and training curves, the peers' race, the
doctor's checks).

    with Stepper(mlp.build, dict(blocks=8, width=256), 2, chunks=4) as stepper:
        loss, trace, seconds = stepper.step(x, y, torch.nn.functional.mse_loss)

Given a ProcessPool (`pool=`), the same recipe builds the pipe in its stage processes instead.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch
from torch import nn

from engine import GPipe
from engine.trace import Trace
from lab.processes.children import resolve
from lab.processes.pool import ProcessPool


class Stepper:
    """The pipe of `recipe(**recipe_kwargs)` (an nn.Sequential made by a function importable by
    name, "package.module:function") cut by `balance`, with `options` for GPipe (chunks,
    checkpoint, devices, ...): in this process, on `model` if given (the recipe's model, already
    built here), or in the stage processes of `pool` (which its owner closes). With
    `optimizer=("torch.optim.Adam", {"lr": 1e-3})` every step also takes an optimizer step; either
    way each step starts from zeroed gradients."""

    def __init__(self, recipe: str, recipe_kwargs: dict, balance, pool: Optional[ProcessPool] = None,
                 optimizer: Optional[tuple[str, dict]] = None, model: Optional[nn.Sequential] = None, **options):
        self.pool, self.pipe, self.optimizer = pool, None, None
        if pool is not None:
            pool.build(recipe, recipe_kwargs, balance=balance, optimizer=optimizer, **options)
            return
        self.pipe = GPipe(resolve(recipe)(**recipe_kwargs) if model is None else model, balance, **options)
        if optimizer is not None:
            kind, settings = optimizer
            self.optimizer = resolve(kind.replace("torch.optim.", "torch.optim:"))(self.pipe.parameters(), **settings)

    def step(self, inputs, targets, loss_fn: Callable, on_event: Optional[Callable] = None,
             record_memory: Optional[bool] = None) -> tuple[float, Trace, float]:
        """One training step: (its mini-batch loss, its trace, its seconds: timed around the pipe's
        step here, by the first stage's process there). `on_event` sees each task as it ends.
        `record_memory` sets the ledger on or off from this step on (None: as built): a timed step
        passes False, so that the ledger's bookkeeping (a Python call per tensor autograd saves)
        stays out of its time; its activation peaks then read 0."""
        if self.pool is not None:
            loss = self.pool.step(inputs, targets, loss_fn, on_event=on_event, record_memory=record_memory).item()
            return loss, self.pool.trace, self.pool.seconds
        if record_memory is not None:
            self.pipe.record_memory = record_memory
        self.pipe.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss = self.pipe.step(inputs, targets, loss_fn, on_event=on_event).item()
        seconds = time.perf_counter() - start
        if self.optimizer is not None:
            self.optimizer.step()
        return loss, self.pipe.trace, seconds

    def gradients(self) -> list[torch.Tensor]:
        """The parameters' gradients after the last step, in the model's order (on the CPU)."""
        if self.pool is not None:
            return self.pool.gradients()
        return [p.grad.detach().cpu() for p in self.pipe.parameters()]

    def close(self) -> None:
        """Stop the pipe's stage threads (stage processes stay up: their pool's owner closes them)."""
        if self.pipe is not None:
            self.pipe.close()

    def __enter__(self) -> "Stepper":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
