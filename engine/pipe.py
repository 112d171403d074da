"""GPipe: pipeline-parallel training of an nn.Sequential over K stages and M micro-batches."""
from __future__ import annotations

import time
import weakref
from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn

from . import distributed, schedule as schedules
from .device import StageDevice, check_device, cpu_cores, one_per_stage, resolve_devices
from .memory import ActivationLedger
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

    `schedule` orders the tasks (engine/schedule.py): "gpipe" (fill-drain, the default), "1f1b"
    (same gradients up to summation order, fewer micro-batches held at once), "interleaved"
    (`virtual_stages=v` chunks per stage, chunk c on stage c % K; `balance` then describes the K*v
    chunks, an int meaning K stages of v chunks; M must be a multiple of K) or "zb-h1" (each backward
    split into an input-gradient task B and a deferred weight-gradient task W).
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
                 group=None, virtual_stages: int = 1):
        super().__init__()
        check_module(module)
        self.schedule = schedules.check_schedule(schedule)
        self.virtual_stages = _check_virtual(virtual_stages, schedule)
        self.balance = _chunk_balance(balance, len(module), self.virtual_stages)
        self.stages = stages = len(self.balance) // self.virtual_stages
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks={chunks!r}: expected an int >= 1 (micro-batches per mini-batch)")
        if schedule == "interleaved" and chunks % stages:
            raise ValueError(f"schedule='interleaved' needs chunks (M) to be a multiple of the {stages} stages, as "
                             f"Megatron-LM requires; got chunks={chunks}")
        self.chunks = chunks
        self._ranks = None if group is None else distributed.check_group(group, stages)
        workers = range(stages) if self._ranks is None else [self._ranks.rank]
        if self._ranks is None:
            self.devices = resolve_devices(devices, stages)
        else:
            self.devices = [distributed.default_device() if devices is None else
                            check_device(one_per_stage(devices, stages)[self._ranks.rank], self._ranks.rank)]
        self.checkpoint = schedules.check_checkpoint_mode(checkpoint)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed={seed!r}: expected an int or None")
        self.seed = seed
        if threads_per_stage is None:
            threads_per_stage = max(1, cpu_cores() // stages)
        if isinstance(threads_per_stage, bool) or not isinstance(threads_per_stage, int) or threads_per_stage < 1:
            raise ValueError(f"threads_per_stage={threads_per_stage!r}: expected an int >= 1")
        self.threads_per_stage = threads_per_stage
        self.record_memory = record_memory
        self.deferred_batch_norm = deferred_batch_norm
        partitions = split(module, self.balance)
        count = len(partitions)
        firsts = [sum(self.balance[:c]) for c in range(count)]
        self._devices = {worker: StageDevice(device, threads_per_stage) for worker, device in zip(workers, self.devices)}
        self._chunks: dict[int, Stage] = {}
        for worker, stage_device in self._devices.items():
            for c in range(worker, count, stages):
                partitions[c].to(stage_device.device)
                self._chunks[c] = Stage(c, count, partitions[c], firsts[c], stage_device, deferred_batch_norm, worker)
        if self._ranks is not None:
            _release_all_but(module, nn.ModuleList([partitions[c] for c in self._chunks]))
        self.local_chunks = sorted(self._chunks)  # the chunks this process runs, in model order
        self.partitions = nn.ModuleList([partitions[c] for c in self.local_chunks])
        self.steps_done = 0
        self.trace = Trace(stages=stages, checkpoint=checkpoint)
        self._threads: Optional[StageThreads] = None  # started by the first call
        self._runner = None
        if self._ranks is not None:
            rank, wraps = self._ranks.rank, self.virtual_stages > 1
            transport = distributed.ProcessTransport(
                self._ranks, group, self.devices[0],
                upstream=(rank - 1) % stages if rank > 0 or wraps else None,
                downstream=(rank + 1) % stages if rank < stages - 1 or wraps else None)
            self._runner = RankRunner(self._ranks, self._chunks, transport)
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
        schedule = self.task_lists(count)
        plan = StepPlan(inputs=micro_inputs, targets=micro_targets, loss_fn=loss_fn,
                        weights=[n / batch for n in sizes],
                        checkpointed=[schedules.checkpointed(m, count, self.checkpoint) for m in range(count)],
                        base_seed=self._base_seed(phase=0), training=True, record_memory=self.record_memory,
                        split_backward=schedules.splits_backward(schedule))
        self.steps_done += 1
        self._run(plan, schedule, batch, "serial step" if serial else "step", on_event, serial)
        losses = self._last_chunk.state.losses
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
        self._run(plan, self.task_lists(count, training=False), batch, "forward", on_event)
        outputs = self._last_chunk.state.outputs
        result = gather([outputs[m] for m in range(count)])
        self._forget_state()
        return result

    def task_lists(self, micro_batches: int, training: bool = True) -> list[list[schedules.Task]]:
        """Each stage's task list for a call of `micro_batches` micro-batches."""
        if not training:
            return schedules.forward_only(self.stages, micro_batches, self.virtual_stages)
        return schedules.SCHEDULES[self.schedule](self.stages, micro_batches, self.checkpoint, self.virtual_stages)

    # --- internals -------------------------------------------------------------------------

    @property
    def _last_chunk(self) -> Stage:
        return self._chunks[len(self.balance) - 1]

    def _base_seed(self, phase: int) -> int:
        """Seed of this call's random streams: from `seed` and the step count, or drawn from torch's RNG."""
        if self.seed is None:
            return int(torch.randint(0, 2 ** 62, ()).item())
        return mix_seed(self.seed, self.steps_done, phase)

    def _rank_call(self, kind: str, inputs, targets, loss_fn, on_event: EventCallback):
        """This rank's share of a call when stages are processes (see engine/rank.py)."""
        self._reset_device_peaks()
        result, self.trace = self._runner.call(
            kind, inputs, targets, loss_fn, self.chunks, self.checkpoint,
            lambda count: self.task_lists(count, training=kind == "step"),
            base_seed=lambda: self._base_seed(phase=0 if kind == "step" else 1), record_memory=self.record_memory,
            start=self._start, memory_of=self._memory_of, on_event=on_event)
        return result

    def _reset_device_peaks(self) -> None:
        for device in set(self.devices):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)

    def _start(self, plan: StepPlan, t0: float) -> None:
        """Begin a call on this process's stages: time origin, and one activation ledger per stage
        for all of its chunks."""
        ledgers = {}
        for worker, device in self._devices.items():
            device.start(t0)
            ledgers[worker] = ActivationLedger([p for stage in self._chunks.values() if stage.worker == worker
                                                for p in stage.parameters()])
        for stage in self._chunks.values():
            stage.start(plan, ledgers[stage.worker])

    def _run(self, plan: StepPlan, schedule, batch: int, kind: str, on_event: EventCallback,
             serial: bool = False) -> None:
        self._reset_device_peaks()
        t0 = time.perf_counter()
        self._start(plan, t0)
        if self._threads is None and not serial:
            self._threads = StageThreads(self.stages)
        try:
            if serial:
                events = run_serially(self._chunks, schedule, on_event)
            else:
                events = run_schedule(self._threads, self._chunks, schedule, on_event)
        except BaseException:
            self._forget_state()
            raise
        wall = time.perf_counter() - t0
        for stage in self._chunks.values():
            if stage.batch_norm is not None:
                stage.batch_norm.finish_step()
        self.trace = Trace(stages=self.stages, micro_batches=len(plan.inputs), batch_size=batch,
                           checkpoint=self.checkpoint, kind=kind, events=events,
                           memory=[self._memory_of(worker) for worker in self._devices], wall=wall)

    def _memory_of(self, worker: int) -> StageMemory:
        """Memory of one stage: its chunks' parameters and gradients, its activation peak."""
        stages = [stage for stage in self._chunks.values() if stage.worker == worker]
        params = [p for stage in stages for p in stage.parameters()]
        device = self._devices[worker]
        return StageMemory(
            stage=worker, device=str(device.device),
            param_bytes=sum(p.numel() * p.element_size() for p in params),
            grad_bytes=sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
            activation_peak_bytes=stages[0].ledger.peak, device_peak_bytes=device.peak_bytes())

    def _forget_state(self) -> None:
        """Drop every reference a call kept (graphs, inputs, outputs), so nothing outlives it."""
        for stage in self._chunks.values():
            stage.finish()


def _check_virtual(virtual: int, schedule: str) -> int:
    """`virtual_stages` checked against the schedule: several chunks per stage only when interleaved."""
    if isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < 1:
        raise ValueError(f"virtual_stages={virtual!r}: expected an int >= 1 (chunks of layers per stage)")
    if schedule == "interleaved" and virtual < 2:
        raise ValueError(f"schedule='interleaved' needs virtual_stages >= 2 (chunks per stage), got {virtual}")
    if schedule != "interleaved" and virtual != 1:
        raise ValueError(f"virtual_stages={virtual}: only schedule='interleaved' places several chunks on a stage")
    return virtual


def _chunk_balance(balance: Union[int, Sequence[int]], layers: int, virtual: int) -> list[int]:
    """Layers per chunk. With v chunks per stage, an int K means K*v even chunks, and a list gives
    every one of the K*v chunks its layer count."""
    if virtual == 1:
        return resolve_balance(balance, layers)
    if isinstance(balance, int) and not isinstance(balance, bool):
        if balance >= 1 and balance * virtual > layers:
            raise ValueError(f"balance={balance} stages x virtual_stages={virtual} = {balance * virtual} chunks but "
                             f"the model has only {layers} layers; expected at most one chunk per layer")
        return resolve_balance(balance * virtual if balance >= 1 else balance, layers)
    counts = resolve_balance(balance, layers)
    if len(counts) % virtual:
        raise ValueError(f"balance has {len(counts)} entries; with virtual_stages={virtual} it lists the K*v chunks, "
                         f"expected a multiple of {virtual}")
    return counts


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
