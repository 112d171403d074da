"""The steps the benchmark times, each a function of (x, y) returning its seconds, and how it
times them: round after round, every step once per round, so that a noisy host slows all alike."""
from __future__ import annotations

import os
import statistics
import threading
import time
from functools import partial
from typing import Callable

import torch
from torch import nn

from engine import GPipe
from lab import zoo
from lab.engine_time import overhead
from lab.processes.pool import ProcessPool
from lab.timelines import replay


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
    pool.build(zoo.build, dict(name="mlp", blocks=layers, width=width), chunks=chunks,
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




def replayed(traces: list, micro_batches: int) -> list[float]:
    """Each trace's makespan had its tasks, as long as they measured, started as soon as their stage
    and input allowed (lab.timelines.replay's ideal replay of the GPipe schedule): no message, gap or call end."""
    return [replay.ideal_replay([vars(e) for e in t.events], t.stages, micro_batches, "never").makespan for t in traces]


def halves_at_once(pools: tuple, small: dict) -> Callable:
    """The small model's ceiling on this host: its two halves trained at once, each as a K=1 pipe in
    a process of its own, with no data passing between them (the second half's input gradient
    included). Its step is the slower half's, as that process timed it."""
    width, layers, chunks = small["width"], small["layers"], small["chunks"]
    for pool in pools:
        pool.build(zoo.build, dict(name="mlp", blocks=layers // 2, width=width), chunks=chunks,
                   checkpoint="never", threads_per_stage=1, **overhead.LEAN)
    loss_fn = nn.functional.mse_loss

    def step(x, y):
        middle = torch.randn(x.shape[0], width, requires_grad=True)
        run_together([lambda: pools[0].step(x, middle.detach(), loss_fn), lambda: pools[1].step(middle, y, loss_fn)])
        return max(pool.seconds for pool in pools)
    return step


