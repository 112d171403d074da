"""GPipe: pipeline-parallel training of an nn.Sequential over K stages and M micro-batches."""
from __future__ import annotations

import time
import weakref
from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn

from . import distributed, schedule as schedules
from .device import StageDevice, check_device, cpu_cores, one_per_stage, resolve_devices
from .microbatch import Value, check_inputs, check_targets, gather, scatter
from .partition import check_module, resolve_balance, split
from .rank import RankRunner
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

    By default every stage is a thread of this process. With `group=` (a torch.distributed process
    group of K ranks) rank i runs stage i in its own process: every rank builds the same model and
    calls the same methods; each keeps only its stage's layers (the others' parameters are freed),
    `pipe.parameters()` are its stage's, and `devices=None` means cpu, or cuda:LOCAL_RANK with CUDA.
    """

    def __init__(self, module: nn.Sequential, balance: Union[int, Sequence[int]],
                 devices: Optional[Sequence] = None, chunks: int = 1, checkpoint: str = "except_last",
                 deferred_batch_norm: bool = False, seed: Optional[int] = None,
                 threads_per_stage: Optional[int] = None, record_memory: bool = True, schedule: str = "gpipe",
                 group=None):
        super().__init__()
        check_module(module)
        self.balance = resolve_balance(balance, len(module))
        self.stages = stages = len(self.balance)
        self._ranks = None if group is None else distributed.check_group(group, stages)
        if self._ranks is None:
            self.local_stages = list(range(stages))
            self.devices = resolve_devices(devices, stages)
        else:
            self.local_stages = [self._ranks.rank]
            self.devices = [distributed.default_device() if devices is None else
                            check_device(one_per_stage(devices, stages)[self._ranks.rank],
                                         self._ranks.rank)]
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
        partitions = split(module, self.balance)
        if self._ranks is not None:
            _release_all_but(module, partitions[self._ranks.rank])
        self.partitions = nn.ModuleList([partitions[k] for k in self.local_stages])
        firsts = [sum(self.balance[:k]) for k in range(stages)]
        self._stages = []
        for k, partition, device in zip(self.local_stages, self.partitions, self.devices):
            partition.to(device)
            self._stages.append(Stage(k, stages, partition, firsts[k], StageDevice(device, threads_per_stage),
                                      deferred_batch_norm))
        self.deferred_batch_norm = deferred_batch_norm
        self.steps_done = 0
        self.trace = Trace(stages=stages, checkpoint=checkpoint)
        self._threads: Optional[StageThreads] = None  # started by the first call
        self._runner = None
        if self._ranks is not None:
            rank = self._ranks.rank
            transport = distributed.ProcessTransport(self._ranks, group, self.devices[0],
                                                     upstream=rank - 1 if rank > 0 else None,
                                                     downstream=rank + 1 if rank < stages - 1 else None)
            self._runner = RankRunner(self._ranks, self._stages[0], transport)
            self._closer = weakref.finalize(self, transport.close)

    def close(self) -> None:
        """Stop the stage worker threads now (they also stop when the pipe is garbage-collected);
        a later call starts new ones. With stages as processes every rank calls it (it ends the
        transport's threads on both sides of each connection), and the pipe cannot be used after."""
        if self._threads is not None:
            self._threads.close()
            self._threads = None
        if self._runner is not None:
            self._closer()

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
        if self._runner is not None:
            if serial:
                raise ValueError("serial=True runs every stage on the calling thread; with group= each rank "
                                 "runs only its own stage")
            loss = self._rank_call("step", inputs, targets, loss_fn, on_event)
            self.steps_done += 1
            return loss
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
        if self._runner is not None:
            return self._rank_call("forward", inputs, None, None, on_event)
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

    def _rank_call(self, kind: str, inputs, targets, loss_fn, on_event: EventCallback):
        """This rank's share of a call when stages are processes (see engine/rank.py)."""
        self._reset_device_peaks()
        schedule = schedules.SCHEDULES[self.schedule] if kind == "step" else \
            (lambda stages, count, _checkpoint: schedules.forward_only(stages, count))
        result, self.trace = self._runner.call(
            kind, inputs, targets, loss_fn, self.chunks, self.checkpoint, schedule,
            base_seed=lambda: self._base_seed(phase=0 if kind == "step" else 1), record_memory=self.record_memory,
            memory_of=self._memory_of, on_event=on_event)
        return result

    def _reset_device_peaks(self) -> None:
        for device in set(self.devices):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)

    def _run(self, plan: StepPlan, schedule, batch: int, kind: str, on_event: EventCallback,
             serial: bool = False) -> None:
        self._reset_device_peaks()
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
        self.trace = Trace(stages=self.stages, micro_batches=len(plan.inputs), batch_size=batch,
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


def _release_all_but(module: nn.Module, kept: nn.Module) -> None:
    """Free the parameters (and their gradients) and buffers of every layer outside `kept`: a rank
    builds the whole model, as every rank does, but holds only its own stage."""
    keep = {id(t) for t in list(kept.parameters()) + list(kept.buffers())}
    with torch.no_grad():
        for parameter in module.parameters():
            if id(parameter) not in keep:
                parameter.data = torch.empty(0, dtype=parameter.dtype, device=parameter.device)
                parameter.grad = None
        for layer in module.modules():
            for name, buffer in layer._buffers.items():
                if buffer is not None and id(buffer) not in keep:
                    layer._buffers[name] = torch.empty(0, dtype=buffer.dtype, device=buffer.device)
