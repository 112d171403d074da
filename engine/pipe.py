"""GPipe: pipeline-parallel training of an nn.Sequential over K stages and M micro-batches."""
from __future__ import annotations

import time
from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn

from . import schedule as schedules
from .device import StageDevice, cpu_cores, resolve_devices
from .microbatch import Value, check_inputs, check_targets, gather, scatter
from .partition import check_module, resolve_balance, split
from .rng import mix_seed
from .stage import Stage, StepPlan
from .trace import Event, StageMemory, Trace
from .worker import StageThreads, run_schedule, run_serially

EventCallback = Optional[Callable[[Event], None]]


class GPipe(nn.Module):
    """Train an nn.Sequential as a GPipe pipeline: K stages, M micro-batches, optional recompute.

    `schedule` is "gpipe" (fill-drain, the default) or "1f1b" (the later one-forward-one-backward
    order: same gradients up to summation order, fewer micro-batches held at once).
    The stages are made of the model's own layers (nothing is copied), so an optimizer over
    `pipe.parameters()` (or, on CPU, over the model's) trains the model itself. Gradients equal
    those of the whole mini-batch on one device; see README for what "equal" means bit for bit.
    """

    def __init__(self, module: nn.Sequential, balance: Union[int, Sequence[int]],
                 devices: Optional[Sequence] = None, chunks: int = 1, checkpoint: str = "except_last",
                 deferred_batch_norm: bool = False, seed: Optional[int] = None,
                 threads_per_stage: Optional[int] = None, record_memory: bool = True, schedule: str = "gpipe"):
        super().__init__()
        check_module(module)
        self.balance = resolve_balance(balance, len(module))
        stages = len(self.balance)
        self.devices = resolve_devices(devices, stages)
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks={chunks!r}: expected an int >= 1 (micro-batches per mini-batch)")
        self.chunks = chunks
        self.checkpoint = schedules.check_checkpoint_mode(checkpoint)
        self.schedule = schedules.check_schedule(schedule)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed={seed!r}: expected an int or None")
        self.seed = seed
        if threads_per_stage is None:
            threads_per_stage = max(1, cpu_cores() // stages)
        if isinstance(threads_per_stage, bool) or not isinstance(threads_per_stage, int) or threads_per_stage < 1:
            raise ValueError(f"threads_per_stage={threads_per_stage!r}: expected an int >= 1")
        self.threads_per_stage = threads_per_stage
        self.record_memory = record_memory
        self.partitions = nn.ModuleList(split(module, self.balance))
        firsts = [sum(self.balance[:k]) for k in range(stages)]
        self._stages = []
        for k, (partition, device) in enumerate(zip(self.partitions, self.devices)):
            partition.to(device)
            self._stages.append(Stage(k, stages, partition, firsts[k], StageDevice(device, threads_per_stage),
                                      deferred_batch_norm))
        self.deferred_batch_norm = deferred_batch_norm
        self.steps_done = 0
        self.trace = Trace(stages=stages, checkpoint=checkpoint)
        self._threads: Optional[StageThreads] = None  # started by the first call

    def close(self) -> None:
        """Stop the stage worker threads now (they also stop when the pipe is garbage-collected);
        a later call starts new ones."""
        if self._threads is not None:
            self._threads.close()
            self._threads = None

    def step(self, inputs: Value, targets: torch.Tensor, loss_fn: Callable, *, on_event: EventCallback = None,
             serial: bool = False):
        """One mini-batch: pipelined forward and backward, gradients summed into `.grad`.

        `loss_fn(output_chunk, target_chunk)` must return the mean loss of a micro-batch; each is
        weighted by its share of the mini-batch, so the gradients are those of the mean over the
        whole mini-batch. Returns that mini-batch loss (a detached scalar on the last device).
        `on_event`, if given, is called with each task's Event as it finishes. `serial=True` runs
        the tasks one at a time on the calling thread (same results; each task timed alone, as
        an ideal replay on a host with fewer cores than stages needs).
        """
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {loss_fn!r}")
        batch = check_inputs(inputs)
        check_targets(targets, batch)
        micro_inputs, micro_targets = scatter(inputs, self.chunks), scatter(targets, self.chunks)
        sizes = [check_inputs(x) for x in micro_inputs]
        count = len(micro_inputs)
        plan = StepPlan(inputs=micro_inputs, targets=micro_targets, loss_fn=loss_fn,
                        weights=[n / batch for n in sizes],
                        checkpointed=[schedules.checkpointed(m, count, self.checkpoint) for m in range(count)],
                        base_seed=self._base_seed(phase=0), training=True, record_memory=self.record_memory)
        self.steps_done += 1
        self._run(plan, schedules.SCHEDULES[self.schedule](len(self._stages), count, self.checkpoint), batch,
                  "serial step" if serial else "step", on_event, serial)
        losses = self._stages[-1].state.losses
        loss = sum(losses[m] * plan.weights[m] for m in range(count))
        self._forget_state()
        return loss

    def forward(self, inputs: Value, *extra, on_event: EventCallback = None) -> Value:
        """Forward only (inference/evaluation), pipelined over micro-batches, without graphs.

        Returns the outputs of all micro-batches joined along dim 0, on the last stage's device.
        Layers run in their own mode: after `pipe.train()` batch norm normalizes each micro-batch
        with its own statistics and updates the running ones (with deferred batch norm, once for
        the whole mini-batch, as nn.BatchNorm on it would); after `pipe.eval()` nothing changes.
        """
        if extra:
            raise TypeError(f"GPipe takes one input value, got {1 + len(extra)} positional arguments; "
                            f"pass several input tensors as one tuple: pipe((a, b))")
        batch = check_inputs(inputs)
        micro_inputs = scatter(inputs, self.chunks)
        count = len(micro_inputs)
        plan = StepPlan(inputs=micro_inputs, targets=None, loss_fn=None, weights=[], checkpointed=[False] * count,
                        base_seed=self._base_seed(phase=1), training=False, record_memory=False)
        self._run(plan, schedules.forward_only(len(self._stages), count), batch, "forward", on_event)
        outputs = self._stages[-1].state.outputs
        result = gather([outputs[m] for m in range(count)])
        self._forget_state()
        return result

    # --- internals -------------------------------------------------------------------------

    def _base_seed(self, phase: int) -> int:
        """Seed of this call's random streams: from `seed` and the step count, or drawn from torch's RNG."""
        if self.seed is None:
            return int(torch.randint(0, 2 ** 62, ()).item())
        return mix_seed(self.seed, self.steps_done, phase)

    def _run(self, plan: StepPlan, schedule, batch: int, kind: str, on_event: EventCallback,
             serial: bool = False) -> None:
        for device in set(self.devices):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        for stage in self._stages:
            stage.start(plan, t0)
        if self._threads is None and not serial:
            self._threads = StageThreads(len(self._stages))
        try:
            if serial:
                events = run_serially(self._stages, schedule, on_event)
            else:
                events = run_schedule(self._threads, self._stages, schedule, on_event)
        except BaseException:
            self._forget_state()
            raise
        wall = time.perf_counter() - t0
        for stage in self._stages:
            if stage.batch_norm is not None:
                stage.batch_norm.finish_step()
        self.trace = Trace(stages=len(self._stages), micro_batches=len(plan.inputs), batch_size=batch,
                           checkpoint=self.checkpoint, kind=kind, events=events,
                           memory=[self._memory_of(stage) for stage in self._stages], wall=wall)

    def _memory_of(self, stage: Stage) -> StageMemory:
        params = stage.parameters()
        return StageMemory(
            stage=stage.index, device=str(stage.device.device),
            param_bytes=sum(p.numel() * p.element_size() for p in params),
            grad_bytes=sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
            activation_peak_bytes=stage.ledger.peak, device_peak_bytes=stage.device.peak_bytes())

    def _forget_state(self) -> None:
        """Drop every reference a call kept (graphs, inputs, outputs), so nothing outlives it."""
        for stage in self._stages:
            stage.finish()
