"""Benchmark of the engine on this host: prints one table of measured throughputs and ratios.

    python -m lab.bench            # full size: 8 x Linear(1024,1024)+ReLU, batch 2048, and the
                                   # small model (8 x Linear(256)+ReLU, batch 64) threads vs processes
    python -m lab.bench --quick    # small sizes, for a smoke run
    python -m lab.bench --small    # only the small model's rows
    python -m lab.bench --overhead # only the engine's own time on a near-empty model (lab/overhead.py)
    python -m lab.bench --search   # only a found schedule beside GPipe, 1F1B, ZB-H1, ZB-V (lab/schedule_search.py)
    python -m lab.bench --host-time  # only the host's share of a task, engine beside plain PyTorch (lab/host_time.py)

Every configuration is timed once per round, round after round, so that a noisy host slows all
of them alike. Rates are medians over the rounds; a ratio is the median of the per-round ratios.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import statistics
import threading
import time
from functools import partial
from multiprocessing import shared_memory
from typing import Callable

import numpy as np
import torch
from torch import nn

from engine import GPipe
from engine.device import cpu_cores
from engine.distributed import wire

from . import host_time, overhead, replay, schedule_search
from .breakdown import in_order
from .host import keep_freed_cpu_memory
from .models import build_mlp
from .pool import ProcessPool


def plain_step(model: nn.Sequential, threads: int) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """One ordinary PyTorch forward/backward on the whole batch, with `threads` intra-op threads."""
    loss_fn = nn.MSELoss()

    def step(x, y):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            loss_fn(model(x), y).backward()
        finally:
            torch.set_num_threads(previous)
    return step


def engine_step(model: nn.Sequential, stages: int, chunks: int, threads: int, **options):
    pipe = GPipe(model, stages, chunks=chunks, threads_per_stage=threads, **{**overhead.LEAN, **options})
    loss_fn = nn.MSELoss()
    return lambda x, y: pipe.step(x, y, loss_fn)


def process_step(pool: ProcessPool, width: int, layers: int, chunks: int, **options):
    """The pipeline with one process per stage (a local pool): its step returns the step's seconds
    as the first stage's process measured them, without this process's hand-over to the pool."""
    pool.build("lab.models:build", dict(name="mlp", blocks=layers, width=width), chunks=chunks,
               **{**overhead.LEAN, **options})
    loss_fn = nn.functional.mse_loss

    def step(x, y):
        pool.step(x, y, loss_fn)
        return pool.seconds
    return step


def measure(steps: dict[str, Callable], x: torch.Tensor, y: torch.Tensor, rounds: int) -> dict[str, list[float]]:
    """Seconds per step of each step function in each round, timed round-robin after a warm-up.
    A step function that returns a number has timed itself (a step in other processes)."""
    for step in steps.values():
        step(x, y)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            seconds = step(x, y)
            times[name].append(seconds if isinstance(seconds, float) else time.perf_counter() - start)
    return times


def ratio(times: dict[str, list[float]], fast: str, slow: str, digits: int = 2) -> str:
    """How many times faster `fast` ran than `slow`: the median of the per-round ratios (pairs
    timed seconds apart suffer the same host noise), followed by their range over the rounds."""
    per_round = [s / f for f, s in zip(times[fast], times[slow])]
    return (f"{statistics.median(per_round):.{digits}f}x "
            f"(rounds {min(per_round):.{digits}f} to {max(per_round):.{digits}f})")


def run_together(jobs: list[Callable[[], None]]) -> None:
    """Run every job on a thread of its own and wait for all of them."""
    threads = [threading.Thread(target=job) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def independent_halves(model: nn.Sequential, width: int, chunks: int, checkpoint: str):
    """The ceiling for two cores: each half of the model trained on its own thread (K=1 each), the
    same work as the two stages of a K=2 pipeline (the second half's input gradient included) but
    with no data passing between them."""
    half = len(model) // 2
    pipes = [GPipe(nn.Sequential(*part), 1, chunks=chunks, threads_per_stage=1, checkpoint=checkpoint, **overhead.LEAN)
             for part in (list(model)[:half], list(model)[half:])]
    loss_fn = nn.MSELoss()

    def step(x, y):
        middle = torch.randn(x.shape[0], width, requires_grad=True)
        run_together([lambda: pipes[0].step(x, middle, loss_fn), lambda: pipes[1].step(middle, y, loss_fn)])
    return step


def bare_matmuls(width: int, layers: int, batch: int, chunks: int, threads: int) -> Callable:
    """The hardware's own ceiling: the three matrix products per layer and micro-batch of a training
    step (forward, input gradient, weight gradient), with no autograd, engine or data hand-over,
    split over `threads` threads of one core each (the layers cut in `threads` halves)."""
    weights = [torch.randn(width, width) for _ in range(layers)]
    micro = torch.randn(batch // chunks, width)
    share = layers // threads

    def products(part: list[torch.Tensor]) -> None:
        torch.set_num_threads(1)
        for _ in range(chunks):
            for weight in part:
                out = micro @ weight
                micro @ weight.t(), out.t() @ micro

    def step(x, y):
        run_together([partial(products, weights[i * share:(i + 1) * share]) for i in range(threads)])
    return step


SMALL = dict(width=256, layers=8, batch=64, chunks=8, repeats=2000)  # the model a learner's laptop runs;
                                                                   # repeats: timings taken per message-cost row


def run(width: int, layers: int, batch: int, rounds: int, checkpoint: str, small: dict,
        lanes: dict[str, ProcessPool], half_pools: tuple) -> list[tuple[str, str, str]]:
    """Measure every configuration and return the table rows (what, measured, target). `lanes`: pools
    of 2 stages by lane ("shared memory", "shared memory, waits asleep", "gloo"); `half_pools`: two
    pools of one stage (halves_at_once)."""
    cores = cpu_cores()
    torch.manual_seed(1)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    model = build_mlp(layers, width)
    dropout_model = build_mlp(layers, width, dropout=0.1)
    single = {f"K=1 M={m} {t} thread(s)": engine_step(model, 1, m, t, checkpoint=checkpoint)
              for m in (1, 4, 32) for t in sorted({1, cores})}
    steps = dict(single)
    steps.update({
        "K=2 M=32": engine_step(model, 2, 32, 1, checkpoint=checkpoint),
        "K=2 M=32 processes": process_step(lanes["shared memory"], width, layers, 32, checkpoint=checkpoint,
                                           threads_per_stage=1),
        "ceiling": independent_halves(model, width, 32, checkpoint),
        "matmuls 1 thread": bare_matmuls(width, layers, batch, 32, 1),
        "matmuls 2 threads": bare_matmuls(width, layers, batch, 32, 2),
        "K=2 M=32 with ledger": engine_step(model, 2, 32, 1, checkpoint=checkpoint, record_memory=True),
        "plain PyTorch": plain_step(model, cores),
        "dropout seed=None": engine_step(dropout_model, 2, 32, 1, checkpoint=checkpoint),
        "dropout seed=0": engine_step(dropout_model, 2, 32, 1, checkpoint=checkpoint, seed=0),
    })
    times = measure(steps, x, y, rounds)
    measured_small = small_rows(small, rounds, lanes, half_pools)
    rate = {name: batch / statistics.median(t) for name, t in times.items()}
    one_core = "K=1 M=32 1 thread(s)"
    best = max(single, key=rate.get)
    return [
        ("K=1, M=32, one thread (one core)", f"{rate[one_core]:.0f} samples/s", ""),
        ("K=2, M=32, one thread per stage", f"{rate['K=2 M=32']:.0f} samples/s", ""),
        ("K=2, M=32, one process per stage (shared memory)", f"{rate['K=2 M=32 processes']:.0f} samples/s", ""),
        ("**speedup K=2 over K=1 at M=32**", f"**{ratio(times, 'K=2 M=32', one_core)}**",
         ">= 1.8x (paper: 1.8x on 2 TPUs; ideal 2*32/33 = 1.94x)"),
        ("**speedup K=2 processes over K=1 at M=32**", f"**{ratio(times, 'K=2 M=32 processes', one_core)}**",
         ">= 1.8x"),
        *measured_small,
        ("ceiling: both halves on 2 threads, no pipeline", ratio(times, 'ceiling', one_core),
         "what 2 cores of this host give with no data dependencies"),
        ("ceiling: the step's bare matrix products on 2 threads vs 1",
         ratio(times, 'matmuls 2 threads', 'matmuls 1 thread'),
         "the hardware alone: no autograd, no engine"),
        (f"best single stage ({best})", f"{rate[best]:.0f} samples/s", ""),
        ("K=2, M=32 over the best single stage", ratio(times, 'K=2 M=32', best), "reported"),
        (f"K=1, M=1 engine step vs plain PyTorch, {cores} threads",
         ratio(times, f'K=1 M=1 {cores} thread(s)', 'plain PyTorch', digits=3), "within 5% (0.95x to 1.05x)"),
        ("memory ledger on vs off (K=2, M=32)", ratio(times, 'K=2 M=32 with ledger', 'K=2 M=32', digits=3),
         "cost of tracing memory (1.0 = free)"),
        ("seed=0 vs seed=None (with dropout, K=2, M=32)", ratio(times, 'dropout seed=0', 'dropout seed=None', digits=3),
         "cost of seed= (1.0 = free)"),
        ("starting a ProcessPool(2), its stage processes up and met", pool_starts(rounds),
         "forked from the warm forker (lab/forker.py) vs fresh interpreters (GPIPE_WARM_FORK=0)"),
    ]


def pool_starts(rounds: int) -> str:
    """Seconds to start a ProcessPool(2), its stage processes forked from the warm forker and as fresh
    interpreters, interleaved round by round: medians and ranges."""
    times: dict[str, list[float]] = {"1": [], "0": []}
    previous = os.environ.get("GPIPE_WARM_FORK")
    try:
        for _ in range(rounds):
            for mode, seconds in times.items():
                os.environ["GPIPE_WARM_FORK"] = mode
                start = time.perf_counter()
                pool = ProcessPool(2)
                seconds.append(time.perf_counter() - start)
                pool.close()
    finally:
        if previous is None:
            os.environ.pop("GPIPE_WARM_FORK", None)
        else:
            os.environ["GPIPE_WARM_FORK"] = previous

    def said(seconds: list[float]) -> str:
        return f"{statistics.median(seconds):.2f} s ({min(seconds):.2f} to {max(seconds):.2f})"
    return f"forked {said(times['1'])}, fresh {said(times['0'])}"


def small_rows(small: dict, rounds: int, lanes: dict[str, ProcessPool], half_pools: tuple) -> list[tuple[str, str, str]]:
    """Measure the small model (measure_small) and return its rows of the table."""
    times, traces = measure_small(lanes, small, rounds, half_pools)
    shape = f"{small['layers']} x Linear({small['width']})+ReLU, batch {small['batch']}, M={small['chunks']}, no recompute"
    return [
        (f"**small model ({shape}): K=2 processes over K=1, shared memory**",
         f"**{ratio(times, 'small K=2 processes, shared memory', 'small K=1')}**", ">= 1.4x"),
        ("small model: K=2 processes over K=1, shared memory, every wait asleep at once",
         ratio(times, 'small K=2 processes, shared memory, waits asleep', 'small K=1'),
         "without the lane's spin before it sleeps (ProcessPool(spin=0))"),
        ("small model: K=2 processes over K=1, gloo", ratio(times, 'small K=2 processes, gloo', 'small K=1'),
         "the lane between hosts, here on loopback"),
        ("small model: its two halves at once, a process each, no messages (K=1 each) over K=1",
         ratio(times, 'small halves at once', 'small K=1'), "the host's ceiling for this cut: no lane, no waits"),
        ("small model: K=2 processes over K=1 if messages and the call's ends were free",
         ratio({**times, "replayed": replayed(traces["shared memory"][1:], small["chunks"])}, "replayed", "small K=1"),
         "each step's own traced tasks laid on the schedule (lab.replay): the fill and drain stay, the engine's "
         "messages, gaps and call ends go"),
        ("small model: K=2 threads over K=1", ratio(times, 'small K=2 threads', 'small K=1'),
         "the interpreter lock: threads of one process barely overlap"),
        ("small model: step at K=1, K=2 threads, K=2 processes (shared memory, gloo)",
         ", ".join(f"{statistics.median(times[name]) * 1e3:.1f} ms"
                   for name in ("small K=1", "small K=2 threads", "small K=2 processes, shared memory",
                                "small K=2 processes, gloo")), "medians"),
        ("small model, shared memory: stage-thread time per message", per_message(traces["shared memory"]),
         "goal: under 30 us each side; medians over the steps' traces"),
        ("small model, shared memory: a gap between tasks of a stage with nothing to wait for",
         gap_parts(traces["shared memory"]), "goal: under 20 us; beside the message, the task loop's bookkeeping"),
        ("small model, shared memory: the step outside its flow of tasks",
         call_parts(traces["shared memory"][1:], times["small K=2 processes, shared memory"]),
         "the ideal's stages are equal and start at once (traces after the warm-up step)"),
        ("small model, gloo: stage-thread time per message", per_message(traces["gloo"]),
         "2 messages per micro-batch and cut"),
        ("ping-pong between two stage processes, one way: 1 float, 8 x 256 floats", ping_pong(lanes, small["repeats"]),
         f"through the pipe's transport; medians of {small['repeats']} round trips"),
        (f"small model: reading a message of {small['batch'] // small['chunks']} x {small['width']} floats (header, "
         f"copy out)", cold_read(small['width'], small['batch'] // small['chunks'], small['layers'] // 2, small['repeats']),
         "Python right after a task runs slower: its data pushed the interpreter's out of the core's caches"),
        (f"copying {small['batch'] // small['chunks']} x {small['width']} floats out of shared memory",
         cross_core_copy(4 * small['width'] * (small['batch'] // small['chunks']), small['repeats']),
         f"the payload's own cost of crossing cores; medians of {small['repeats']}"),
    ]


def measure_small(pools: dict[str, ProcessPool], small: dict, rounds: int, half_pools: tuple):
    """The small model, where the interpreter lock and the cost of a message decide: K=1, K=2 as
    threads, K=2 as processes over each lane, its halves at once in two pools of one stage
    (halves_at_once); and the processes' traces, by lane."""
    width, layers, batch, chunks = small["width"], small["layers"], small["batch"], small["chunks"]
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    model = build_mlp(layers, width)
    traces: dict[str, list] = {lane: [] for lane in pools}

    def traced(lane: str):
        pool = pools[lane]
        in_processes = process_step(pool, width, layers, chunks, checkpoint="never", threads_per_stage=1)

        def step(x, y):
            seconds = in_processes(x, y)
            traces[lane].append(pool.trace)
            return seconds
        return step
    steps = {"small K=1": engine_step(model, 1, chunks, 1, checkpoint="never"),
             "small K=2 threads": engine_step(model, 2, chunks, 1, checkpoint="never")}
    steps.update({f"small K=2 processes, {lane}": traced(lane) for lane in pools})
    steps["small halves at once"] = halves_at_once(half_pools, small)
    times = measure(steps, x, y, rounds * 3)  # short steps: more rounds for the same confidence
    return times, traces


def replayed(traces: list, micro_batches: int) -> list[float]:
    """Each trace's makespan had its tasks, as long as they measured, started as soon as their stage
    and input allowed (lab.replay's ideal replay of the GPipe schedule): no message, gap or call end."""
    return [replay.ideal_replay([vars(e) for e in t.events], t.stages, micro_batches, "never").makespan for t in traces]


def halves_at_once(pools: tuple, small: dict) -> Callable:
    """The small model's ceiling on this host: its two halves trained at once, each as a K=1 pipe in
    a process of its own, with no data passing between them (the second half's input gradient
    included). Its step is the slower half's, as that process timed it."""
    width, layers, chunks = small["width"], small["layers"], small["chunks"]
    for pool in pools:
        pool.build("lab.models:build", dict(name="mlp", blocks=layers // 2, width=width), chunks=chunks,
                   checkpoint="never", threads_per_stage=1, **overhead.LEAN)
    loss_fn = nn.functional.mse_loss

    def step(x, y):
        middle = torch.randn(x.shape[0], width, requires_grad=True)
        run_together([lambda: pools[0].step(x, middle.detach(), loss_fn), lambda: pools[1].step(middle, y, loss_fn)])
        return max(pool.seconds for pool in pools)
    return step


def cold_read(width: int, rows: int, layers: int, count: int = 2000) -> str:
    """What the Python of a message costs right after a task, against back to back: reading one
    (wire.decode_header, then copying the payload out, wire.tensors_in) just after a forward and
    backward of `layers` x Linear(width)+ReLU on `rows` rows, and again at once (medians, us)."""
    header, tensors = wire.encode(1, "act", 0, 1, wire.NO_DECISION, torch.randn(rows, width), inline=False)
    frame, slot = header.numpy(), np.zeros(wire.payload_bytes(tensors), dtype=np.uint8)
    wire.write_tensors(slot, 0, tensors)
    model, x = build_mlp(layers, width), torch.randn(rows, width, requires_grad=True)

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
                                   for direction, start, end in spans if direction == way) for way in ("send", "receive")}
                found.append((after.start - before.end, inside["send"], inside["receive"]))
    return found


def gap_parts(traces: list) -> str:
    """The gaps between consecutive tasks of a stage where nothing was waited for, by what the stage
    thread did in them (sent a message, read one, neither): the median gap and, in it, the median
    message time, in microseconds."""
    gaps = [gap for trace in traces for gap in unwaited_gaps(trace)]
    groups = {"a send": [(g, s) for g, s, r in gaps if s > 0], "a read": [(g, r) for g, s, r in gaps if r > 0 and s == 0],
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


def overhead_rows(pool: ProcessPool, tuned: bool, rounds: int, count: int, micros) -> list[tuple[str, str, str]]:
    """The near-empty model's rows (lab/overhead.py) at M in `micros`, then where its M=1 call's time
    goes in stage processes (call_parts over traced steps, after a warm-up step)."""
    rows = overhead.measure(pool, tuned, rounds, count, micros)
    work = overhead.NEAR_EMPTY
    step = process_step(pool, work.width, work.blocks, 1, checkpoint="never", threads_per_stage=1)
    x, y = work.data()
    traces, seconds = [], []
    for _ in range(1 + 3 * rounds):
        seconds.append(step(x, y))
        traces.append(pool.trace)
    return rows + [("near-empty K=2, processes, M=1: the call outside its two stages' tasks",
                    call_parts(traces[1:], seconds[1:]), "where a call's fixed microseconds go")]


def format_table(rows: list[tuple[str, str, str]]) -> str:
    """A markdown table of the rows."""
    lines = ["| measurement | result | target / note |", "|---|---|---|"]
    lines += [f"| {what} | {value} | {target} |" for what, value, target in rows]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model and batch: a smoke run, not a measurement")
    parser.add_argument("--small", action="store_true", help="only the small model's rows (a minute or two)")
    parser.add_argument("--overhead", action="store_true",
                        help="only the engine's own time per call, task and message, beside torch's (about a minute)")
    parser.add_argument("--search", action="store_true",
                        help="only a schedule found for a Transformer with unequal stages, beside the built-in "
                             "ones, predicted and measured (about 30 s)")
    parser.add_argument("--host-time", action="store_true",
                        help="only Python calls, ATen operators and microseconds per task of a Transformer stage, "
                             "beside plain PyTorch's (about 20 s)")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per configuration (medians are shown)")
    parser.add_argument("--checkpoint", default="except_last", choices=["always", "except_last", "never"])
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc malloc as it is (by default freed memory is kept for reuse, "
                             "see lab.host.keep_freed_cpu_memory)")
    args = parser.parse_args(argv)
    tuned = not args.default_malloc and keep_freed_cpu_memory()
    width, layers, batch = (64, 4, 128) if args.quick else (1024, 8, 2048)
    small = dict(width=32, layers=4, batch=16, chunks=4, repeats=100) if args.quick else SMALL
    rounds = 1 if args.quick else args.rounds
    widths = (16,) if args.quick else (16, 64)
    if args.host_time:  # this process and a stage process of its own: none of the pools below
        print(f"# the host's share of a task: {rounds} round(s); counts are the same on every host")
        print(format_table(host_time.rows(widths, rounds)))
        return
    if args.search:  # threads of this process: none of the pools below
        print(f"# a found schedule beside the built-in ones: {rounds} round(s), one step of each in turn")
        print(format_table(schedule_search.race(rounds=rounds)))
        return
    print(f"# engine benchmark, the near-empty model only: {rounds} round(s)" if args.overhead else
          f"# engine benchmark, the small model only: {rounds} round(s) (x3 for its short steps)" if args.small else
          f"# engine benchmark: {layers} x (Linear({width},{width}) + ReLU), batch {batch}, "
          f"checkpoint={args.checkpoint}, {rounds} round(s), median samples/s")
    print(f"# host: {platform.processor() or platform.machine()}, {cpu_cores()} cores; torch {torch.__version__}; "
          f"malloc {'keeps freed memory (all rows)' if tuned else 'glibc defaults'}")
    with ProcessPool(2, threads_per_stage=1, keep_freed_memory=tuned) as pool, \
            ProcessPool(2, threads_per_stage=1, keep_freed_memory=tuned, spin=0.0) as sleepy_pool, \
            ProcessPool(2, threads_per_stage=1, keep_freed_memory=tuned, lane="gloo") as gloo_pool, \
            ProcessPool(1, threads_per_stage=1, keep_freed_memory=tuned) as first_half, \
            ProcessPool(1, threads_per_stage=1, keep_freed_memory=tuned) as second_half:
        lanes, halves = {"shared memory": pool, "shared memory, waits asleep": sleepy_pool, "gloo": gloo_pool}, \
            (first_half, second_half)
        count, micros = (200, (1, 4, 16)) if args.quick else (2000, overhead.MICROS)
        if args.overhead:
            print(format_table(overhead_rows(pool, tuned, rounds, count, micros)))
        elif args.small:
            print(format_table(small_rows(small, rounds, lanes, halves)))
        else:
            table = run(width, layers, batch, rounds, args.checkpoint, small, lanes, halves)
            table += overhead_rows(pool, tuned, rounds, count, micros) + host_time.rows(widths, rounds)
            print(format_table(table))


if __name__ == "__main__":
    main()
