"""The schedule search (lab.schedules.search): exact against every order tried one by one, no slower
than 1F1B and ZB-H1 under a cap they meet, fitting under one they pass, and run exactly."""
import itertools
import math
import random

import pytest
import torch
from small_models import grads, mlp
from torch import nn

from engine import GPipe
from engine.schedule import SCHEDULES, Schedule, Task, check
from lab.runs.exactness import unpipelined_gradients
from lab.runs.schedule_memory import ChunkBytes, peaks
from lab.schedules import search as schedule_search
from lab.schedules.search import Costs, makespan, search, unit_costs

CHUNKS = [ChunkBytes(100, (("0", 200), ("1", 300)), frozenset({"0"}))] * 4   # 500 B held per micro-batch, 200 for W


def every_order(micro: int, stage: int, split: bool) -> list[list[Task]]:
    """Every task list of one stage: its F's, B's (and W's) each in micro-batch order, each after its own."""
    found = []

    def extend(f, b, w, tasks):
        if f == b == micro and (w == micro or not split):
            found.append(tasks)
        if f < micro:
            extend(f + 1, b, w, tasks + [Task("F", f, stage)])
        if b < f:
            extend(f, b + 1, w, tasks + [Task("B", b, stage)])
        if split and w < b:
            extend(f, b, w + 1, tasks + [Task("W", w, stage)])
    extend(0, 0, 0, [])
    return found


def fastest_by_trying_all(stages, micro, costs, cap):
    """The fastest legal schedule under the cap, every combination of orders timed."""
    best = math.inf
    for split in (True, False):
        for lists in itertools.product(*(every_order(micro, k, split) for k in range(stages))):
            schedule = Schedule([list(tasks) for tasks in lists])
            try:
                check(schedule, micro, "never")
            except ValueError:
                continue  # it deadlocks
            if cap is None or max(peaks(schedule, CHUNKS[:stages], 50)) <= cap:
                best = min(best, makespan(schedule, costs))
    return best


def random_costs(rng, stages):
    pick = lambda choices: tuple(rng.choice(choices) for _ in range(stages))
    return Costs(pick([1, 2, 3]), pick([1, 2, 3]), pick([0.5, 1, 2]), rng.choice([0, 0.5, 1.5]),
                 rng.choice([None, pick([1, 2, 3, 4])]))


@pytest.mark.parametrize("seed", range(6))
def test_the_search_is_exact_where_every_order_can_be_tried(seed):
    """Unequal stages, a message latency, a whole backward cheaper or dearer than B + W, caps: the
    search's time is the least of all orders', also when its depth-first part starts from nothing
    (not from the heuristic's answer)."""
    rng = random.Random(seed)
    stages, micro = rng.choice([(2, 2), (2, 3), (3, 2)])
    costs, cap = random_costs(rng, stages), rng.choice([None, 700, 1000, 1500])
    best = fastest_by_trying_all(stages, micro, costs, cap)
    found = search(stages, micro, costs, CHUNKS[:stages] if cap else None, 50, cap)
    assert found.exact and found.makespan == pytest.approx(best), (costs, cap, found.how)
    check(found.schedule, micro, "never")
    sizes = schedule_search._Bytes(CHUNKS[:stages], 50) if cap else None
    caps = [cap] * stages if cap else None
    alone = min(schedule_search._Exact(stages, micro, costs, sizes, caps, (math.inf, None), 10 ** 6, split).bound
                for split in (True, False))
    assert alone == pytest.approx(best)


@pytest.mark.parametrize("stages,micro", [(4, 8), (3, 6)])
def test_under_a_cap_1f1b_meets_no_slower_than_1f1b_and_zb_h1_and_under_a_tighter_one_it_still_fits(stages, micro):
    costs = Costs((1.0, 2.0, 1.5, 1.0)[:stages], (1.0, 2.5, 1.0, 2.0)[:stages], (1.0, 1.0, 2.0, 0.5)[:stages], 0.2)
    named = {name: Schedule(SCHEDULES[name](stages, micro, "never")) for name in ("1f1b", "zb-h1")}
    cap = max(peaks(named["1f1b"], CHUNKS[:stages], 50))
    found = search(stages, micro, costs, CHUNKS[:stages], 50, cap, exact_limit=5000)
    assert max(found.peaks) <= cap and found.makespan <= min(makespan(s, costs) for s in named.values()) + 1e-9
    tight = cap - 600   # 1F1B's stage 0 holds K micro-batches of 500 B: about one fewer
    found = search(stages, micro, costs, CHUNKS[:stages], 50, tight, exact_limit=5000)
    assert max(found.peaks) <= tight < max(peaks(named["1f1b"], CHUNKS[:stages], 50))
    check(found.schedule, micro, "never")
    with pytest.raises(ValueError, match=r"stage 0 holds 550 bytes \(0.5 KiB\) with one micro-batch, "
                                         r"over its cap of 500 bytes \(0.5 KiB\)"):
        search(stages, micro, costs, CHUNKS[:stages], 50, 500)


def test_beyond_the_exact_limit_the_heuristics_answer_is_said_to_be_one():
    found = search(8, 16, unit_costs(8), exact_limit=1000)
    assert not found.exact and "the exact search stopped at 1000 steps, before it covered every order" in found.how
    assert found.makespan <= makespan(Schedule(SCHEDULES["zb-h1"](8, 16, "never")), unit_costs(8))


def test_costs_read_from_a_runs_events_and_refused_when_they_lack_w():
    events = [dict(stage=k, op=op, start=0.0, end=t) for k in (0, 1) for op, t in (("F", 1.0), ("B", 2.0), ("W", 0.5))]
    whole = [dict(stage=k, op=op, start=0.0, end=t) for k in (0, 1) for op, t in (("F", 1.0), ("B", 2.2))]
    costs = schedule_search.measured_costs(events, 0.1, whole)
    assert costs == Costs((1.0, 1.0), (2.0, 2.0), (0.5, 0.5), 0.1, (2.2, 2.2))
    assert costs.duration(0, Task("B", 0), split=False) == 2.2
    with pytest.raises(ValueError, match="no W on stage 0, W on stage 1 among the events"):
        schedule_search.measured_costs(whole)
    with pytest.raises(ValueError, match="expected F, B and W times for every stage"):
        Costs((1.0,), (1.0, 1.0), (1.0,))


def test_a_found_schedule_runs_with_the_gradients_of_one_device():
    """Written for unequal stages (split or whole backwards), it runs on threads within 1e-10 of the
    unpipelined step in float64."""
    torch.manual_seed(1)
    x, y = torch.randn(24, 16, dtype=torch.float64), torch.randint(0, 3, (24,))
    reference = unpipelined_gradients(mlp(dtype=torch.float64), x, y, nn.CrossEntropyLoss())
    for costs in (Costs((1.0, 3.0), (1.0, 3.0), (1.0, 1.0)),
                  Costs((1.0, 1.0), (1.0, 1.0), (1.0, 1.0), whole=(1.2, 1.2))):
        found = search(2, 4, costs)
        model = mlp(dtype=torch.float64)
        pipe = GPipe(model, 2, chunks=4, checkpoint="never", schedule=found.schedule, threads_per_stage=1)
        pipe.step(x, y, nn.CrossEntropyLoss())
        pipe.close()
        assert max((a - b).abs().max().item() for a, b in zip(grads(model), reference)) < 1e-10
