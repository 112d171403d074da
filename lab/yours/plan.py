"""Which K, M, recompute and schedule for your model: each layer's measured time and size, the cuts
by time, by size and by the paper's least variance, and for each K the plan that fits a memory budget
and is fastest when this model's measured task costs are replayed on K devices."""
from __future__ import annotations

import copy
import itertools
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from engine.balance import layer_sizes, solve
from engine.partition import split
from engine.schedule import SCHEDULES, Schedule, timeline
from lab.runs.experiments import layer_chunks
from lab.runs.schedule_memory import peaks
from lab.yours.memory import edges_of, update_bytes
from lab.yours.model import Yours

SCHEDULES_TRIED = ("gpipe", "1f1b")
RECOMPUTE_TRIED = ("never", "except_last")


def layer_costs(yours: Yours, micro: int, repeat: int = 3) -> list[tuple[float, float]]:
    """Each layer's (forward, backward) seconds on one micro-batch of M, each a copy timed alone on
    its own input (the one before's output) and a fixed gradient of its output, on one thread: the
    shortest of `repeat` runs after a warm-up (noise on a shared host only ever adds time)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    costs, x = [], yours.inputs.chunk(micro)[0]
    try:
        with torch.random.fork_rng(devices=[]):
            for layer in copy.deepcopy(yours.model):
                given = x.detach().requires_grad_(x.is_floating_point())
                best = [float("inf"), float("inf")]
                for run in range(repeat + 1):
                    start = time.perf_counter()
                    out = layer(given)
                    middle = time.perf_counter()
                    out.backward(torch.ones_like(out))
                    end = time.perf_counter()
                    if run:
                        best = [min(best[0], middle - start), min(best[1], end - middle)]
                costs.append((best[0], best[1]))
                x = out.detach()
    finally:
        torch.set_num_threads(threads)
    return costs


def least_variance(costs: Sequence[float], stages: int) -> list[int]:
    """The cut the paper's partitioner aims for (§2.2): consecutive stages whose costs vary least,
    i.e. the least sum of squared stage costs (their mean is fixed), found exactly by dynamic programming."""
    n = len(costs)
    prefix = list(itertools.accumulate(costs, initial=0.0))
    best = {(0, 0): (0.0, [])}
    for k in range(1, stages + 1):
        for end in range(k, n - stages + k + 1):
            options = [(best[(k - 1, start)][0] + (prefix[end] - prefix[start]) ** 2, best[(k - 1, start)][1] +
                        [end - start]) for start in range(k - 1, end) if (k - 1, start) in best]
            best[(k, end)] = min(options)
    return best[(stages, n)][1]


@dataclass
class Balance:
    """Each layer's time and size, and three cuts for each K."""

    times: list[float]                  # forward + backward seconds on one micro-batch
    sizes: list[float]                  # bytes: saved activations plus twice the parameters
    cuts: dict                          # K -> {"by time": [...], "by size": [...], "least variance": [...]}


def measured_costs(yours: Yours, micro: Sequence[int]) -> dict[int, list[tuple[float, float]]]:
    """`layer_costs` at each M the batch allows, and at M=1 (one device on the whole batch), once:
    the plans and the balance read the same measurement."""
    batch = yours.inputs.shape[0]
    return {m: layer_costs(yours, m) for m in sorted({m for m in micro if m <= batch} | {1})}


def balance(yours: Yours, stages: Sequence[int], micro: int, costs: list[tuple[float, float]]) -> Balance:
    """The layers' times (`costs`, measured at this M) and sizes, and each K's cut by time (the
    least slowest stage), by size and by the paper's least variance of the stage times."""
    times = [f + b for f, b in costs]
    sizes = layer_sizes(yours.model, yours.inputs.chunk(micro)[0])
    cuts = {k: {"by time": solve(times, k), "by size": solve(sizes, k), "least variance": least_variance(times, k)}
            for k in stages if k <= len(times)}
    return Balance(times, sizes, cuts)


@dataclass
class Plan:
    """One (K, M, recompute, schedule): its predicted bytes on the most loaded stage and its step
    replayed on K devices from this model's measured task costs."""

    stages: int
    micro_batches: int
    checkpoint: str
    schedule: str
    cut: list[int]
    peak_bytes: int          # weights, gradients, Adam's moments and predicted activations, most loaded stage
    step_seconds: float
    bubble: float
    speedup: float = 0.0     # over one device running the whole batch (the replay of K=1, M=1)

    @property
    def label(self) -> str:
        return f"K={self.stages}, M={self.micro_batches}, {self.schedule}, recompute {self.checkpoint}"


def replayed(costs: list[tuple[float, float]], cut: list[int], micro: int, checkpoint: str,
             schedule: str) -> tuple[float, float]:
    """(makespan, bubble) of the schedule laid on K devices, each task as long as its layers measured."""
    forward = [sum(f for f, _ in costs[a:b]) for a, b in edges_of(cut)]
    backward = [sum(b for _, b in costs[a:c]) for a, c in edges_of(cut)]
    tasks = Schedule(SCHEDULES[schedule](len(cut), micro, checkpoint, 1))
    spans = timeline(tasks, lambda k, task: forward[k] if task.op in "FR" else backward[k])
    makespan = max(end for line in spans for _, end in line)
    busy = sum(end - start for line in spans for start, end in line)
    return makespan, 1 - busy / (len(cut) * makespan)


def predicted_peaks(yours: Yours, cut: list[int], micro: int, checkpoint: str, schedule: str,
                    chunks: list) -> list[int]:
    """Each stage's bytes at its high-water mark: weights, gradients and Adam's two moments (4 x its
    parameters' bytes), and the larger of the activation peak its task lists hold on the chunks'
    measured storages (`chunks`: lab.runs.experiments.layer_chunks of this cut and M) and Adam's
    update temporaries (lab.yours.memory.update_bytes)."""
    tasks = Schedule(SCHEDULES[schedule](len(cut), micro, checkpoint, 1))
    activations = peaks(tasks, chunks, yours.inputs.untyped_storage().nbytes())
    parts = [yours.model[a:b] for a, b in edges_of(cut)]
    states = [4 * sum(p.numel() * p.element_size() for p in part.parameters()) for part in parts]
    return [s + max(a, update_bytes(part)) for a, s, part in zip(activations, states, parts)]


def plans(yours: Yours, stages: Sequence[int], micro: Sequence[int],
          costs: dict[int, list[tuple[float, float]]]) -> list[Plan]:
    """Every (K, M, recompute, schedule) tried on the `measured_costs`, cut by time, predicted and
    replayed."""
    single = replayed(costs[1], [len(yours.model)], 1, "never", "gpipe")[0]
    found = []
    for k, m in itertools.product(stages, [m for m in micro if m in costs]):
        if k > len(yours.model):
            continue
        cut = solve([f + b for f, b in costs[m]], k)
        if not cuttable(yours, cut):
            continue
        chunks = layer_chunks(yours.model, cut, yours.inputs.chunk(m)[0])  # once per cut and M
        for checkpoint, schedule in itertools.product(RECOMPUTE_TRIED, SCHEDULES_TRIED):
            if schedule == "1f1b" and (m < k or k == 1):  # K=1: 1F1B is GPipe
                continue
            step, bubble = replayed(costs[m], cut, m, checkpoint, schedule)
            peak = max(predicted_peaks(yours, cut, m, checkpoint, schedule, chunks))
            found.append(Plan(k, m, checkpoint, schedule, cut, peak, step, bubble, single / step))
    return found


def cuttable(yours: Yours, cut: list[int]) -> bool:
    """Whether the engine can cut the model so (no parameter shared by two stages)."""
    try:
        split(yours.model, cut)
    except ValueError:
        return False
    return True


def best_fitting(found: list[Plan], budget: Optional[int]) -> dict[int, Plan]:
    """For each K, the fastest plan whose most loaded stage fits `budget` bytes (any, without one)."""
    best: dict[int, Plan] = {}
    for plan in found:
        if budget is not None and plan.peak_bytes > budget:
            continue
        if plan.stages not in best or plan.step_seconds < best[plan.stages].step_seconds:
            best[plan.stages] = plan
    return best
