"""What a message and a gap cost on this host: reading a message right after a task, copying a
payload across cores, a ping-pong through the pipe's transport, and a traced step's time per
message, per gap and outside its tasks."""
from __future__ import annotations

import multiprocessing
import os
import statistics
import time
from multiprocessing import shared_memory

import numpy as np
import torch

from engine.distributed import wire
from lab.processes.pool import ProcessPool
from lab.timelines.breakdown import in_order
from lab.zoo import mlp


def cold_read(width: int, rows: int, layers: int, count: int = 2000) -> str:
    """What the Python of a message costs right after a task, against back to back: reading one
    (wire.decode_header, then copying the payload out, wire.tensors_in) just after a forward and
    backward of `layers` x Linear(width)+ReLU on `rows` rows, and again at once (medians, us)."""
    header, tensors = wire.encode(1, "act", 0, 1, wire.NO_DECISION, torch.randn(rows, width), inline=False)
    frame, slot = header.numpy(), np.zeros(wire.payload_bytes(tensors), dtype=np.uint8)
    wire.write_tensors(slot, 0, tensors)
    model, x = mlp.build(layers, width), torch.randn(rows, width, requires_grad=True)

    def read() -> float:
        start = time.perf_counter()
        wire.tensors_in(slot, 0, wire.decode_header(frame))
        return time.perf_counter() - start
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cold, warm = [], []
        for _ in range(count):
            model(x).sum().backward()
            cold.append(read())
            warm.append(read())
    finally:
        torch.set_num_threads(previous)
    return f"{median_us(cold):.0f} us right after a task, {median_us(warm):.0f} us back to back"


def _fill(name: str, size: int, count: int, turn, core: int) -> None:
    """cross_core_copy's writer, a process of its own on `core`: fill the slot, then hand the turn back."""
    os.sched_setaffinity(0, {core})
    memory = shared_memory.SharedMemory(name=name)
    slot, payload = np.ndarray((size,), dtype=np.uint8, buffer=memory.buf), np.arange(size, dtype=np.uint8)
    for _ in range(count):
        turn.recv()
        slot[:] = payload
        turn.send(None)
    del slot
    memory.close()


def cross_core_copy(size: int = 8192, count: int = 2000) -> str:
    """What handing a payload across cores costs by itself: copying `size` bytes out of shared memory
    that another process, held on another core, has just written, against bytes this one wrote
    (medians; this process is held on its own core meanwhile)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return "needs 2 cores"
    memory = shared_memory.SharedMemory(create=True, size=2 * size)
    context = multiprocessing.get_context("fork")  # the writer needs only NumPy: no fresh interpreter (and
                                                   # no re-import of a caller's unguarded __main__)
    mine, theirs = context.Pipe()
    writer = context.Process(target=_fill, args=(memory.name, size, count, theirs, cores[1]), daemon=True)
    writer.start()
    os.sched_setaffinity(0, {cores[0]})
    try:
        view = np.ndarray((2 * size,), dtype=np.uint8, buffer=memory.buf)
        payload, other, own = np.arange(size, dtype=np.uint8), [], []
        for _ in range(count):
            mine.send(None)
            mine.recv()
            start = time.perf_counter()
            view[:size].copy()
            other.append(time.perf_counter() - start)
            view[size:] = payload
            start = time.perf_counter()
            view[size:].copy()
            own.append(time.perf_counter() - start)
        writer.join()
        del view
    finally:
        os.sched_setaffinity(0, cores)
        memory.close()
        memory.unlink()
    return f"{median_us(other):.2f} us written by the other process, {median_us(own):.2f} us by this one"


def ping_pong(pools: dict[str, ProcessPool], count: int = 2000) -> str:
    """One-way time of a message between the two stage processes of each pool, small and larger
    (medians of `count` round trips)."""
    return "; ".join(f"{name}: " + ", ".join(f"{pool.ping(count, numel) * 1e6:.0f} us" for numel in (1, 8 * 256))
                     for name, pool in pools.items())


def median_us(durations) -> float:
    """The median of durations in seconds, in microseconds."""
    return statistics.median(durations) * 1e6


def per_message(traces: list) -> str:
    """What a message costs the stage threads of a step in processes, next to what a task takes:
    medians over the given traces, in microseconds."""
    sends = [m.end - m.start for t in traces for m in t.messages if m.direction == "send"]
    reads = [m.end - m.start for t in traces for m in t.messages if m.direction == "receive"]
    tasks = [e.end - e.start for t in traces for e in t.events]
    return f"sending {median_us(sends):.0f} us, reading {median_us(reads):.0f} us; a task {median_us(tasks):.0f} us"


def unwaited_gaps(trace) -> list[tuple[float, float, float]]:
    """The stretches between consecutive tasks of a stage in which nothing was waited for (the next
    task needs no message, or its message was sent before the stretch began), as (length, of it the
    stage thread's time sending, and reading), in seconds: what is left is the task loop's own
    bookkeeping (marks, the plan, hooks, Python)."""
    sent = {(m.peer, m.kind, m.micro): m.end for m in trace.messages if m.direction == "send"}
    found = []
    for stage, line in in_order(trace.events).items():
        spans = [(m.direction, m.start, m.end) for m in trace.messages if m.stage == stage]
        for before, after in zip(line, line[1:]):
            if sent.get((stage, "act" if after.op == "F" else "grad", after.micro), 0.0) <= before.end:
                inside = {way: sum(max(0.0, min(end, after.start) - max(start, before.end))
                                   for direction, start, end in spans if direction == way)
                          for way in ("send", "receive")}
                found.append((after.start - before.end, inside["send"], inside["receive"]))
    return found


def gap_parts(traces: list) -> str:
    """The gaps between consecutive tasks of a stage where nothing was waited for, by what the stage
    thread did in them (sent a message, read one, neither): the median gap and, in it, the median
    message time, in microseconds."""
    gaps = [gap for trace in traces for gap in unwaited_gaps(trace)]
    groups = {"a send": [(g, s) for g, s, r in gaps if s > 0],
              "a read": [(g, r) for g, s, r in gaps if r > 0 and s == 0],
              "neither": [(g, 0.0) for g, s, r in gaps if s == r == 0]}
    return "; ".join(f"with {name} {median_us([g for g, _ in group]):.0f} us"
                     + (f" (the message {median_us([m for _, m in group]):.0f})" if name != "neither" else "")
                     + f", n={len(group)}" for name, group in groups.items() if group)


def call_parts(traces: list, seconds: list[float]) -> str:
    """The small model's step in processes outside the steady flow of tasks: each stage's busy time,
    when the last stage's first task starts, the end waves after the last task (the trace's wall
    minus its makespan), and the first stage's time outside the trace's wall: planning the call before
    its origin, then laying out the trace (the step as it timed itself, `seconds`, minus the trace's
    wall; `seconds[i]` goes with `traces[i]`): medians, in microseconds."""
    stages = 1 + max(e.stage for e in traces[0].events)
    busy = [median_us([sum(e.duration for e in t.events if e.stage == k) for t in traces]) for k in range(stages)]
    first = median_us([min(e.start for e in t.events if e.stage == stages - 1) for t in traces])
    return (f"busy {', '.join(f'{b:.0f}' for b in busy)} us (by stage); the last stage starts at {first:.0f} us; "
            f"after the last task {median_us([t.wall - t.makespan for t in traces]):.0f} us; "
            f"planning and the trace {median_us([s - t.wall for s, t in zip(seconds, traces)]):.0f} us")


