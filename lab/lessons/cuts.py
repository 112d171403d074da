"""The best-cut exercise: a learner's partitioner judged on costs whose cuts tell the rules apart
(the paper's least variance, the least maximum, a greedy fill)."""
from __future__ import annotations

import functools
import itertools
import math
import random
from collections.abc import Iterable
from typing import Callable, Sequence

from engine.balance import solve
from lab.lessons.feedback import SAYS, Feedback, exercise
from lab.lessons.formulas import as_number, as_whole
from lab.lessons.sandbox import called
from lab.lessons.tasks import listed

# Short cost lists on which a common wrong cut loses to the min-max cut: the cut of least variance
# on the first three, the total/K greedy cut on the last three (found by a search over random
# lists; tests/lab/lessons/test_exercises.py checks that each still separates them).
SEPARATING_CUTS = (([6, 5, 9, 3], 3), ([3, 5, 7, 2, 5, 2], 4), ([5, 2, 7, 3, 9, 6], 3),
                   ([5, 4, 2, 6], 3), ([5, 8, 9, 7, 1], 3), ([1, 3, 7, 7, 9], 2))


def _stage_costs(costs: Sequence[float], counts: Sequence[int]) -> list[float]:
    edges = [sum(counts[:k]) for k in range(len(counts) + 1)]
    return [sum(costs[a:b]) for a, b in zip(edges, edges[1:])]


def _every_cut(layers: int, stages: int) -> Iterable[list[int]]:
    for inner in itertools.combinations(range(1, layers), stages - 1):
        edges = [0, *inner, layers]
        yield [b - a for a, b in zip(edges, edges[1:])]


def greedy_cut(costs: Sequence[float], stages: int) -> list[int]:
    """A common wrong answer: close each stage as soon as its cost reaches total/K (keeping a
    layer for every stage still to come)."""
    target, counts, running, cost = sum(costs) / stages, [], 0, 0.0
    for i, layer in enumerate(costs):
        running, cost = running + 1, cost + layer
        layers_left, stages_left = len(costs) - i - 1, stages - len(counts) - 1
        if stages_left and (layers_left == stages_left or (cost >= target and layers_left > stages_left)):
            counts.append(running)
            running, cost = 0, 0.0
    return counts + [running]


def greedy_cuts(costs: Sequence[float], stages: int) -> list[list[int]]:
    """The greedy walks a learner writes: close a stage once it reaches total/K, or just before it
    would pass it; from the first layer, or from the last."""
    target = sum(costs) / stages

    def before(costs: Sequence[float]) -> list[int]:
        counts, running, cost = [], 0, 0.0
        for i, layer in enumerate(costs):
            layers_left, stages_left = len(costs) - i, stages - len(counts) - 1
            if running and stages_left and (layers_left == stages_left or cost + layer > target):
                counts.append(running)
                running, cost = 0, 0.0
            running, cost = running + 1, cost + layer
        return counts + [running]
    return [greedy_cut(costs, stages), before(costs), greedy_cut(costs[::-1], stages)[::-1], before(costs[::-1])[::-1]]


def variance_cut(costs: Sequence[float], stages: int) -> list[int]:
    """Another wrong answer: the cut whose stage costs vary least around their mean (the same sum
    for every cut, so least variance is the least sum of squares)."""
    return min(_every_cut(len(costs), stages), key=lambda counts: sum(c * c for c in _stage_costs(costs, counts)))


@functools.lru_cache(maxsize=1)
def cut_battery() -> tuple[tuple[tuple[float, ...], int, float], ...]:
    """(costs, K, the optimal costliest stage) for the lists every cut is judged on: the separating
    lists above, then 400 seeded random lists (4 to 12 layers, K from 2 to 6, whole costs and
    measured-looking ones), shortest first so that the list a wrong cut is shown is small."""
    rng = random.Random(35)
    lists = []
    for i in range(400):
        layers = rng.randint(4, 12)
        stages = rng.randint(2, min(6, layers))
        costs = ([rng.randint(1, 20) for _ in range(layers)] if i % 4 else
                 [round(rng.uniform(0.05, 3.0), 2) for _ in range(layers)])
        lists.append((tuple(costs), stages))
    lists.sort(key=lambda item: (len(item[0]), item[1]))
    return tuple((tuple(costs), stages, max(_stage_costs(costs, solve(list(costs), stages))))
                 for costs, stages in [*((tuple(c), k) for c, k in SEPARATING_CUTS), *lists])


def _cut_counts(value, costs: Sequence[float], stages: int) -> list[int]:
    """The learner's cut as K whole counts; Feedback on anything else, naming what it looks like."""
    where = f"costs {list(costs)}, K={stages}"
    if as_number(value) is not None:
        raise Feedback(f"{where}: got the number {value!r}: {SAYS['cut shape']}")
    got = listed(value, SAYS["cut shape"])
    numbers_ = [as_number(v) for v in got]
    if None in numbers_:
        raise Feedback(f"{where}: got {got!r:.80}: {SAYS['cut shape']}")
    counts, layers = [as_whole(v) for v in got], len(costs)
    if len(got) == stages and math.isclose(sum(numbers_), sum(costs), rel_tol=1e-6) and sum(numbers_) != layers:
        raise Feedback(f"{where}: got {numbers_}: {SAYS['stage costs']}")
    if None in counts:
        raise Feedback(f"{where}: got {got!r:.80}: {SAYS['cut shape']}")
    increasing = all(a < b for a, b in zip(counts, counts[1:]))
    if increasing and ((len(counts) == stages + 1 and counts[0] == 0 and counts[-1] == layers) or
                       (len(counts) in (stages - 1, stages) and counts[-1] <= layers and sum(counts) != layers)):
        raise Feedback(f"{where}: got {counts}: {SAYS['cut edges']}")
    if len(counts) != stages or sum(counts) != layers or min(counts) < 1:
        raise Feedback(f"{where}: got {counts}: {SAYS['cut counts']} ({stages} counts summing to {layers})")
    return counts


@exercise
def check_best_cut(fn: Callable[[list, int], list]) -> str:
    """fn(costs, K): layers per stage, consecutive, making the costliest stage as cheap as possible."""
    battery = cut_battery()
    for costs, stages, best in battery:
        got = _cut_counts(called(fn, list(costs), stages), costs, stages)
        worst = max(_stage_costs(costs, got))
        if worst > best * (1 + 1e-9) + 1e-12:
            raise Feedback(f"costs {list(costs)}, K={stages}: your cut {got} has stages costing "
                           f"{[round(c, 4) for c in _stage_costs(costs, got)]}, the costliest {worst:g}; "
                           f"{solve(list(costs), stages)} gets the costliest down to {best:g}: {SAYS[_cut_family(fn)]}")
    return (f"✓ on {len(battery)} cost lists (4 to 12 layers, K from 2 to 6) your cut's costliest stage is the "
            f"cheapest possible, as balance_by_time's solver finds it")


def _cut_family(fn: Callable) -> str:
    """The family of wrong cuts the learner's cut behaves as on every list of SEPARATING_CUTS and
    the battery's first lists (a family is named only when the cut behaves as that family does, not
    on one list), else "not the min-max"."""
    lists = [*SEPARATING_CUTS, *((list(c), k) for c, k, _ in cut_battery()[:20])]
    try:
        cuts = [(_cut_counts(called(fn, list(c), k), c, k), c, k) for c, k in lists]
    except Feedback:
        return "not the min-max"
    families = (("variance cut", _as(variance_cut)), ("greedy cut", lambda cut, c, k: cut in greedy_cuts(c, k)),
                ("equal counts", _even), ("rounded costs", _rounded))
    return next((name for name, alike in families if all(alike(*cut) for cut in cuts)), "not the min-max")


def _as(rule: Callable[[Sequence[float], int], list[int]]) -> Callable[[list[int], Sequence[float], int], bool]:
    """The family of cuts that `rule` makes."""
    return lambda cut, costs, stages: cut == rule(costs, stages)


def _rounded(cut: list[int], costs: Sequence[float], stages: int) -> bool:
    """The family of cuts made for the costs rounded to whole numbers."""
    whole = [round(c) for c in costs]
    return max(_stage_costs(whole, cut)) <= max(_stage_costs(whole, solve(whole, stages)))


def _even(cut: list[int], costs: Sequence[float], stages: int) -> bool:
    """The family of cuts by layer count alone: stages of as many layers as can be, the remainder
    spread over some of them or left to the first or the last."""
    base = len(costs) // stages
    rest = len(costs) - (stages - 1) * base
    return max(cut) - min(cut) <= 1 or cut in ([rest] + [base] * (stages - 1), [base] * (stages - 1) + [rest])


