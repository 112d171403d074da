"""Schedules as pure task lists: orders, counts, dependencies and no deadlock, for every schedule."""
import pytest

from engine.schedule import (
    SCHEDULES,
    Task,
    checkpointed,
    forward_only,
    gpipe,
    interleaved,
    loop,
    one_f_one_b,
    owner,
    timeline,
    upstream,
    v_shape,
    zb_h1,
)


def ops(tasks):
    return " ".join(str(t) for t in tasks)


def test_fill_drain_order_per_stage():
    plan = gpipe(3, 4, "never")
    assert len(plan) == 3
    for k, tasks in enumerate(plan):
        assert ops(tasks) == "F0 F1 F2 F3 B3 B2 B1 B0" and {t.chunk for t in tasks} == {k}


def test_recompute_comes_right_before_its_backward():
    assert ops(gpipe(2, 3, "always")[0]) == "F0 F1 F2 R2 B2 R1 B1 R0 B0"
    assert ops(gpipe(2, 3, "except_last")[1]) == "F0 F1 F2 B2 R1 B1 R0 B0"


def test_checkpoint_modes():
    assert [checkpointed(m, 4, "always") for m in range(4)] == [True] * 4
    assert [checkpointed(m, 4, "except_last") for m in range(4)] == [True, True, True, False]
    assert [checkpointed(m, 4, "never") for m in range(4)] == [False] * 4
    with pytest.raises(ValueError, match="sometimes"):
        checkpointed(0, 4, "sometimes")


def test_recompute_chosen_per_stage():
    """One mode per stage: stage 0 (which holds the most micro-batches under 1F1B) recomputes, the
    others keep their activations; every builder follows it, and check holds a schedule to it."""
    from engine.schedule import check, recomputed
    for name, kind in SCHEDULES.items():
        micro = 4
        plan = kind(2, micro, ("always", "never"), kind.fewest_chunks)
        stage_of = {t.chunk: k for k, tasks in enumerate(plan) for t in tasks}
        assert {stage_of[c] for c, _ in recomputed(plan)} == {0}, name
        assert len(recomputed(plan)) == micro * kind.fewest_chunks, name
        check(plan, micro, ("always", "never"))
        with pytest.raises(ValueError, match=r"a recompute of micro-batch \d, which kept its activations under "
                                             "checkpoint='never' on stage 0"):
            check(plan, micro, ("never", "never"))
    assert checkpointed(3, 4, ("never", "except_last"), 1) is False and checkpointed(2, 4, ("never", "except_last"), 1)
    with pytest.raises(ValueError, match=r"names 3 modes for 2 stages: expected one mode, or one per stage"):
        gpipe(2, 4, ("always", "never", "never"))
    with pytest.raises(ValueError, match="'sometimes' is not a checkpoint mode"):
        gpipe(2, 4, ("always", "sometimes"))
    with pytest.raises(ValueError, match="'as_written' recomputes what a written schedule's R tasks say"):
        one_f_one_b(2, 4, "as_written")


def test_as_written_recomputes_what_the_schedule_says():
    """Under "as_written" the R tasks are the plan: any micro-batch may have one or not, and where
    one is written it still has to sit between its F and its B."""
    from engine.schedule import Schedule, check, recomputed
    some = Schedule([[Task("F", 0), Task("F", 1), Task("R", 0), Task("B", 0), Task("B", 1)],
                     [Task("F", 0, 1), Task("B", 0, 1), Task("F", 1, 1), Task("R", 1, 1), Task("B", 1, 1)]])
    check(some, 2, "as_written")
    assert recomputed(some) == {(0, 0), (1, 1)}
    late = Schedule([some[0], [Task("F", 0, 1), Task("B", 0, 1), Task("F", 1, 1), Task("B", 1, 1), Task("R", 1, 1)]])
    with pytest.raises(ValueError, match="stage 1 runs B1 before R1"):
        check(late, 2, "as_written")
    with pytest.raises(ValueError, match="stage 1 never runs R0: checkpoint='always' keeps only its input"):
        check(some, 2, ("as_written", "always"))


def test_forward_only():
    assert [ops(t) for t in forward_only(loop(2, 2), 2)] == ["F0 F1", "F0 F1"]
    assert [[(t.micro, t.chunk) for t in tasks] for tasks in forward_only(loop(2, 4), 2)] == \
        [[(0, 0), (0, 2), (1, 0), (1, 2)], [(0, 1), (0, 3), (1, 1), (1, 3)]]
    assert [[(t.micro, t.chunk) for t in tasks] for tasks in forward_only(v_shape(2, 4), 1)] == [[(0, 0), (0, 3)],
                                                                                              [(0, 1), (0, 2)]]


def test_upstream_dependencies_cross_chunks():
    assert upstream(Task("F", 2, 0), 3) is None
    assert upstream(Task("F", 2, 1), 3) == Task("F", 2, 0)
    assert upstream(Task("B", 0, 2), 3) is None
    assert upstream(Task("B", 0, 1), 3) == Task("B", 0, 2)
    assert upstream(Task("R", 0, 1), 3) is None and upstream(Task("W", 0, 1), 3) is None
    assert [owner(c, 4) for c in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]  # chunks dealt round-robin


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


def test_bad_sizes():
    with pytest.raises(ValueError):
        gpipe(0, 4)
    with pytest.raises(ValueError, match="needs M \\(micro-batches, chunks=\\) to be a multiple of K=4"
                                         ".*got M=6: use M=8"):
        interleaved(4, 6, "never", 2)
    with pytest.raises(ValueError, match="schedule='interleaved' places at least 2 chunks on a stage"):
        interleaved(4, 8, "never", 1)
    with pytest.raises(ValueError, match="schedule='1f1b' places 1 chunk on a stage; several chunks"):
        one_f_one_b(2, 4, "never", 2)


def test_one_f_one_b_orders_and_holds_few_micro_batches():
    plan = one_f_one_b(3, 5, "never")
    assert ops(plan[0]) == "F0 F1 F2 B0 F3 B1 F4 B2 B3 B4"
    assert ops(plan[2]) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4"
    assert [in_flight(tasks) for tasks in plan] == [3, 2, 1]  # K-k; GPipe would hold all 5
    times = timeline(plan, lambda stage, task: 1.0)
    assert max(end for stage in times for _, end in stage) == 2 * (3 + 5 - 1)
    assert ops(one_f_one_b(2, 3, "always")[1]) == "F0 R0 B0 F1 R1 B1 F2 R2 B2"


def in_flight(tasks):
    """Most micro-batches a stage holds at once: forward done, last backward task (B, or W) not yet."""
    done_with = "W" if any(t.op == "W" for t in tasks) else "B"
    held, peak = set(), 0
    for task in tasks:
        if task.op == "F":
            held.add((task.micro, task.chunk))
        elif task.op == done_with:
            held.discard((task.micro, task.chunk))
        peak = max(peak, len(held))
    return peak


def test_zb_h1_defers_w_to_the_drain_and_keeps_1f1b_memory_bound():
    plan = zb_h1(4, 8, "never")
    assert ops(plan[3]) == "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7"
    assert ops(plan[0]) == "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7"
    assert max(in_flight(tasks) for tasks in plan) == 4  # the bound of 1F1B's first stage: K
    assert ops(zb_h1(2, 2, "always")[0]) == "F0 F1 R0 B0 W0 R1 B1 W1"


def test_interleaved_follows_megatrons_groups_of_k():
    plan = interleaved(2, 4, "never", 2)
    assert [(t.op, t.micro, t.chunk) for t in plan[0][:6]] == [
        ("F", 0, 0), ("F", 1, 0), ("F", 0, 2), ("F", 1, 2), ("F", 2, 0), ("B", 0, 2)]
    assert {t.chunk for t in plan[1]} == {1, 3}  # stage 1 holds chunks 1 and 1 + K


def unit_bubble(plan, costs):
    times = timeline(plan, lambda stage, task: costs[task.op])
    makespan = max(end for stage in times for _, end in stage)
    busy = sum(end - start for stage in times for start, end in stage)
    return 1 - busy / (len(plan) * makespan), makespan


@pytest.mark.parametrize("stages,micro", [(2, 8), (4, 8), (4, 16), (8, 32)])
def test_unit_cost_bubbles_of_the_later_schedules(stages, micro):
    classic = unit_bubble(gpipe(stages, micro, "never"), {"F": 1, "B": 2})
    assert classic[0] == pytest.approx((stages - 1) / (micro + stages - 1))
    assert unit_bubble(one_f_one_b(stages, micro, "never"), {"F": 1, "B": 2}) == pytest.approx(classic)
    for v in (2, 4):  # chunks of 1/v the work: the fill and drain shrink v-fold
        bubble, _ = unit_bubble(interleaved(stages, micro, "never", v), {"F": 1 / v, "B": 2 / v})
        assert bubble == pytest.approx((stages - 1) / (v * micro + stages - 1))
    zero_bubble, _ = unit_bubble(zb_h1(stages, micro, "never"), {"F": 1, "B": 1, "W": 1})
    assert zero_bubble == pytest.approx((stages - 1) / (3 * micro + stages - 1))  # a third of 1F1B's idle time


def counts_and_dependencies(plan, stages, micro, virtual, checkpoint):
    """Every (micro-batch, chunk) gets exactly one F, R when checkpointed, one B and at most one W,
    on the stage that owns the chunk (round robin, or the schedule's own placement: ZB-V's V), in the
    order F < R < B < W; the order cannot deadlock."""
    chunks = stages * virtual
    placement = getattr(plan, "placement", None) or tuple(owner(c, stages) for c in range(chunks))
    seen = {}
    for k, tasks in enumerate(plan):
        for i, task in enumerate(tasks):
            assert placement[task.chunk] == k
            assert task not in seen, f"{task} twice"
            seen[task] = i
    has_w = any(t.op == "W" for t in seen)
    for m in range(micro):
        for c in range(chunks):
            order = [seen.get(Task(op, m, c)) for op in "FRBW"]
            assert order[0] is not None and order[2] is not None
            assert (order[1] is not None) == checkpointed(m, micro, checkpoint)
            assert (order[3] is not None) == has_w
            present = [i for i in order if i is not None]
            assert present == sorted(present)
    assert len(seen) == micro * chunks * (2 + has_w) \
        + sum(checkpointed(m, micro, checkpoint) for m in range(micro)) * chunks
    timeline(plan, lambda stage, task: 1.0)  # raises if some task waits for one that can never run


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedule_is_complete_ordered_and_deadlock_free(name):
    kind = SCHEDULES[name]
    for stages in range(1, 9):
        for micro in range(1, 33):
            if kind.micro_multiple_of_stages and micro % stages:
                continue
            for checkpoint in ("never", "except_last", "always"):
                for virtual in range(kind.fewest_chunks, (kind.most_chunks or kind.fewest_chunks + 1) + 1):
                    counts_and_dependencies(kind(stages, micro, checkpoint, virtual), stages, micro, virtual,
                                            checkpoint)


def test_schedules_are_pure_functions():
    for make in SCHEDULES.values():
        virtual = make.fewest_chunks
        assert make(4, 8, "always", virtual) == make(4, 8, "always", virtual)
