import pytest

from engine.schedule import Task, checkpointed, forward_only, gpipe, timeline, upstream


def ops(tasks):
    return " ".join(str(t) for t in tasks)


def test_fill_drain_order_per_stage():
    plan = gpipe(3, 4, "never")
    assert len(plan) == 3
    for tasks in plan:
        assert ops(tasks) == "F0 F1 F2 F3 B3 B2 B1 B0"


def test_recompute_comes_right_before_its_backward():
    assert ops(gpipe(2, 3, "always")[0]) == "F0 F1 F2 R2 B2 R1 B1 R0 B0"
    assert ops(gpipe(2, 3, "except_last")[1]) == "F0 F1 F2 B2 R1 B1 R0 B0"


def test_checkpoint_modes():
    assert [checkpointed(m, 4, "always") for m in range(4)] == [True] * 4
    assert [checkpointed(m, 4, "except_last") for m in range(4)] == [True, True, True, False]
    assert [checkpointed(m, 4, "never") for m in range(4)] == [False] * 4
    with pytest.raises(ValueError, match="sometimes"):
        checkpointed(0, 4, "sometimes")


def test_forward_only():
    assert [ops(t) for t in forward_only(2, 2)] == ["F0 F1", "F0 F1"]


def test_upstream_dependencies():
    assert upstream(0, Task("F", 2), 3) is None
    assert upstream(1, Task("F", 2), 3) == (0, Task("F", 2))
    assert upstream(2, Task("B", 0), 3) is None
    assert upstream(1, Task("B", 0), 3) == (2, Task("B", 0))
    assert upstream(1, Task("R", 0), 3) is None


@pytest.mark.parametrize("stages,micro", [(1, 1), (2, 1), (4, 1), (2, 8), (4, 8), (8, 32)])
def test_unit_costs_take_k_plus_m_minus_1_cycles_each_way(stages, micro):
    plan = gpipe(stages, micro, "never")
    times = timeline(plan, lambda stage, task: 1.0)
    forward_end = max(end for k in range(stages) for (_, end), t in zip(times[k], plan[k]) if t.op == "F")
    total = max(end for k in range(stages) for _, end in times[k])
    assert forward_end == stages + micro - 1
    assert total == 2 * (stages + micro - 1)
    busy = sum(end - start for k in range(stages) for start, end in times[k])
    assert 1 - busy / (stages * total) == pytest.approx((stages - 1) / (micro + stages - 1))


def test_timeline_respects_dependencies():
    plan = gpipe(3, 2, "always")
    times = timeline(plan, lambda stage, task: {"F": 1.0, "R": 1.0, "B": 2.0}[task.op])
    where = {(k, t): times[k][i] for k, tasks in enumerate(plan) for i, t in enumerate(tasks)}
    for (k, task), (start, _) in where.items():
        dep = upstream(k, task, 3)
        if dep is not None:
            assert start >= where[dep][1]


def test_bad_sizes():
    with pytest.raises(ValueError):
        gpipe(0, 4)


def test_one_f_one_b_orders_and_holds_few_micro_batches():
    from engine.schedule import one_f_one_b
    plan = one_f_one_b(3, 5, "never")
    assert ops(plan[0]) == "F0 F1 F2 B0 F3 B1 F4 B2 B3 B4"
    assert ops(plan[2]) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4"
    for k, tasks in enumerate(plan):
        in_flight, peak = 0, 0
        for task in tasks:
            in_flight += 1 if task.op == "F" else -1 if task.op == "B" else 0
            peak = max(peak, in_flight)
        assert peak == min(3 - k, 5)  # GPipe would hold all 5
    times = timeline(plan, lambda stage, task: 1.0)  # raises if the order could deadlock
    assert max(end for stage in times for _, end in stage) == 2 * (3 + 5 - 1)
    assert ops(one_f_one_b(2, 3, "always")[1]) == "F0 R0 B0 F1 R1 B1 F2 R2 B2"
