"""Devices for stages: choosing and checking them, per-thread CPU/CUDA setup, timing, and copies.

CPU is a first-class device: each stage's worker limits its intra-op threads, so K workers share the
cores. On CUDA each stage computes on a stream of its own; a tensor crosses to the next GPU on the
sender's stream, ordered there by a stream of that edge alone (not the default stream, which would
make every copy wait for every earlier one), and the receiver waits on an event before using it.
Host inputs and targets are pinned: a copy from pageable memory makes the host wait for the GPU.
"""
from __future__ import annotations

import os
import time
from contextlib import ExitStack
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from .microbatch import Value, rebuild, tensors_of


def pinned(value: Value, devices) -> Value:
    """`value` in page-locked host memory if it is on the host and any of `devices` is a GPU, else itself
    (dense first: pin_memory keeps strides, and an expanded tensor's cannot be written to)."""
    if not any(torch.device(d).type == "cuda" for d in devices):
        return value
    return rebuild(value, [t.contiguous().pin_memory() if t.device.type == "cpu" and not t.is_pinned() else t
                           for t in tensors_of(value)])


def cpu_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota (cpu.max)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()
        return max(1, min(cores, int(quota) // int(period)))
    except (OSError, ValueError):  # no quota ("max"), or no cgroup v2 here
        return cores


def resolve_devices(devices, stages: int, module: Optional[nn.Module] = None) -> list[torch.device]:
    """One checked torch.device per stage, by one policy for every K: `None` keeps every stage where
    the model is; a name puts every stage there, except a bare "cuda", which puts stage k on cuda:k
    mod the GPUs visible; a list gives each stage its own."""
    if devices is None:
        return [home_device(module)] * stages
    if isinstance(devices, (str, torch.device)):
        return [check_device(d, k) for k, d in enumerate(spread(devices, stages))]
    return [check_device(d, i) for i, d in enumerate(one_per_stage(devices, stages))]


def spread(device, stages: int) -> list:
    """`stages` copies of one device name, except that a bare "cuda" cycles over the visible GPUs."""
    if str(device) == "cuda" and torch.cuda.is_available():
        return [torch.device("cuda", k % torch.cuda.device_count()) for k in range(stages)]
    return [device] * stages


def home_device(module: Optional[nn.Module]) -> torch.device:
    """The one device holding the model's parameters and buffers (the CPU if it has none)."""
    found = {t.device for t in (list(module.parameters()) + list(module.buffers()) if module is not None else [])}
    if len(found) > 1:
        raise ValueError(f"the model's parameters and buffers are on several devices "
                         f"({', '.join(sorted(map(str, found)))}); pass devices= with one device per stage")
    return found.pop() if found else torch.device("cpu")


def one_per_stage(devices, stages: int) -> list:
    """Check that `devices` is a list with one entry per stage, and return it as a list."""
    if isinstance(devices, (str, torch.device)) or not isinstance(devices, Sequence):
        raise TypeError(f"devices must be a list with one device per stage, got {devices!r}")
    if len(devices) != stages:
        raise ValueError(f"devices has {len(devices)} entries but there are {stages} stages; expected one per stage")
    return list(devices)


def check_device(device, index: int) -> torch.device:
    """`devices[index]` as a torch.device, or a ValueError saying why this host cannot use it."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"devices[{index}]={device!r} is not a device name such as 'cpu' or 'cuda:0'") from err
    if resolved.type == "cpu":
        return resolved
    if resolved.type != "cuda":
        raise ValueError(f"devices[{index}]={device!r}: only 'cpu' and 'cuda' devices are supported")
    if not torch.cuda.is_available():
        raise ValueError(f"devices[{index}]={device!r} is not available: this host has no CUDA GPU "
                         f"(torch.cuda.is_available() is False); use 'cpu'")
    count = torch.cuda.device_count()
    resolved = torch.device("cuda", resolved.index if resolved.index is not None else torch.cuda.current_device())
    if resolved.index >= count:
        raise ValueError(f"devices[{index}]={device!r} is not available: this host has {count} CUDA device(s)")
    return resolved


class Gate:
    """Holds a stage's stream behind a spin kernel while the host issues one task (a serial run), so
    that the task's kernels run back to back once it opens and its events time the GPU's work alone,
    not the host's pace. `spin(cycles)` queues the spin kernel, `cycles_per_second()` says how fast it
    counts (asked once). The spin lasts twice the longest host time of a held task seen so far (at
    least `floor` seconds, at most `ceiling`); a task whose spin ended before the host had issued it
    is `missed`, and doubles the spin instead (its host time may hold a wait for the spin itself, or
    the rate was read at a low clock)."""

    def __init__(self, spin: Callable[[int], None], cycles_per_second: Callable[[], float],
                 floor: float = 2e-4, ceiling: float = 0.1):
        self._spin, self._rate, self._ceiling = spin, cycles_per_second, ceiling
        self.seconds, self.rate, self.missed = floor, None, 0

    def hold(self) -> None:
        """Queue the spin on the current stream: what is issued next waits behind it."""
        if self.rate is None:
            self.rate = self._rate()
        self._spin(int(self.seconds * self.rate))

    def opened(self, before_issued: bool, host_seconds: float) -> None:
        """After a task: whether the spin had ended before its last launch, and the host's time for it."""
        self.missed += before_issued
        grown = 2 * self.seconds if before_issued else 2 * host_seconds
        self.seconds = min(self._ceiling, max(self.seconds, grown))


def spin_rate(device: torch.device) -> float:
    """Cycles per second of torch.cuda._sleep on `device`, timed once by events on its current stream."""
    with torch.cuda.device(device):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10 ** 7)
        end.record()
        end.synchronize()
        return 1e7 / (start.elapsed_time(end) / 1e3)


class StageDevice:
    """The device side of one stage: thread setup, task timing, and moving values to other stages."""

    def __init__(self, device: torch.device, threads: int):
        self.device = device
        self.threads = threads
        self.is_cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.is_cuda else None
        self.gate = Gate(torch.cuda._sleep, lambda: spin_rate(device)) if self.is_cuda else None
        self._edges: dict[torch.device, "torch.cuda.Stream"] = {}  # destination GPU -> its stream for this edge
        self._origin = None
        self._t0 = 0.0

    def start(self, t0: float, origin=None) -> None:
        """Mark the step's time origin: host time `t0`, and on CUDA `origin`, an event recorded on
        this GPU at that moment (one per GPU, shared by the stages on it, so their times agree)."""
        self._t0, self._origin = t0, origin

    def on_stream(self) -> ExitStack:
        """A context in which CUDA work queues on this stage's stream, its GPU current (leaving a stream
        restores the current device's: from a thread on cuda:0 that opens a context there); nothing on a CPU."""
        stack = ExitStack()
        if self.is_cuda:
            stack.enter_context(torch.cuda.device(self.device))
            stack.enter_context(torch.cuda.stream(self.stream))
        return stack

    def enter(self) -> ExitStack:
        """Set up the calling worker thread: intra-op threads on CPU, device and stream on CUDA."""
        if not self.is_cuda:
            torch.set_num_threads(self.threads)
        return self.on_stream()

    def mark(self):
        """A time stamp on this stage's timeline; read it with `seconds` once the step is over (on
        CUDA an event on the stage's stream, with the host's own time beside it)."""
        now = time.perf_counter() - self._t0
        if self.is_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(self.stream)
            return event, now
        return now

    def seconds(self, mark) -> float:
        """Seconds from the step's start to `mark` (GPU time on CUDA; synchronizes the stream)."""
        if self.is_cuda:
            event, _ = mark
            event.synchronize()
            return self._origin.elapsed_time(event) / 1e3
        return mark

    @staticmethod
    def host_seconds(mark) -> float:
        """Seconds from the step's start to `mark` on the host's clock: when the stage's thread got
        there, whatever the GPU was doing."""
        return mark[1] if isinstance(mark, tuple) else mark

    def send(self, value: Value, destination: torch.device):
        """Move `value` towards `destination` on this stage's stream; returns what to put in the mailbox:
        the moved value and the event the receiver waits on (None when the copy is complete on return,
        as a copy to the host is)."""
        if destination.type != "cuda":
            return rebuild(value, [None if t is None else t.to(destination) for t in tensors_of(value)]), None
        if destination == self.device:  # same GPU: the receiver waits for this stage's stream
            ready = torch.cuda.Event()
            ready.record(self.stream)
            return value, ready
        edge = self._edges.get(destination)
        if edge is None:
            edge = self._edges[destination] = torch.cuda.Stream(destination)
        with torch.cuda.device(self.device if self.is_cuda else destination), torch.cuda.stream(edge), \
                torch.cuda.stream(self.stream):  # the copy queues on this stream and is
            moved = rebuild(value, [None if t is None else t.to(destination, non_blocking=True)  # ordered on the
                                    for t in tensors_of(value)])  # destination by `edge`, not its default stream
        ready = torch.cuda.Event()
        ready.record(edge)
        return moved, ready

    def to_here(self, value: Value) -> Value:
        """Move a value from outside the pipeline (an input or target chunk) onto this stage's device,
        without making the host wait for this stage's queued work (`pinned` values come from the host's
        page-locked memory, which a non-blocking copy needs)."""
        return rebuild(value, [t.to(self.device, non_blocking=self.is_cuda) for t in tensors_of(value)])

    def receive(self, payload) -> Value:
        """Make a value sent by another stage safe to use on this stage's stream: the stream waits for
        the sender's event, or for the NCCL receives (a list of works) that brought the value."""
        value, ready = payload
        if self.is_cuda and ready is not None:
            if isinstance(ready, torch.cuda.Event):
                self.stream.wait_event(ready)
            else:
                for work in ready:  # called under this stage's stream: that stream waits for the receive
                    work.wait()
            for t in tensors_of(value):
                if t is not None and t.is_cuda:
                    t.record_stream(self.stream)
        return value

    def hold(self) -> None:
        """Before a task of a gated serial run: on CUDA, hold the stream behind the gate's spin (Gate)."""
        if self.gate is not None:
            self.gate.hold()

    def settle(self, start=None, end=None) -> None:
        """Wait until this stage's queued GPU work has run (nothing to wait for on CPU): a serial run
        settles after each task, so that every task is timed alone. Given the task's marks (a gated
        run's, after `hold`), first tell the gate whether it held until the host had issued the task."""
        if self.is_cuda:
            if start is not None:
                self.gate.opened(start[0].query(), end[1] - start[1])
            self.stream.synchronize()

    def peak_bytes(self) -> Optional[int]:
        """torch.cuda.max_memory_allocated of this stage's GPU since the step began; None on CPU."""
        return torch.cuda.max_memory_allocated(self.device) if self.is_cuda else None
