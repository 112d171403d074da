"""The engine's own time, apart from compute: a model whose layers do almost nothing (8 x
Linear(16)+ReLU, batch 64, K=2), stepped at M = 1 to 64 by our engine (stage threads, stage
processes) and by torch.distributed.pipelining's ScheduleGPipe, side by side in interleaved rounds
(`peers.race`), with plain PyTorch on one core beside them.

Per call: what a step spends on its first stage before the model's first layer runs and after that
layer's last gradient (lab.engine_time.call_ends: hooks on the layer itself, the same for every contender), at
M=1, in alternating turns. Per micro-batch: a straight line through each contender's median step
times over M; its slope is what each micro-batch adds, and of it plain PyTorch's own per
micro-batch (one core, the whole model) over K is the layers' work a stage does; the rest is the
pipeline's, per micro-batch and stage: 2 tasks (F and B) and, between processes, 2 messages (one
out, one in). The line's intercept is not a call's cost: a pipeline whose stages overlap holds its
fill and drain there, one whose stages barely overlap does not. A message's one-way time is
measured apart (round trips of an activation between the two ranks). Our pipes run without the
activation ledger (`record_memory=False`), as the peers keep none; what the ledger costs is a row
of the engine benchmark's own table.
"""
from __future__ import annotations

import statistics
from typing import Callable, Optional, TypeVar

from torch import nn

from engine import GPipe
from lab.engine_time import peers
from lab.engine_time.call_ends import median_ends, median_pair, pool_ends

NEAR_EMPTY = peers.Workload(width=16, blocks=8, batch=64)
MICROS = (1, 2, 4, 8, 16, 32, 64)
STAGES = 2
T = TypeVar("T")
LEAN = {"record_memory": False}  # timed pipes keep no activation ledger (torch's and torchgpipe's keep none)


def fitted(points: dict[int, float]) -> tuple[float, float]:
    """(intercept, slope) of the line through {M: seconds}: the slope is the median of the pairwise
    slopes (Theil-Sen: one preempted step does not tilt it), the intercept the median residual."""
    pairs = sorted(points.items())
    slope = statistics.median((t2 - t1) / (m2 - m1) for i, (m1, t1) in enumerate(pairs) for m2, t2 in pairs[i + 1:])
    return statistics.median(t - slope * m for m, t in pairs), slope


def burst(micro: int) -> int:
    """Steps a contender takes in a row per round at M=`micro` (their median is the round's time):
    64 micro-batches' worth, at least 8 steps, so that neither one preemption nor the slow first
    steps of a process woken from its pause between turns decide a round."""
    return max(8, 64 // micro)


def sweep(work: peers.Workload = NEAR_EMPTY, micros=MICROS, rounds: int = 7,
          pipelining: Optional[peers.PipeliningProcesses] = None) -> dict[str, dict[int, float]]:
    """Each contender's median step seconds at every M, from one race (every contender's gradients
    are checked against the unpipelined model's on the way); `pipelining`: torch's ranks, started."""
    medians: dict[str, dict[int, float]] = {}
    for results in peers.race(work, list(micros), rounds, checkpoint="never", pipelining=pipelining, burst=burst,
                              engine_options=LEAN):
        for result in results:
            medians.setdefault(result.peer, {})[result.micro_batches] = result.seconds
    return medians


def parts(medians: dict[str, dict[int, float]]) -> dict[str, dict[str, float]]:
    """Per contender, in seconds: "call" (the intercept), "micro-batch" (the slope) and "pipeline per
    micro-batch" (the slope less the layers' work a stage does, plain PyTorch's slope over K)."""
    lines = {name: fitted(points) for name, points in medians.items()}
    layers = lines[peers.BASELINE][1] / STAGES
    return {name: {"call": call, "micro-batch": slope, "pipeline per micro-batch": slope - layers}
            for name, (call, slope) in lines.items() if name != peers.BASELINE}


def rows(medians: dict[str, dict[int, float]], message_us: dict[str, float], ends: dict[str, tuple[float, float]],
         micros=MICROS) -> list[tuple[str, str, str]]:
    """lab.bench's rows: per contender its microseconds per call (`ends`: before the first layer,
    after its last gradient), per micro-batch of pipeline work, per task and per message, what an
    M=1 call adds to the layers' work, then its step at M=1 and M=64 beside torch's."""
    split = parts(medians)
    torch_name = peers.PipeliningProcesses.name
    out = []
    for name, part in split.items():
        per_task = part["pipeline per micro-batch"] / 2
        message = message_us.get(name)
        before, after = ends[name]
        out.append((f"near-empty K=2, {name}: engine's own time",
                    f"{(before + after) * 1e6:.0f} us per call ({before * 1e6:.0f} before the first layer, "
                    f"{after * 1e6:.0f} after its last gradient), {part['pipeline per micro-batch'] * 1e6:.0f} us per "
                    f"micro-batch ({per_task * 1e6:.0f} per task, messages included)"
                    + (f"; a message {message:.0f} us one way" if message is not None else ""),
                    f"per call: the first stage's, at M=1 (the line's intercept, fill and drain included: "
                    f"{part['call'] * 1e6:.0f} us); per micro-batch: the slope of step time over M = "
                    f"{min(micros)}..{max(micros)}, less plain PyTorch's layers"
                    + ("; ours without the memory ledger" if name.startswith("gpipe-lab") else "")))
    first, plain = min(micros), medians[peers.BASELINE][min(micros)]
    out.append((f"near-empty K=2, M={first}: a call's own time",
                ", ".join(f"{name} {(medians[name][first] - plain) * 1e6:.0f} us" for name in split),
                "its step less plain PyTorch's on one core (the layers' work): what a call of one micro-batch "
                "adds, its fill and drain included"))
    for micro in (min(micros), max(micros)):
        torch_step = medians[torch_name][micro]
        ours = ", ".join(f"{name.removeprefix('gpipe-lab engine, ')} {torch_step / medians[name][micro]:.2f}x"
                         for name in split if name.startswith("gpipe-lab"))
        out.append((f"near-empty K=2, M={micro}: our step vs torch.distributed.pipelining's", ours,
                    ">= 1.0x: torch's step time over ours"))
    return out


def message_times(pool, torch_ranks: peers.PipeliningProcesses, work: peers.Workload = NEAR_EMPTY,
                  micro: int = 8, count: int = 2000, rounds: int = 5) -> dict[str, float]:
    """Microseconds one activation of M=`micro` takes one way between the two stages: our stage
    processes (`pool`, a ProcessPool of 2 built with the model) and torch's two ranks over gloo, in
    `rounds` alternating turns of `count` round trips (the median turn), after a short turn each
    (torch's ranks are then up: a turn of ours while they start would be timed beside their imports).
    Threads pass a reference: no message."""
    numel = work.batch // micro * work.width
    turns = alternating({"gpipe-lab engine, processes": lambda n: pool.ping(n, numel),
                         peers.PipeliningProcesses.name: lambda n: torch_ranks.ping(n, numel)}, count, rounds)
    return {name: statistics.median(seconds) * 1e6 for name, seconds in turns.items()}


def call_ends(pool, torch_ranks: peers.PipeliningProcesses, work: peers.Workload = NEAR_EMPTY,
              count: int = 400, turns: int = 5) -> dict[str, tuple[float, float]]:
    """Per contender, the seconds an M=1 step spends on its first stage before the model's first layer
    and after that layer's last gradient (lab.engine_time.call_ends), medians of `count` steps in each of `turns`
    alternating turns, then the median turn, after a short turn each. `pool`: a ProcessPool of 2."""
    x, y = work.data()
    loss = nn.functional.mse_loss
    pool.build(peers.RECIPE, work.recipe, balance=STAGES, chunks=1, checkpoint="never", threads_per_stage=1, **LEAN)
    pipe = GPipe(work.model(), STAGES, chunks=1, checkpoint="never", threads_per_stage=1, **LEAN)
    contenders = {
        "gpipe-lab engine, threads": lambda n: median_ends(pipe.partitions[0][0], lambda: pipe.step(x, y, loss), n,
                                                           before_each=lambda: pipe.zero_grad(set_to_none=True)),
        "gpipe-lab engine, processes": lambda n: pool_ends(pool, x, y, loss, n),
        peers.PipeliningProcesses.name: lambda n: torch_ranks.ends(1, n)}
    if peers.torchgpipe_available():
        peer = peers.torchgpipe_peer(work, 1, "never")
        contenders["torchgpipe"] = lambda n: peers.with_threads(
            1, lambda: median_ends(peer.model[0], peer.train, n,
                                   before_each=lambda: peer.model.zero_grad(set_to_none=True)))
    try:
        timed = alternating(contenders, count, turns)
    finally:
        pipe.close()
    return {name: median_pair(pairs) for name, pairs in timed.items()}


def alternating(contenders: dict[str, Callable[[int], T]], count: int, turns: int) -> dict[str, list[T]]:
    """Each contender's results of `turns` turns of `count` (each contender called with `count`, in turn,
    round after round), after a short turn each: a process's first turn, or one beside another's
    start-up (torch's ranks importing), is not timed."""
    for run in contenders.values():
        run(max(1, count // 10))
    results: dict[str, list[T]] = {name: [] for name in contenders}
    for _ in range(turns):
        for name, run in contenders.items():
            results[name].append(run(count))
    return results


def measure(pool, tuned_malloc: bool, rounds: int, count: int = 2000, micros=MICROS) -> list[tuple[str, str, str]]:
    """The near-empty model's rows for lab.bench (`pool`: a ProcessPool of 2 stages)."""
    pool.build(peers.RECIPE, NEAR_EMPTY.recipe, chunks=8, checkpoint="never")
    torch_ranks = peers.PipeliningProcesses(NEAR_EMPTY, tuned_malloc)
    try:
        messages = message_times(pool, torch_ranks, count=count)
        ends = call_ends(pool, torch_ranks, count=max(20, count // 5))
    except BaseException:
        torch_ranks.close()
        raise
    medians = sweep(micros=micros, rounds=rounds, pipelining=torch_ranks)  # the race closes them
    return rows(medians, messages, ends, micros)
