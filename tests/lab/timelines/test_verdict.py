"""lab.timelines.verdict names a winner only when every round agrees and the spreads separate; lab.runs.counts
counts what a task does; the replays that claims are judged on (mean costs, counts as costs) hold
their laws whatever the costs."""
import random

import pytest

from lab import theory
from lab.config import RunConfig
from lab.runs import counts
from lab.runs.experiments import run, side_by_side
from lab.timelines import replay, verdict


def test_a_winner_only_when_it_wins_every_round():
    told = verdict.compare({"a": [1.0, 1.1, 0.9], "b": [1.2, 1.3, 1.15]}, "step", "s", 1, 2)
    assert told.winner == "a" and told.told_apart() and "every one of 3 rounds" in told.line
    assert told.spreads["b"] == (1.2, 1.15, 1.3) and "b 1.20 s (1.15 to 1.30)" in told.line


def test_every_round_won_but_ranges_that_overlap_and_the_host_cannot_tell():
    """Five paired rounds all won happen once in 16 between equals: the spreads must separate too."""
    told = verdict.compare({"a": [1.0, 1.2, 0.9, 1.1, 1.0], "b": [1.1, 1.3, 1.0, 1.2, 1.05]})
    assert told.winner is None and "cannot tell them apart" in told.line, told.line


def test_a_plainly_slowest_of_three_is_said_even_where_no_fastest_can_be():
    """Two alternatives whose rounds overlap and a third slower in every round than both: the verdict
    names no winner, but does not say the host cannot tell the slow one from the others."""
    told = verdict.compare({"found": [150.0, 148.0, 155.0], "gpipe": [102.0, 104.0, 99.0],
                            "1f1b": [101.0, 103.0, 105.0]})
    assert told.winner is None and not told.told_apart()
    assert told.line.startswith("this host cannot name the fastest, but found had the highest step in every one of "
                                "3 rounds"), told.line


def test_one_lost_round_and_the_host_cannot_tell():
    told = verdict.compare({"a": [1.0, 1.4, 0.9, 1.0], "b": [1.2, 1.3, 1.0, 1.1]})
    assert told.winner is None and "cannot tell them apart" in told.line and "4 round(s)" in told.line


def test_two_rounds_are_too_few_to_call():
    told = verdict.compare({"a": [1.0, 1.0], "b": [2.0, 2.0]})
    assert told.winner is None and "too few to call" in told.line


@pytest.mark.parametrize("rounds", [{"a": [1.0]}, {"a": [1.0, 2.0], "b": [1.0]}, {"a": [], "b": []}])
def test_rounds_that_cannot_be_compared_are_refused(rounds):
    with pytest.raises(ValueError, match="same number of rounds"):
        verdict.compare(rounds)


def test_stage_counts_see_what_each_stage_does():
    config = RunConfig(model="mlp", blocks=8, width=32, batch=16, stages=4, micro_batches=4, checkpoint="never")
    counted = counts.stage_counts(config)
    # two Linear(32, 32) per stage on 4 samples: 2 x 2·4·32·32 FLOPs forward; backward twice that,
    # except stage 0, whose input needs no gradient (one product fewer in its first layer)
    assert [counted[(k, "F")].flops for k in range(4)] == [16384] * 4
    assert [counted[(k, "B")].flops for k in range(4)] == [24576, 32768, 32768, 32768]
    assert counted[(3, "F")].ops > counted[(2, "F")].ops  # the loss
    assert counts.layer_flops(config) == [8192 * 3] * 8


def test_equal_mean_costs_laws_hold_for_any_costs():
    """The laws the notebooks judge measured runs by, on random costs: 1F1B takes GPipe's time,
    splitting W off shrinks the bubble, equal stages sit on (K-1)/(M+K-1)."""
    rng = random.Random(0)
    for _ in range(100):
        f, b, w = (rng.uniform(0.01, 5) for _ in range(3))
        k, m = rng.choice([(2, 3), (4, 4), (4, 8), (8, 32)])
        same = {name: replay.unit_cost(k, m, costs={"F": f, "B": b}, schedule=name, label="x")
                for name in ("gpipe", "1f1b")}
        assert same["gpipe"].makespan == pytest.approx(same["1f1b"].makespan, rel=1e-12)
        assert same["gpipe"].bubble == pytest.approx(theory.bubble(k, m), abs=1e-12)
        split = replay.unit_cost(k, m, costs={"F": f, "B": b, "W": w}, schedule="zb-h1", label="x")
        whole = replay.unit_cost(k, m, costs={"F": f, "B": b + w}, schedule="1f1b", label="x")
        assert split.bubble < whole.bubble


def test_unit_cost_with_costs_needs_a_label():
    with pytest.raises(ValueError, match="without a label"):
        replay.unit_cost(2, 2, costs={"F": 1, "B": 2})


def test_a_measured_record_replays_by_its_means_and_counts():
    config = RunConfig(model="mlp", blocks=4, width=32, batch=32, stages=2, micro_batches=8, checkpoint="never")
    record = run(config, replay="always")
    assert len(record.solo_events) == 2 * 2 * 8  # every task kept once: its median over five serial steps
    equal = replay.with_mean_costs(record, per_stage=False)
    assert equal.bubble == pytest.approx(theory.bubble(2, 8), abs=1e-9)
    assert replay.with_mean_costs(record, per_stage=True).bubble >= equal.bubble - 1e-12
    assert equal.over_one_device == pytest.approx(2 * 8 / 9)
    counted = counts.stage_counts(config, record.balance)
    flop_line = replay.with_costs(record, lambda k, task: counted[(k, task.op)].flops, "FLOPs", "FLOP")
    assert flop_line.work == 8 * sum(c.flops for c in counted.values())


def test_side_by_side_runs_each_configuration_in_every_round():
    base = RunConfig(model="mlp", blocks=4, width=16, batch=16, stages=2, micro_batches=4, checkpoint="never")
    traces = side_by_side({"even": base, "by time": base.but(balance="time")}, rounds=3)
    assert {name: len(t) for name, t in traces.items()} == {"even": 3, "by time": 3}
    assert all(len(t.events) == 2 * 4 * 2 for ts in traces.values() for t in ts)
    with pytest.raises(ValueError, match="threads"):
        side_by_side({"a": base.but(transport="processes"), "b": base}, rounds=1)
