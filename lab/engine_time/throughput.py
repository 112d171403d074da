"""The benchmark's rows of throughputs and ratios: the full-size model, the small model over every
lane, and the near-empty model's call (lab.engine_time.overhead)."""
from __future__ import annotations

import statistics

import torch

from engine.device import cpu_cores
from lab.engine_time import overhead
from lab.engine_time.messages import (
    call_parts,
    cold_read,
    cross_core_copy,
    gap_parts,
    per_message,
    ping_pong,
)
from lab.engine_time.steps import (
    bare_matmuls,
    engine_step,
    halves_at_once,
    independent_halves,
    measure,
    plain_step,
    pool_starts,
    process_step,
    ratio,
    replayed,
)
from lab.processes.pool import ProcessPool
from lab.zoo import mlp

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
    model = mlp.build(layers, width)
    dropout_model = mlp.build(layers, width, dropout=0.1)
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
         "forked from the warm forker (lab/processes/forker.py) vs fresh interpreters (GPIPE_WARM_FORK=0)"),
    ]




def small_rows(small: dict, rounds: int, lanes: dict[str, ProcessPool],
               half_pools: tuple) -> list[tuple[str, str, str]]:
    """Measure the small model (measure_small) and return its rows of the table."""
    times, traces = measure_small(lanes, small, rounds, half_pools)
    shape = (f"{small['layers']} x Linear({small['width']})+ReLU, batch {small['batch']}, M={small['chunks']}, "
             f"no recompute")
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
         "each step's own traced tasks laid on the schedule (lab.timelines.replay): the fill and drain stay, "
         "the engine's messages, gaps and call ends go"),
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
         f"copy out)", cold_read(small['width'], small['batch'] // small['chunks'], small['layers'] // 2,
                                 small['repeats']),
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
    model = mlp.build(layers, width)
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




def overhead_rows(pool: ProcessPool, tuned: bool, rounds: int, count: int, micros) -> list[tuple[str, str, str]]:
    """The near-empty model's rows (lab/engine_time/overhead.py) at M in `micros`, then where its M=1 call's time
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


