"""lab.timelines.breakdown: a step's makespan as parts that add up to it, none negative, on hand-made traces
(each part's value known), on the unit-cost diagrams (the schedule's bubble is their idle) and on
real steps of every setting of `python -m lab.reproduce breakdown --quick`, threads and processes."""
import csv
import math

import pytest

from engine.schedule import SCHEDULES
from engine.trace import Event, Message, Trace
from lab import reproduce, theory
from lab.config import RunConfig
from lab.processes import shared as processes
from lab.timelines import breakdown, replay
from lab.views import charts


def events_of(line) -> list[dict]:
    return [{"stage": e.stage, "chunk": e.chunk, "op": e.op, "micro": e.micro, "start": e.start, "end": e.end}
            for e in line.bars]


def adds_up(parts: breakdown.Breakdown) -> None:
    assert list(parts.parts) == list(breakdown.PARTS)
    assert all(seconds >= 0 for seconds in parts.parts.values()), parts.parts
    assert math.isclose(parts.total, parts.step, rel_tol=0.02), (parts.total, parts.step)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("stages,micro", [(1, 4), (2, 4), (4, 8)])
def test_the_schedules_bubble_is_the_idle_of_the_unit_cost_diagram_with_the_steps_task_times(schedule, checkpoint,
                                                                                              stages, micro):
    virtual = SCHEDULES[schedule].fewest_chunks
    costs = {op: 0.0013 * cost for op, cost in theory.unit_costs(schedule, virtual).items()}  # a step's times
    line = replay.unit_cost(stages, micro, checkpoint, costs, schedule, virtual, label="a step's task times")
    parts = breakdown.of_trace(line.trace, events_of(line))
    adds_up(parts)
    idle = line.makespan - line.busy[parts.critical_stage]
    assert parts.parts["schedule bubble"] == pytest.approx(idle, abs=1e-12)
    recomputes = sum(e.duration for e in line.bars if e.op == "R" and e.stage == parts.critical_stage)
    assert parts.parts["recompute"] == pytest.approx(recomputes, abs=1e-12)
    assert parts.parts["compute"] == pytest.approx(line.busy[parts.critical_stage] - recomputes, abs=1e-12)
    for name in ("contention", "unequal stages", "messages", "gaps"):
        assert parts.parts[name] == pytest.approx(0, abs=1e-12)


def two_stage_step(messages=()) -> Trace:
    """K=2, M=1: stage 1's forward waits 0.5 for the hand-over and runs 2 (1.5 alone); a gap of 0.1
    before its backward; stage 0's backward waits 0.4 for the gradient."""
    events = [Event(0, 0, "F", 0.0, 1.0, "cpu", 0), Event(1, 0, "F", 1.5, 3.5, "cpu", 1),
              Event(1, 0, "B", 3.6, 5.6, "cpu", 1), Event(0, 0, "B", 6.0, 8.0, "cpu", 0)]
    return Trace(stages=2, micro_batches=1, events=events, messages=list(messages))


ALONE = [{"stage": 0, "chunk": 0, "op": "F", "micro": 0, "start": 0.0, "end": 1.0},
         {"stage": 1, "chunk": 1, "op": "F", "micro": 0, "start": 1.0, "end": 2.5},
         {"stage": 1, "chunk": 1, "op": "B", "micro": 0, "start": 2.5, "end": 4.5},
         {"stage": 0, "chunk": 0, "op": "B", "micro": 0, "start": 4.5, "end": 6.5}]


def test_each_part_of_a_hand_made_step():
    """Stage 1 has the most work alone (3.5 against 3): it is the critical stage. Its forward takes
    1.25 at the average stage's alone speed (F alone: 1 and 1.5), 0.25 more alone (unequal stages)
    and 0.5 more beside stage 0 (contention); it waits 1 for stage 0's forward (schedule bubble) and
    0.5 for its hand-over (messages); after its last task it waits 0.4 for the gradient's hand-over
    and 2 for stage 0's backward."""
    parts = breakdown.of_trace(two_stage_step(), ALONE)
    assert parts.critical_stage == 1 and parts.step == 8.0
    assert parts.parts == pytest.approx({"compute": 3.25, "recompute": 0.0, "contention": 0.5, "schedule bubble": 3.0,
                                         "unequal stages": 0.25, "messages": 0.9, "gaps": 0.1})
    assert parts.slowdown == pytest.approx(7 / 6.5 - 1)  # measured 1+2+2+2, alone 1+1.5+2+2
    assert [(p.kind, p.stage, p.start, p.end) for p in parts.path] == [
        ("start", 0, 0.0, 0.0), ("task", 0, 0.0, 1.0), ("hand-over", 1, 1.0, 1.5), ("task", 1, 1.5, 3.5),
        ("gap", 1, 3.5, 3.6), ("task", 1, 3.6, 5.6), ("hand-over", 0, 5.6, 6.0), ("task", 0, 6.0, 8.0)]


def test_waiting_beyond_the_schedules_own_idle_is_unequal_stages():
    """Equal tasks (F 1, B 2, alone as measured) but stage 0 pauses 1 between its forwards: stage 1
    waits 1 + 1 for forwards and 2 for the last backward, 4 in all at alone speed, where the
    schedule with equal stages idles it 3 ((K-1)(F+B)): the 1 beyond is the stages' unequal pace."""
    ran = [(0, "F", 0, 0, 1), (0, "F", 1, 2, 3), (1, "F", 0, 1, 2), (1, "F", 1, 3, 4), (1, "B", 1, 4, 6),
           (1, "B", 0, 6, 8), (0, "B", 1, 6, 8), (0, "B", 0, 8, 10)]
    trace = Trace(stages=2, micro_batches=2, events=[Event(k, m, op, a, b, "cpu", k) for k, op, m, a, b in ran])
    parts = breakdown.of_trace(trace, [{"stage": k, "op": op, "micro": m, "start": a, "end": b}
                                       for k, op, m, a, b in ran])
    assert parts.critical_stage == 1
    assert parts.parts == pytest.approx({"compute": 6.0, "recompute": 0.0, "contention": 0.0, "schedule bubble": 3.0,
                                         "unequal stages": 1.0, "messages": 0.0, "gaps": 0.0})


def test_a_stages_own_message_time_between_its_tasks_counts_as_messages_not_gaps():
    sending = Message(1, 0, "send", "act", 0, 64, 3.5, 3.56)
    parts = breakdown.of_trace(two_stage_step([sending]), ALONE)
    assert parts.parts["messages"] == pytest.approx(0.96) and parts.parts["gaps"] == pytest.approx(0.04)


def test_the_critical_path_tiles_the_step_from_its_start_to_its_last_task():
    line = replay.unit_cost(3, 5, "except_last", schedule="1f1b")
    path = breakdown.critical_path(line.trace)
    assert path[0].start == 0 and path[-1].end == line.makespan
    assert all(a.end == b.start for a, b in zip(path, path[1:]))
    assert all(p.duration >= 0 for p in path)


def test_a_step_of_several_stages_needs_its_tasks_timed_alone():
    with pytest.raises(ValueError, match="timed alone"):
        breakdown.of_trace(two_stage_step())
    with pytest.raises(ValueError, match=r"no alone time for task \(1, 'B', 0\)"):
        breakdown.of_trace(two_stage_step(), ALONE[:2] + ALONE[3:])
    with pytest.raises(ValueError, match="no tasks"):
        breakdown.of_trace(Trace(stages=2))


def test_the_shortfall_from_k_adds_up_to_the_step_minus_the_k1_step_over_k():
    step = breakdown.of_trace(two_stage_step(), ALONE)
    single = breakdown.of_trace(replay.unit_cost(1, 1, "never").trace)
    gap = breakdown.shortfall(step, single, 2)
    assert sum(gap.values()) == pytest.approx(step.step - single.step / 2)


@pytest.fixture(scope="module")
def quick_records():
    """Every setting of `python -m lab.reproduce breakdown --quick`, threads and processes: one
    measured round each, its tasks timed alone and a K=1 step beside it. The shared stage processes
    are stopped afterwards, so no process outlives the module."""
    records = {}
    try:
        for name, config in reproduce.breakdown_settings(quick=True):
            for transport in ("threads", "processes"):
                records[(name, config.but(transport=transport))] = breakdown.measure(config.but(transport=transport),
                                                                                     rounds=1, warmup=1)
        yield records
    finally:
        processes.shutdown_pool()


@pytest.mark.timeout(180)
def test_every_quick_setting_adds_up_to_its_measured_step_and_no_part_is_negative(quick_records):
    assert len(quick_records) == 6
    for (name, config), record in quick_records.items():
        transport = config.transport
        parts, single = breakdown.of_record(record), breakdown.of_baseline(record)
        adds_up(parts)
        adds_up(single)
        assert parts.step == record.makespan and single.step == record.rounds[0]["baseline"]
        for zero in ("contention", "schedule bubble", "unequal stages", "messages"):
            assert single.parts[zero] == 0, (name, zero)
        assert parts.parts["schedule bubble"] > 0 and parts.parts["compute"] > 0, (name, transport, parts.parts)
        assert parts.path[-1].end == record.makespan


@pytest.mark.timeout(180)
def test_a_record_without_solo_events_is_timed_alone_when_taken_apart():
    record = breakdown.measure(RunConfig(model="mlp", blocks=2, width=32, batch=8, stages=2, micro_batches=2),
                               rounds=1, warmup=0)
    record.solo_events = None
    alone = breakdown.alone_events(record)
    assert sorted((e["chunk"], e["op"], e["micro"]) for e in alone) == \
        sorted((e["chunk"], e["op"], e["micro"]) for e in record.events)
    adds_up(breakdown.of_record(record, alone))


def test_the_command_writes_every_settings_parts_and_its_measured_step(quick_records, tmp_path, monkeypatch, capsys):
    """`python -m lab.reproduce breakdown --quick`, on the steps measured above (the command's own
    measuring is what they are): a CSV of setting, component, ms with one `measured step` row per
    setting, equal to the sum of that setting's parts; the markdown, a column per setting."""
    by_config = {config: record for (_, config), record in quick_records.items()}
    monkeypatch.setattr(breakdown, "measure", lambda config, rounds, warmup: by_config[config])
    assert reproduce.main(["breakdown", "--quick", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "breakdown.csv") as table:
        rows = list(csv.DictReader(table))
    assert list(rows[0]) == ["setting", "component", "ms"]
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    assert settings == [f"{name}, {kind}" for name in ("app default", "small model", "large model")
                        for kind in ("K=2, processes", "K=2, threads", "K=1")]
    for setting in settings:
        mine = {r["component"]: float(r["ms"]) for r in rows if r["setting"] == setting}
        assert list(mine) == [*breakdown.PARTS, breakdown.STEP]
        assert sum(mine[p] for p in breakdown.PARTS) == pytest.approx(mine[breakdown.STEP], rel=0.02)
    printed = capsys.readouterr().out
    assert "| component (ms) | app default, K=2, processes |" in printed and "| measured step |" in printed


def test_the_gantt_draws_the_critical_path_over_its_tasks_and_the_waterfall_climbs_to_the_step():
    line = replay.unit_cost(2, 4, "never")
    parts = breakdown.of_trace(line.trace, events_of(line))
    figure = charts.gantt(line, critical=parts.path)
    [path] = [trace for trace in figure.data if trace.name == "critical path"]
    bars = {(y, base, base + width) for trace in figure.data if trace.type == "bar"
            for y, base, width in zip(trace.y, trace.base, trace.x)}
    drawn = [p for p in parts.path if p.kind != "start"]   # two points each: its start and its end
    rows = list(figure.layout.yaxis.categoryarray)   # bottom up: row i's middle is at i on both axes
    assert path.yaxis == "y2" and list(figure.layout.yaxis2.range) == list(figure.layout.yaxis.range) == [-0.5, 1.5]
    for piece, x0, x1, y0, y1 in zip(drawn, path.x[0::2], path.x[1::2], path.y[0::2], path.y[1::2]):
        row = rows.index(f"stage {piece.stage}")
        # inside the bar, off its middle
        assert y0 == y1 and row < y0 < row + 0.375 and (x0, x1) == (piece.start, piece.end)
        assert piece.kind != "task" or (rows[row], x0, x1) in bars  # a task of the path is a drawn bar
    assert path.x[-1] == line.makespan and len(path.x) == 2 * sum(p.kind != "start" for p in parts.path)
    fall = charts.waterfall(parts.parts, parts.step, "where").data[0]
    assert list(fall.x) == [*breakdown.PARTS, "measured step"] and fall.measure[-1] == "total"
    assert sum(fall.y[:-1]) == pytest.approx(fall.y[-1]) == parts.step * 1e3
    single = breakdown.of_trace(replay.unit_cost(1, 4, "never").trace)
    short = charts.waterfall(breakdown.shortfall(parts, single, 2), parts.step, "from K=1",
                             start=("K=1 step / 2", single.step / 2)).data[0]
    assert short.measure[0] == "absolute" and sum(short.y[:-1]) == pytest.approx(short.y[-1])
