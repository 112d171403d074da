"""GPipe: pipeline-parallel training of an nn.Sequential over K stages and M micro-batches."""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn

from . import schedule as schedules
from .call import Call, Decision, micro_batch_sizes
from .chunk import Chunk
from .device import StageDevice, cpu_cores, pinned, resolve_devices
from .microbatch import Value, check_inputs, check_targets, scatter
from .partition import check_module, resolve_balance, split
from .rng import mix_seed
from .runner import EventCallback, Runner, ThreadRunner
from .stages import LocalStages
from .trace import Trace


class GPipe(nn.Module):
    """Train an nn.Sequential as a GPipe pipeline: K stages, M micro-batches, optional recompute.

    `checkpoint` says which micro-batches are re-materialized: "always", "except_last" (all but the
    last: torchgpipe's default), "never", one of these per stage (("always", "never"): recompute
    only where memory is short), or, for a written schedule, "as_written": exactly the (chunk,
    micro-batch) pairs it runs an R task for.

    `schedule` orders the tasks (engine/schedule.py): "gpipe" (fill-drain, the default), "1f1b"
    (fewer micro-batches held), "interleaved"
    (`virtual_stages=v` chunks per stage, chunk c on stage c % K; `balance` then describes the K*v
    chunks, an int meaning K stages of v chunks; M must be a multiple of K), "zb-h1" (each backward
    split into an input-gradient task B and a deferred weight-gradient task W), "zb-v" (two chunks
    per stage in a V, W split off), or a `schedule.Schedule` a person wrote (its own K, v, placement
    and M; refused with its first problem named).
    The stages are the model's own layers (nothing is copied): an optimizer over
    `pipe.parameters()` (on CPU, the model's) trains the model itself. Gradients equal
    those of the whole mini-batch on one device; see docs/engine.md for what "equal" means bit for bit.

    `autocast=torch.bfloat16` (or float16) runs each task (recompute included) under torch.autocast.

    `devices`: None (the default) keeps the stages where the model is (a model built on the CPU
    stays there, even beside GPUs); a device name puts every stage there, "cuda" spreads them over
    the visible GPUs; a list names one device per stage.

    `pipe.runner` runs each call (engine/runner.py): every stage a thread of this process, or, with
    `group=` (a torch.distributed group of K ranks), rank i runs stage i in its own process. Every
    rank builds the same model and calls the same methods; each keeps only its stage's layers
    (`pipe.parameters()`); "cuda" means cuda:LOCAL_RANK there.

    With `data_parallel=` as well (the ranks that run this stage in the other pipelines, such as a
    DeviceMesh's "dp" group, `group` being its "pp" group), D pipelines train as replicas: each
    first stage reads its own shard, every stage's gradients are those of the mean loss over the
    global batch (an all-reduce, started once the stage's last task ran), and `step` returns that
    loss. Replica d numbers its micro-batches from d*M, so `seed=` draws the masks one pipeline of
    D*M micro-batches would.
    """

    def __init__(self, module: nn.Sequential, balance: Union[int, Sequence[int]], *,
                 devices: Optional[Sequence] = None, chunks: int = 1, checkpoint: str = "except_last",
                 deferred_batch_norm: bool = False, seed: Optional[int] = None, threads_per_stage: Optional[int] = None,
                 record_memory: bool = True, schedule: Union[str, schedules.Schedule] = "gpipe",
                 group=None, virtual_stages: int = 1, data_parallel=None, autocast: Optional[torch.dtype] = None):
        super().__init__()
        if data_parallel is not None and group is None:
            raise ValueError("data_parallel= needs group= too: replicas of a pipeline are processes, each running "
                             "one stage (pass the 'pp' and 'dp' groups of a DeviceMesh, or groups from new_group)")
        check_module(module)
        written = isinstance(schedule, schedules.Schedule)
        self.schedule = schedule if written else schedules.check_schedule(schedule)
        if written:  # chunks per stage; schedules.check refuses a placement that gives stages unequal numbers
            virtual_stages, schedule = max(1, len(schedule.placement) // max(len(schedule), 1)), "written"
        schedules.check_layout(schedule, 1, None, virtual_stages)
        self.virtual_stages = virtual_stages
        self.balance = _chunk_balance(balance, len(module), virtual_stages, schedule)
        self.stages = stages = len(self.balance) // virtual_stages
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks={chunks!r}: expected an int >= 1 (micro-batches per mini-batch)")
        schedules.check_layout(schedule, stages, chunks, virtual_stages, checkpoint=checkpoint)
        self.micro_batches = chunks  # M: `chunks=` is torchgpipe's keyword for it; a chunk here is a piece of layers
        self.checkpoint = schedules.check_checkpoint_mode(checkpoint, stages)  # a per-stage list becomes a tuple
        if written and len(self.schedule) != stages:
            raise ValueError(f"the schedule has {len(self.schedule)} stages but balance makes {stages}")
        self._plans: dict = {}  # (M, training) -> (task lists, the (chunk, micro-batch) pairs they recompute)
        self.placement = self.task_lists(chunks).placement  # checks a written schedule: its problem, named
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
        if autocast not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"autocast={autocast!r}: expected None, torch.bfloat16 or torch.float16")
        self.autocast = autocast
        if group is None:
            self.rank = None
            self.devices = resolve_devices(devices, stages, module)
            placed = dict(enumerate(self.devices))
        else:  # the process path is a plug-in: imported only by pipes that run one stage per process
            from .distributed.runner import rank_and_device
            self.rank, device = rank_and_device(group, stages, devices, module)
            self.devices = [device]
            placed = {self.rank: device}
        partitions = split(module, self.balance)
        count = len(partitions)
        firsts = [sum(self.balance[:c]) for c in range(count)]
        stage_devices = {stage: StageDevice(device, threads_per_stage) for stage, device in placed.items()}
        chunk_map: dict[int, Chunk] = {}
        for stage, stage_device in stage_devices.items():
            for c in (c for c in range(count) if self.placement[c] == stage):
                partitions[c].to(stage_device.device)
                chunk_map[c] = Chunk(c, count, partitions[c], firsts[c], stage_device, deferred_batch_norm, stage,
                                     self.autocast)
        self.local_chunks = sorted(chunk_map)  # the chunks this process runs, in model order
        self.partitions = nn.ModuleList([partitions[c] for c in self.local_chunks])
        self._local = LocalStages(chunk_map, stage_devices, count)
        if group is None:
            self.runner: Runner = ThreadRunner(self._local, stages)
        else:
            from .distributed.runner import RankRunner
            _release_all_but(module, self.partitions)
            self.runner = RankRunner(self._local, group, stages, self.placement, data_parallel=data_parallel)
        self.steps_done = 0
        self._trace: Union[Trace, Callable[[], Trace]] = Trace(stages=stages, checkpoint=checkpoint)

    def close(self) -> None:
        """Stop the stage worker threads now (they also stop when the pipe is garbage-collected);
        a later call starts new ones. With stages as processes every rank calls it (it ends the
        transport's threads on both sides of each connection), and the pipe cannot be used after."""
        self.runner.close()

    def step(self, inputs: Value, targets: torch.Tensor, loss_fn: Callable, *, on_event: EventCallback = None,
             serial: Union[bool, str] = False):
        """One mini-batch: pipelined forward and backward, gradients summed into `.grad`.

        `loss_fn(output_chunk, target_chunk)` must return the mean loss of a micro-batch; each is
        weighted by its share of the mini-batch, so the gradients are those of the mean over the
        whole mini-batch. Returns that mini-batch loss (a detached scalar on the last device; with
        stages as processes, on every rank; with data_parallel=, the mean over the global batch).
        `on_event`, if given, is called with each task's Event as it finishes. `serial=True` runs
        the tasks one at a time on the calling thread (same results; each task timed alone, as an
        ideal replay on a host with fewer cores than stages needs). `serial="gated"` also holds each
        task's CUDA stream until the host has issued the whole task (engine.device.Gate), so that its
        events time the GPU's own work, kernels back to back, apart from the host's pace (Event.host).
        """
        if serial not in (False, True, "gated"):
            raise ValueError(f"serial={serial!r}: expected False, True or 'gated'")
        if serial and self.rank is not None:
            raise ValueError("serial=True runs every stage on the calling thread; with group= each rank "
                             "runs only its own stage")
        return self._call("step", inputs, targets, loss_fn, on_event, serial)

    def forward(self, inputs: Value, *extra, on_event: EventCallback = None) -> Value:
        """Forward only (inference/evaluation), pipelined over micro-batches, without graphs.

        Returns the outputs of all micro-batches joined along dim 0, on the last stage's device
        (with stages as processes: on the last stage's rank, None elsewhere). Layers run in their
        own mode: after `pipe.train()` batch norm normalizes each micro-batch with its own
        statistics and updates the running ones (with deferred batch norm, once for the whole
        mini-batch, as nn.BatchNorm on it would); after `pipe.eval()` nothing changes.
        """
        if extra:
            raise TypeError(f"GPipe takes one input value, got {1 + len(extra)} positional arguments; "
                            f"pass several input tensors as one tuple: pipe((a, b))")
        return self._call("forward", inputs, None, None, on_event)

    @property
    def trace(self) -> Trace:
        """The record of the last call (engine/trace.py): its events, memory and messages. Built
        when first read, so that a step nobody looks at does not pay for it."""
        if not isinstance(self._trace, Trace):
            self._trace = self._trace()
        return self._trace

    @property
    def call_origin(self) -> float:
        """The time origin of the current (or last) call as a time.perf_counter() reading (with
        stages as processes, on rank 0's clock): an event's times are seconds from it."""
        return self.runner.origin

    def task_lists(self, micro_batches: int, training: bool = True) -> schedules.Schedule:
        """Each stage's task list, and the placement of chunks, for a call of `micro_batches` micro-batches."""
        return self._plan(micro_batches, training)[0]

    def _plan(self, micro_batches: int, training: bool) -> tuple[schedules.Schedule, frozenset]:
        """The task lists and the (chunk, micro-batch) pairs they recompute, built once per (M, training)."""
        if (micro_batches, training) in self._plans:  # a pure function of them
            return self._plans[(micro_batches, training)]
        if not training:
            plan = schedules.forward_only(self.placement, micro_batches)
        elif isinstance(self.schedule, str):
            plan = schedules.Schedule(schedules.SCHEDULES[self.schedule](self.stages, micro_batches, self.checkpoint,
                                                                       self.virtual_stages))  # keeps ZB-V's V
        else:
            if micro_batches != self.micro_batches:
                raise ValueError(f"the schedule was written for M={self.micro_batches} micro-batches, but this "
                                 f"mini-batch makes {micro_batches}: pass at least {self.micro_batches} samples")
            schedules.check(self.schedule, micro_batches, self.checkpoint)
            plan = self.schedule
        self._plans[(micro_batches, training)] = plan, schedules.recomputed(plan)
        return self._plans[(micro_batches, training)]

    # --- one call: decided by the first stage, planned here, run by the runner -------------------

    def _call(self, kind: str, inputs, targets, loss_fn, on_event: EventCallback, serial: bool = False):
        with self.runner.calling():
            if kind == "step" and not callable(loss_fn):
                raise TypeError(f"loss_fn must be callable, got {loss_fn!r}")
            decision = self.runner.agree(self._decide(kind, inputs) if self._local.runs_first else None)
            if kind == "step":
                self.steps_done += 1
            call = self._prepare(kind, decision, inputs, targets, loss_fn)
            result, self._trace = self.runner.run(call, on_event, serial)
        return result

    def _decide(self, kind: str, inputs) -> Decision:
        """The first stage's decision: the mini-batch's size, and the base seed of the call's random
        streams (from `seed` and the step count, or drawn from torch's RNG)."""
        if inputs is None and self.rank is not None:
            raise ValueError(f"inputs are missing on rank {self.rank}, which runs the first stage: pass the "
                             f"mini-batch's inputs there (other ranks may pass None)")
        batch = check_inputs(inputs)
        phase = 0 if kind == "step" else 1
        seed = int(torch.randint(0, 2 ** 62, ()).item()) if self.seed is None else \
            mix_seed(self.seed, self.steps_done, phase)
        return Decision(batch, seed)

    def _prepare(self, kind: str, decision: Decision, inputs, targets, loss_fn) -> Call:
        """Everything about the call that follows from the decision and this pipe's settings."""
        training = kind == "step"
        sizes = micro_batch_sizes(decision.batch, self.micro_batches)
        micro_targets = None
        if training and self._local.runs_last:
            if targets is None and self.rank is not None:
                raise ValueError(f"targets are missing on rank {self.rank}, which runs the last stage: pass the "
                                 f"mini-batch's targets there (other ranks may pass None)")
            check_targets(targets, decision.batch)
            micro_targets = scatter(pinned(targets, self.devices), self.micro_batches)
        replicas, (tasks, recomputed) = self.runner.replicas, self._plan(len(sizes), training)
        return Call(kind=kind, decision=decision, sizes=tuple(sizes),
                    micro_offset=0 if replicas is None else replicas.index * len(sizes),
                    schedule=tasks, checkpoint=self.checkpoint, recomputed=recomputed,
                    record_memory=training and self.record_memory,
                    inputs=scatter(pinned(inputs, self.devices), self.micro_batches) if self._local.runs_first
                    else None, targets=micro_targets, loss_fn=loss_fn if training else None)


def _chunk_balance(balance: Union[int, Sequence[int]], layers: int, virtual: int, schedule: str) -> list[int]:
    """Layers per chunk. With v chunks per stage, an int K means K*v even chunks, and a list gives
    every one of the K*v chunks its layer count."""
    if virtual == 1:
        return resolve_balance(balance, layers)
    if isinstance(balance, int) and not isinstance(balance, bool):
        if balance >= 1:
            schedules.check_layout(schedule, balance, None, virtual, layers)
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
