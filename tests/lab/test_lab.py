"""lab/: theory against hand values, replays against theory, chart builders, experiments, models."""
import threading
from pathlib import Path

import pytest
import torch

from engine.balance import solve
from lab import theory, zoo
from lab.config import MEASURE_ROUNDS, RunConfig, check, measure_rounds
from lab.runs import experiments
from lab.studies import speedup
from lab.timelines import replay
from lab.views import charts, tables


def test_theory_by_hand():
    assert theory.bubble(4, 1) == pytest.approx(0.75)
    assert theory.bubble(4, 16) == pytest.approx(3 / 19)
    assert theory.bubble(1, 7) == 0
    assert theory.utilization(4, 8) == pytest.approx(8 / 11)
    assert theory.ideal_speedup(2, 32) == pytest.approx(64 / 33)
    assert theory.ideal_speedup(8, 1) == pytest.approx(1.0)
    assert theory.micro_batches_for_small_bubble(4) == 16
    assert theory.PAPER_SPEEDUP[(8, 32)] == 6.3 and theory.PAPER_SPEEDUP[(4, 1)] == 1.07


def test_activation_memory_model():
    # 8 layers of 100 bytes per sample, inputs of 10 bytes, N = 64, K = 4, M = 8
    without = theory.activation_bytes(64, 8, 4, 8, 100, 10, recompute=False)
    with_recompute = theory.activation_bytes(64, 8, 4, 8, 100, 10, recompute=True)
    assert without == 64 * (10 + 2 * 100)
    assert with_recompute == 64 * 10 + 2 * 8 * 100
    # one device without recompute grows with N * L; recompute with K=1 is O(N + L*N/M)
    assert theory.activation_bytes(64, 8, 1, 1, 100, 10, False) == 64 * (10 + 800)


@pytest.mark.parametrize("stages,micro", [(2, 1), (4, 4), (4, 16), (8, 32)])
def test_theory_timeline_has_the_formula_bubble(stages, micro):
    line = replay.unit_cost(stages, micro)
    assert line.bubble == pytest.approx(theory.bubble(stages, micro))
    assert line.makespan == 3 * (stages + micro - 1)  # F=1 then B=2, K+M-1 cycles each way


def test_replay_of_uniform_measured_tasks_reproduces_the_theory_bubble():
    # a "measured" run whose tasks all took the same time but ran stretched and shuffled
    stages, micro = 4, 8
    events = [dict(stage=k, micro=m, op=op, start=100.0 * k + m, end=100.0 * k + m + (2.0 if op == "B" else 1.0))
              for k in range(stages) for m in range(micro) for op in ("F", "B")]
    line = replay.ideal_replay(events, stages, micro, "never")
    assert line.bubble == pytest.approx(theory.bubble(stages, micro))
    assert line.label == "ideal replay"


def test_gantt_has_one_trace_per_op_and_one_bar_per_task():
    figure = charts.gantt(replay.unit_cost(3, 4, "always"))
    bars = {trace.name: trace for trace in figure.data}
    assert set(bars) == {"forward", "recompute", "backward"}
    assert all(len(bars[name].x) == 12 for name in bars)
    assert set(bars["forward"].y) == {"stage 0", "stage 1", "stage 2"}
    assert sorted(bars["forward"].text) == sorted(str(m) for m in list(range(4)) * 3)
    assert all(x > 0 for x in bars["backward"].x)
    assert "bubble" in figure.layout.title.text
    no_recompute = charts.gantt(replay.unit_cost(3, 4, "never"))
    assert [t.name for t in no_recompute.data] == ["forward", "backward"]
    for chart in (figure, charts.stacked_gantt([replay.unit_cost(3, 4, "never")] * 2, ["a", "b"])):
        # a label too long for its bar (ZB-V's "3@5" at large M) is left out, not drawn unreadably small,
        # and its bar's hover still names it
        assert (chart.layout.uniformtext.minsize, chart.layout.uniformtext.mode) == (9, "hide")
        assert all("micro-batch %{customdata[0]}, chunk %{customdata[1]}" in t.hovertemplate for t in chart.data)


def test_other_charts():
    curve = charts.bubble_curve(4, [(8, 0.3)], max_micro_batches=16)
    assert len(curve.data[0].x) == 16 and list(curve.data[1].x) == [8]
    memory = charts.memory_chart([dict(measured_never=4e6, measured_recompute=1e6, predicted_never=4.2e6,
                                       predicted_recompute=1.1e6)] * 2)
    assert [t.name for t in memory.data][:2] == ["measured, no recompute", "measured, recompute"]
    from lab.studies.speedup import Cell
    table = tables.speedup_table([Cell(8, 32, 100.0, 5.9, 4.1, "ideal replay", 0.2, "threads", 4.4),
                                  Cell(2, 32, 50.0, 1.7, 1.6, "measured", 0.05, "processes", 1.3)])
    assert list(table["K"]) == [2, 8] and list(table["how"]) == ["measured (processes)", "ideal replay"]
    assert table.loc[1, "paper Transformer-48 (vs its K=2, M=1)"] == 6.3
    assert table.loc[1, "paper AmoebaNet-D (18, 256) (vs its K=2, M=1)"] == 3.48
    assert table.loc[1, "model with recompute (vs its K=2, M=1)"] == 6.01   # the paper's normalization
    assert table.loc[1, "ideal without recompute K*M/(M+K-1)"] == 6.56
    assert table.loc[1, "this host vs K=2, M=1"] == 4.4 and table.loc[1, "this host vs one device (K=1, M=1)"] == 5.9
    assert tables.paper_table().loc["M=4", "Transformer-48 K=8"] == 4.8
    assert tables.paper_table().loc["M=32", "AmoebaNet-D K=8"] == 3.48
    assert tables.paper_table3().loc["Transformer-24", "K=8"] == 3.3


@pytest.mark.parametrize("changes,words", [
    (dict(stages=9, blocks=2), "K=9 stages but the transformer has only 4 layers"),
    (dict(micro_batches=0), "M=0: a mini-batch is cut into at least one micro-batch"),
    (dict(model="gpt-5"), "unknown model 'gpt-5'"),
    (dict(balance="random"), "balance='random'"),
    (dict(checkpoint="maybe"), "checkpoint='maybe'"),
])
def test_bad_configurations_are_explained(changes, words):
    with pytest.raises(ValueError, match=words):
        check(RunConfig(**{**RunConfig().__dict__, **changes}))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a host without CUDA")
def test_cuda_configuration_on_a_cpu_host():
    with pytest.raises(ValueError, match="no CUDA GPU"):
        check(RunConfig(device="cuda"))


def test_run_record_is_plain_and_complete():
    record = experiments.run(RunConfig(model="mlp", blocks=4, width=32, batch=16, stages=2, micro_batches=4))
    assert record.stages == 2 and record.micro_batches == 4 and record.balance == [2, 2]
    assert len(record.events) == 2 * (4 + 3 + 4) and {"stage", "micro", "op", "start", "end"} <= set(record.events[0])
    assert len(record.memory) == 2 and all(m["predicted_activation_bytes"] > 0 for m in record.memory)
    assert record.host["cores"] >= 1 and record.loss > 0


def test_run_measures_the_model_before_a_pipe_takes_its_layers_away(monkeypatch):
    """A pipe of threads moves the layers it is given onto the stages' devices (on a GPU host, away
    from the host's samples): run() must not use the model once a pipe is built on it. Here the pipe
    runs on a copy and the model itself is moved to the meta device, where any use fails."""
    import copy
    from contextlib import contextmanager
    real = experiments.stepper_for

    @contextmanager
    def moving(config, balance, model=None, *args, **kwargs):
        with real(config, balance, copy.deepcopy(model), *args, **kwargs) as pipe:
            if model is not None:
                model.to("meta")
            yield pipe
    monkeypatch.setattr(experiments, "stepper_for", moving)
    record = experiments.run(RunConfig(model="mlp", blocks=4, width=32, batch=16, stages=2, micro_batches=4),
                             baseline=True)
    assert all(m["predicted_activation_bytes"] > 0 for m in record.memory) and record.boundary_bytes


def test_memory_prediction_matches_the_ledger_for_the_uniform_mlp():
    for checkpoint in ("never", "always"):
        record = experiments.run(RunConfig(model="mlp", blocks=8, width=64, batch=32, stages=4, micro_batches=8,
                                           checkpoint=checkpoint))
        for stage in record.memory:
            assert stage["activation_peak_bytes"] == pytest.approx(stage["predicted_activation_bytes"], rel=0.01)


def test_replay_uses_tasks_timed_alone_when_stages_outnumber_cores(monkeypatch):
    monkeypatch.setenv("GPIPE_LAB_DEVICES", "2")  # a 2-core host, whatever this one has
    record = experiments.run(RunConfig(model="mlp", blocks=8, width=32, batch=16, stages=8, micro_batches=4),
                             replay=True)
    assert record.solo_events is not None and record.notes
    line = replay.of_record(record, "ideal replay")
    assert line.label == "ideal replay of tasks timed alone" and len(line.bars) == len(record.events)


def test_mean_cost_replays_separate_imbalance_from_jitter():
    record = experiments.run(RunConfig(model="mlp", blocks=4, width=32, batch=16, stages=4, micro_batches=8,
                                       checkpoint="never"), replay="always")
    equal = replay.with_mean_costs(record, per_stage=False)
    assert equal.bubble == pytest.approx(theory.bubble(4, 8))   # equal stages: exactly the formula
    each = replay.with_mean_costs(record, per_stage=True)
    assert each.bubble >= equal.bubble - 1e-9 and "each stage's mean" in each.label
    # the last stage computes the loss, the first no input gradient: per-stage means differ
    assert len({round(b, 9) for b in each.busy}) > 1


@pytest.mark.parametrize("value", ["two", "0", "-1"])
def test_a_bad_host_size_override_is_explained(monkeypatch, value):
    monkeypatch.setenv("GPIPE_LAB_DEVICES", value)
    with pytest.raises(ValueError, match=f"GPIPE_LAB_DEVICES='{value}': expected a whole number of devices"):
        experiments.parallel_devices(RunConfig())


def test_the_rounds_a_setting_is_measured_over_can_be_set_and_a_bad_count_is_explained(monkeypatch):
    monkeypatch.delenv("GPIPE_LAB_ROUNDS", raising=False)
    assert measure_rounds() == MEASURE_ROUNDS == 11
    monkeypatch.setenv("GPIPE_LAB_ROUNDS", "21")
    assert measure_rounds() == 21
    for value in ("many", "0", "-3"):
        monkeypatch.setenv("GPIPE_LAB_ROUNDS", value)
        with pytest.raises(ValueError, match=f"GPIPE_LAB_ROUNDS='{value}': expected a whole number of rounds"):
            measure_rounds()


def test_every_figure_says_how_it_was_obtained_with_one_label():
    assert replay.how_obtained("measured", "threads") == "measured (threads)"
    assert replay.how_obtained("measured", "processes") == "measured (processes)"
    assert replay.how_obtained("ideal replay", "processes") == "ideal replay"
    from lab.studies.speedup import Cell
    assert Cell(2, 4, 1.0, 1.0, 1.0, "measured", 0.2, "processes").label == "measured (processes)"


def test_bubble_point_says_how_it_was_obtained(monkeypatch):
    config = RunConfig(model="mlp", blocks=4, width=32, batch=16, stages=4, micro_batches=4)
    monkeypatch.setenv("GPIPE_LAB_DEVICES", "1")
    assert speedup.bubble_point(experiments.run(config, replay=True))[2] == "ideal replay"
    monkeypatch.setenv("GPIPE_LAB_DEVICES", "8")
    micro, bubble, how = speedup.bubble_point(experiments.run(config, replay=True))
    assert (micro, how) == (4, "measured (threads)") and 0 < bubble < 1


def test_balance_by_time_cuts_the_uneven_cnn_by_its_layer_costs(monkeypatch):
    """The cut follows the layer costs it is given: here the CNN's FLOPs per layer (lab.runs.counts), the
    costs a quiet host's timings follow, so that the test judges the cut and not the host's load."""
    from lab.runs import counts
    config = RunConfig(model="cnn", blocks=6, width=32, batch=64, stages=4, micro_batches=8)
    flops = counts.layer_flops(config)
    monkeypatch.setattr("engine.balance.layer_times", lambda model, sample, *args, **kwargs: [float(f) for f in flops])
    uniform = experiments.run(config)
    timed = experiments.run(config.but(balance="time"))
    assert uniform.balance == [2, 2, 2, 2]
    assert timed.balance == solve(flops, 4) and timed.balance[0] < timed.balance[-1]  # full-resolution layers apart


@pytest.mark.parametrize("name", sorted(zoo.CARDS))
def test_zoo_models_train_on_their_tasks(name):
    config = RunConfig(model=name, blocks=2, width=zoo.card(name).test_width, batch=32, stages=2, micro_batches=4)
    losses = experiments.training_curve(config, steps=40, lr=1e-2)
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5


def test_zoo_layers_are_pipeline_units():
    from lab.zoo import cnn, transformer
    model = zoo.build("transformer", 3, 32, 0)
    assert len(model) == zoo.card("transformer").layer_count(3) == 5
    x, y = transformer.batch(4)
    assert x.shape == y.shape == (4, transformer.CONTEXT) and torch.equal(x[:, 1:], y[:, :-1])
    images, labels = cnn.batch(8)
    assert images.shape == (8, 1, 32, 32) and labels.max() < len(cnn.SHAPES)


def test_record_exports():
    import json
    record = experiments.run(RunConfig(model="mlp", blocks=2, width=32, batch=8, stages=2, micro_batches=2))
    chrome = json.loads(record.chrome_trace())
    assert len([e for e in chrome["traceEvents"] if e["ph"] == "X"]) == len(record.events)
    lines = record.events_csv().strip().splitlines()
    assert lines[0] == "stage,micro,op,start,end,device,chunk,host" and len(lines) == len(record.events) + 1


def test_one_f_one_b_runs_through_the_lab():
    config = RunConfig(model="mlp", blocks=4, width=32, batch=16, stages=2, micro_batches=8, checkpoint="never")
    gpipe, ofob = experiments.run(config), experiments.run(config.but(schedule="1f1b"))
    assert ofob.memory[-1]["activation_peak_bytes"] < gpipe.memory[-1]["activation_peak_bytes"]
    assert replay.task_order(2, 3, "never", "1f1b", stage=1) == "F0 B0 F1 B1 F2 B2"
    assert replay.of_record(ofob, "theory").label == "theory (unit costs), 1f1b"


def test_processes_record_the_same_shape_plus_what_crossed_between_them():
    from lab.processes import shared as processes
    from lab.processes.sources import SHARED
    config = RunConfig(model="mlp", blocks=4, width=32, batch=16, stages=2, micro_batches=4, checkpoint="never")
    shared_before = processes.current()
    threads, procs = experiments.run(config), experiments.run(config.but(transport="processes"))
    assert processes.current() is shared_before, "a run's own stage processes, not the shared pool's"
    assert procs.transport == "processes" and threads.transport == "threads"
    assert sorted((e["stage"], e["op"], e["micro"]) for e in procs.events) == \
        sorted((e["stage"], e["op"], e["micro"]) for e in threads.events)
    assert procs.loss == threads.loss  # bit for bit the same step
    sent = [m for m in procs.messages if m["direction"] == "send"]
    assert sorted((m["kind"], m["micro"]) for m in sent) == sorted((k, m) for k in ("act", "grad") for m in range(4))
    # what the wire carried is exactly what the tensors at the cut weigh: 16 samples x 32 floats each way
    assert procs.boundary_bytes == threads.boundary_bytes == [
        {"stages": (0, 1), "activations": 16 * 32 * 4, "gradients": 16 * 32 * 4}]
    assert procs.boundary_how == "sent between processes" and threads.boundary_how.startswith("sizes of the tensors")
    assert 0 < procs.communication_share < 1 and threads.communication_share == 0
    line = replay.of_record(procs, "measured")
    assert line.label == "measured (processes)" and len(line.messages) == 16
    experiments.run(config.but(transport="processes"), pools=SHARED)
    pool = processes.current()
    experiments.run(config.but(transport="processes", micro_batches=2), pools=SHARED)
    assert processes.current() is pool  # same K: the shared stage processes are reused
    experiments.run(config.but(transport="processes", stages=3), pools=SHARED)
    assert processes.current() is not pool and not pool.alive and processes.current().stages == 3
    processes.shutdown_pool()


def test_stacked_gantts_share_a_time_axis_only_when_they_share_a_unit():
    from engine.schedule import Schedule, one_f_one_b
    from lab.schedules import writer as schedule_writer
    written = Schedule(one_f_one_b(2, 4, "never"))
    units = schedule_writer.unit_cost(written)
    events = [{"stage": k, "op": op, "micro": m, "start": 0.0, "end": 1e-3, "chunk": k}
              for k in range(2) for m in range(4) for op in "FB"]
    in_ms = schedule_writer.replayed(written, events, 1)
    mixed = charts.stacked_gantt([units, in_ms], ["units", "replay"]).layout
    assert (mixed.xaxis.title.text, mixed.xaxis2.title.text) == ("time (time units)", "time (ms)")
    assert mixed.xaxis.matches is None and mixed.xaxis2.matches is None, "each keeps its own scale"
    same = charts.stacked_gantt([units, units], ["a", "b"]).layout
    assert same.xaxis.title.text is None and same.xaxis2.title.text == "time (time units)"
    assert same.xaxis.matches == "x2", "one scale for both"
    for layout, room in ((same, 40), (mixed, 90)):  # pixels between two charts: the lower one's title, not on bars
        inside = layout.height - layout.margin.t - layout.margin.b  # domains are shares of the plotting area
        assert (layout.yaxis.domain[0] - layout.yaxis2.domain[1]) * inside == pytest.approx(room)


def test_gantt_of_processes_has_a_message_row_per_stage_and_the_boundary_chart():
    from engine.trace import Message
    line = replay.unit_cost(2, 2)
    traced = replay.Timeline("measured (processes)", type(line.trace)(
        stages=2, events=line.trace.events,
        messages=[Message(0, 1, "send", "act", 0, 128, 1.0, 1.1), Message(1, 0, "receive", "act", 0, 128, 1.2, 1.3)]))
    figure = charts.gantt(traced)
    names = {t.name: t for t in figure.data}
    assert list(names["sending"].y) == ["stage 0 · messages"] and list(names["receiving"].text) == ["act 0"]
    assert list(figure.layout.yaxis.categoryarray) == ["stage 1 · messages", "stage 1", "stage 0 · messages", "stage 0"]
    chart = charts.boundary_chart([{"stages": (0, 1), "activations": 2 ** 20, "gradients": 2 ** 21}],
                                  "sent between processes",
                                  param_bytes=3 * 2 ** 20, stages=2)
    bars = {t.name: list(t.y) for t in chart.data}
    assert bars["activations forward (sent between processes)"] == [1.0]
    assert bars["gradients back (sent between processes)"] == [2.0]
    assert bars["data parallel, K=2: all-reduce per device"] == [3.0]  # every gradient, 2(K-1)/K = 1 times


def test_bad_transport_is_explained():
    with pytest.raises(ValueError, match="transport='pigeons': expected one of"):
        check(RunConfig(transport="pigeons"))


def test_what_the_app_draws_first_loads_without_torch():
    """The app's title, controls and theory diagram come from these modules, so that a learner sees
    them while torch loads (seconds on a cold server)."""
    import subprocess
    import sys
    code = ("import sys, lab.config, lab.views.charts, lab.timelines.replay, lab.theory, engine.schedule, "
            "engine.trace; print(sorted(m for m in ('torch', 'pandas', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert "torch" not in out.stdout and "pandas" not in out.stdout, out.stdout


def test_layouts_of_workers_trade_cuts_for_all_reduces_and_memory():
    """lab.studies.layouts.compare on four workers: what each layout sends and holds, measured here."""
    from lab.studies import layouts as replicas
    rows = {r["D x K"]: r for r in replicas.compare(RunConfig(model="mlp", blocks=4, width=32), 4, 16, 2)}
    assert list(rows) == ["1 x 4", "2 x 2", "4 x 1"]
    assert [rows[k]["M per replica"] for k in rows] == [8, 4, 2]   # B = b·M·D
    reduced = "bytes all-reduced per worker (ring)"
    assert rows["1 x 4"][reduced] == 0 < rows["2 x 2"][reduced]
    assert rows["4 x 1"]["bytes across cuts (all replicas)"] == 0 < rows["1 x 4"]["bytes across cuts (all replicas)"]
    assert rows["1 x 4"]["memory per worker (bytes)"] < rows["4 x 1"]["memory per worker (bytes)"]
    assert all(r["step ms"] >= r["pipeline ms (replayed)"] > 0 for r in rows.values())
    with pytest.raises(ValueError, match="does not split into 3 replica"):
        replicas.micro_batches(16, 2, 3)


def test_the_gantt_draws_each_stages_all_reduce_after_its_tasks():
    from lab.timelines import replay
    from lab.views import charts
    events = [dict(stage=s, micro=0, op=op, start=t, end=t + 1.0) for s, op, t in
              ((0, "F", 0.0), (1, "F", 1.0), (1, "B", 2.0), (0, "B", 3.0))]
    reductions = [dict(stage=1, start=3.0, end=4.5, bytes=1000), dict(stage=0, start=4.0, end=4.6, bytes=2000)]
    figure = charts.gantt(replay.measured(events, 2, "measured (2 x 2 mesh)", reductions=reductions))
    bar = next(t for t in figure.data if t.name == "all-reduce")
    assert list(bar.y) == ["stage 1", "stage 0"] and list(bar.base) == [3000.0, 4000.0]
    assert list(bar.x) == pytest.approx([1500.0, 600.0]) and [c[0] for c in bar.customdata] == [1000, 2000]


def test_the_first_drawing_is_an_svg_gantt_of_the_same_timeline():
    """What the app shows before Plotly's script has loaded: the theory diagram as plain SVG."""
    from lab.timelines import replay
    from lab.views import charts
    line = replay.unit_cost(3, 4, "except_last")
    svg = charts.gantt_svg(line, "theory <K=3>")
    assert svg.startswith('<svg class="gantt-sketch"') and svg.endswith("</svg>") and "theory &lt;K=3&gt;" in svg
    bars = [part for part in svg.split("<rect")[1:] if "<title>" in part]
    assert len(bars) == len(line.bars) == 3 * (4 + 3 + 4)
    assert sum(charts.OPS["R"][1] in bar for bar in bars) == 3 * 3   # recompute bars, coloured as in gantt
    assert all(f"stage {k}</text>" in svg for k in range(3)) and f"bubble {line.bubble:.0%}" in svg


def test_the_gpu_table_frees_the_gpus_only_between_other_sessions_runs():
    """Before each GPU cell the table has the shared pool drop its pipe, never under a run another
    session holds (it waits for that run's turn to end); the stage processes stay up, so the next
    cell of the same K builds on them instead of starting new ones."""
    from lab.processes import shared as processes
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    try:
        with processes.pool_for(2) as pool:
            pool.build(zoo.build, dict(name="mlp", blocks=2, width=16), chunks=2)
            pool.step(x, y, torch.nn.functional.mse_loss)
        processes._turn.acquire()   # another session's run holds the pool
        freeing = threading.Thread(target=processes.free_gpus)
        freeing.start()
        freeing.join(0.3)
        assert freeing.is_alive() and pool.built, "it waits for the run to end"
        processes._turn.release()
        freeing.join(30)
        assert not freeing.is_alive() and not pool.built and pool.alive, "then drops the pipe, keeping the processes"
        assert not processes.busy()
        with processes.pool_for(2) as again:
            assert again is pool
            again.build(zoo.build, dict(name="mlp", blocks=2, width=16), chunks=2)
            assert torch.isfinite(again.step(x, y, torch.nn.functional.mse_loss))
    finally:
        processes.shutdown_pool()


@pytest.mark.parametrize("model", sorted(zoo.CARDS))
def test_bytes_per_sample_from_two_small_passes_are_those_of_the_whole_micro_batch(model, monkeypatch):
    """The memory prediction and the boundary sizes read bytes per sample from passes over 2 and 4
    samples: the figures of a pass over the whole micro-batch (a GPU table's M=1 micro-batch is its
    whole batch, minutes of host compute at its sizes), a part that does not grow with the samples
    (the Transformer's position indices) included."""
    config = RunConfig(model=model, blocks=2, width=zoo.card(model).test_width, batch=16, micro_batches=1)
    built, (inputs, _), _ = experiments.build(config)
    sample = experiments.micro_sample(inputs, config)
    small = experiments.layer_bytes_per_sample(built, sample)
    monkeypatch.setattr(experiments, "per_sample_of", lambda measure, rows: measure(rows))   # one full pass
    whole = experiments.layer_bytes_per_sample(built, sample)
    for got, expected in zip(small, whole):
        assert got == pytest.approx(expected, rel=1e-9, abs=1e-6)
