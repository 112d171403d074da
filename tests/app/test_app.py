"""The Streamlit app, driven with AppTest: charts are checked through their figure data."""
import json
from pathlib import Path

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

import lab.config
import lab.machine.gpus
from lab.config import SCHEDULE_ORDER, SCHEDULES

APP = str(Path(__file__).resolve().parents[2] / "app.py")


# What the page opens with in these tests: the small setting `small` chooses, so that a test's first
# run takes a second or two instead of the shipped default's ten (its Transformer, stages as processes,
# each round beside a K=1 step). The shipped default has a test of its own (`shipped_app`).
LIGHT = lab.config.APP_DEFAULT.but(model="mlp", blocks=8, width=128, batch=16, stages=3, micro_batches=4,
                                   transport="threads")


@pytest.fixture
def shipped_app(monkeypatch):
    """The page in a new session of a server with nothing cached (measured records and the set of
    measured settings are server-wide: each test starts as a fresh server would). Three measured
    rounds instead of eleven: these tests check what the page shows, not the figures' spread (the
    browser test opens the page as a learner does, with every round)."""
    monkeypatch.setenv("GPIPE_LAB_ROUNDS", "3")
    st.cache_data.clear()
    st.cache_resource.clear()
    at = AppTest.from_file(APP, default_timeout=120)
    yield at
    st.cache_data.clear()
    st.cache_resource.clear()


@pytest.fixture
def app(shipped_app, monkeypatch):
    """The same page, opening with LIGHT: for the tests that choose their own setting."""
    monkeypatch.setattr(lab.config, "APP_DEFAULT", LIGHT)
    return shipped_app


def small(at, **values):
    """Choose a small, fast configuration (and any other values), then run."""
    settings = dict(model="mlp", batch=16, stages=3, micro=4, width=128, transport="threads")
    settings.update(values)
    model = settings.pop("model")
    if at.selectbox(key="model").value != model:
        at.selectbox(key="model").set_value(model).run()  # its own width slider appears with it
    for key, value in settings.items():
        widget = {"recompute": at.radio, "balance": at.radio, "view": at.radio, "transport": at.radio,
                  "schedule": at.selectbox}.get(key)
        if key in ("batch", "width", "blocks"):
            key = f"{key}-{model}"
        (widget(key=key) if widget else find_slider(at, key)).set_value(value)
    return at.run()


def find_slider(at, key):
    for finder in (at.slider, at.select_slider):
        try:
            return finder(key=key)
        except KeyError:
            continue
    raise KeyError(key)


def gantt(at):
    """The first chart's figure and its bars by name (the critical path's line left out)."""
    spec = json.loads(at.get("plotly_chart")[0].proto.spec)
    bars = {trace["name"]: trace for trace in spec["data"] if trace["type"] == "bar"}
    return spec, bars


def test_defaults_run_and_draw_the_measured_gantt(shipped_app):
    app = shipped_app
    app.run()
    assert not app.exception and not app.error
    spec, bars = gantt(app)
    stages, micro = 2, 16  # the defaults
    assert {y for op in ("forward", "recompute", "backward") for y in bars[op]["y"]} == \
        {f"stage {k}" for k in range(stages)}
    assert len(bars["sending"]["x"]) == len(bars["receiving"]["x"]) == stages * micro  # processes by default
    assert len(bars["forward"]["x"]) == stages * micro
    assert len(bars["backward"]["x"]) == stages * micro
    assert len(bars["recompute"]["x"]) == stages * (micro - 1)  # except_last is the default
    assert spec["layout"]["title"]["text"].startswith("measured (processes)")
    assert len(app.get("plotly_chart")) >= 4  # gantt, what crossed, memory, bubble curve
    assert len(app.get("download_button")) == 2


@pytest.mark.parametrize("stages,micro,recompute,r_bars", [
    (2, 6, "off", 0),
    (3, 4, "on, every micro-batch", 12),
    (5, 3, "on, except the last micro-batch", 10),
])
def test_sliders_rerun_the_pipeline(app, stages, micro, recompute, r_bars):
    app.run()
    small(app, stages=stages, micro=micro, recompute=recompute)
    assert not app.exception and not app.error
    _, bars = gantt(app)
    assert {y for trace in bars.values() for y in trace["y"]} == {f"stage {k}" for k in range(stages)}
    assert len(bars["forward"]["x"]) == stages * micro and len(bars["backward"]["x"]) == stages * micro
    assert len(bars.get("recompute", {"x": []})["x"]) == r_bars
    bubble = next(m for m in app.metric if m.label == "bubble")
    assert bubble.delta == f"(K-1)/(M+K-1) = {(stages - 1) / (micro + stages - 1):.0%}"  # the formula, named


def test_replay_and_theory_views(app):
    app.run()
    small(app, view="ideal replay")
    spec, bars = gantt(app)
    assert spec["layout"]["title"]["text"].startswith("ideal replay") and len(bars["forward"]["x"]) == 12
    small(app, view="theory")
    spec, bars = gantt(app)
    assert spec["layout"]["title"]["text"].startswith("theory")
    assert "time units" in spec["layout"]["xaxis"]["title"]["text"]


@pytest.mark.parametrize("values,words", [
    (dict(model="mlp", blocks=2, stages=5), "K=5 stages but the mlp has only 2 layers"),
])
def test_invalid_combinations_show_an_error_not_a_traceback(app, values, words):
    app.run()
    small(app, **values)
    assert not app.exception
    assert any(words in e.value for e in app.error)
    assert not app.get("plotly_chart")


def test_pinned_runs_are_shown_side_by_side(app):
    app.run()
    small(app, micro=1)
    app.button(key="pin").click().run()
    small(app, micro=8)
    app.button(key="pin").click().run()
    titles = [json.loads(c.proto.spec)["layout"].get("title", {}).get("text", "") for c in app.get("plotly_chart")]
    assert "K=3, M=1, except_last, mlp, threads" in titles and "K=3, M=8, except_last, mlp, threads" in titles
    assert not app.exception


def test_micro_batches_that_torch_chunk_cannot_make_are_explained(app):
    app.run()
    small(app, batch=16, micro=5)  # torch.chunk(16 samples, 5) gives 4 pieces of 4
    _, bars = gantt(app)
    assert len(bars["forward"]["x"]) == 3 * 4
    assert any("the pipeline ran M=4" in w.value for w in app.warning)
    small(app, batch=4, micro=8)  # more micro-batches than samples: one sample each, as the engine does
    assert not app.exception and not app.error
    _, bars = gantt(app)
    assert len(bars["forward"]["x"]) == 3 * 4
    assert any("into 4 micro-batches, not M=8" in w.value for w in app.warning)


def test_more_stages_than_cores_points_to_the_replay(app, monkeypatch):
    monkeypatch.setenv("GPIPE_LAB_DEVICES", "2")  # a 2-core host, whatever this one has
    app.run()
    small(app, stages=8, micro=8, blocks=8, view="ideal replay")
    assert not app.exception
    assert any("ideal replay" in w.value for w in app.warning)
    spec, _ = gantt(app)
    assert spec["layout"]["title"]["text"].startswith("ideal replay of tasks timed alone")


def test_sweeps_fill_the_bubble_curve_and_the_speedup_table(app, monkeypatch):
    monkeypatch.setenv("GPIPE_LAB_DEVICES", "2")  # a 2-core host, whatever this one has
    app.run()
    small(app, batch=32, blocks=8)
    app.button(key="measure_bubble").click().run()
    curves = [json.loads(c.proto.spec) for c in app.get("plotly_chart")]
    bubble = next(s for s in curves if s["layout"]["title"]["text"].startswith("Bubble"))
    measured = next(t for t in bubble["data"] if t["name"].startswith("this host, "))
    assert measured["x"] == [1, 2, 4, 8, 16, 32]
    app.button(key="measure_speedup").click().run()
    assert not app.exception
    table = app.dataframe[-1].value
    assert list(table.columns) == ["K", "M", "paper Transformer-48 (vs its K=2, M=1)",
                                   "paper AmoebaNet-D (18, 256) (vs its K=2, M=1)",
                                   "model with recompute (vs its K=2, M=1)", "ideal without recompute K*M/(M+K-1)",
                                   "this host vs K=2, M=1", "this host vs one device (K=1, M=1)", "how"]
    assert set(table["how"]) <= {"measured (threads)", "measured (processes)", "ideal replay"}
    assert set(table.loc[table["K"] > 2, "how"]) == {"ideal replay"}  # more stages than the 2 devices


@pytest.mark.parametrize("transport", ["threads", "processes"])
def test_both_transports_draw_k_stage_rows_and_every_task(app, transport):
    app.run()
    small(app, stages=2, micro=4, recompute="off", transport=transport)
    assert not app.exception and not app.error, [e.value for e in app.error]
    spec, bars = gantt(app)
    assert spec["layout"]["title"]["text"].startswith(f"measured ({transport})")
    assert {y for name in ("forward", "backward") for y in bars[name]["y"]} == {"stage 0", "stage 1"}
    assert len(bars["forward"]["x"]) == len(bars["backward"]["x"]) == 2 * 4
    if transport == "processes":
        assert len(bars["sending"]["x"]) == len(bars["receiving"]["x"]) == 2 * 4  # 4 acts forward, 4 grads back
        assert set(bars["sending"]["y"]) == {"stage 0 · messages", "stage 1 · messages"}
    else:
        assert "sending" not in bars
    titles = [json.loads(c.proto.spec)["layout"].get("title", {}).get("text", "") for c in app.get("plotly_chart")]
    assert any(t.startswith("What crosses per step") for t in titles)


def test_both_transports_side_by_side(app):
    app.run()
    small(app, stages=2, micro=4, transport="processes")
    app.button(key="other_transport").click().run()
    assert not app.exception
    table = app.dataframe[0].value
    assert list(table["stages run as"]) == ["processes", "threads"]
    assert all(s > 0 for s in table["speedup over K=1 (same M)"])


def test_a_dead_stage_process_is_a_clear_error_and_the_next_run_rebuilds(app):
    from lab.processes import shared as processes
    app.run()
    small(app, stages=2, micro=4, transport="processes")
    assert not app.error
    processes.current().kill(1)
    small(app, stages=2, micro=2, transport="processes")
    assert not app.exception
    assert any("A stage process stopped" in e.value for e in app.error)
    small(app, stages=2, micro=3, transport="processes")
    assert not app.exception and not app.error
    assert processes.current().alive


def test_a_session_that_finds_the_stage_processes_busy_waits_and_says_so(app, monkeypatch):
    """The other session lets go of the stage processes only once this one waits for them (after its
    try for the turn failed, it blocks on it), so the test sees the wait whatever the host's speed."""
    import threading

    from lab.processes import shared as processes
    app.run()
    small(app, stages=2, micro=4, transport="processes")
    holding, waiting = threading.Event(), threading.Event()

    class Watched:
        """The pool's turn, telling `waiting` when a run blocks on it while it is taken (a start
        ahead of time only ever tries it without blocking)."""

        def __init__(self, lock):
            self.lock = lock

        def acquire(self, blocking=True, timeout=-1):
            if blocking and self.lock.locked():
                waiting.set()
            return self.lock.acquire(blocking, timeout)

        def release(self):
            self.lock.release()

        def locked(self):
            return self.lock.locked()

    monkeypatch.setattr(processes, "_turn", Watched(processes._turn))

    def other_session():
        with processes.pool_for(2):
            holding.set()
            waiting.wait(60)

    other = threading.Thread(target=other_session)
    other.start()
    holding.wait(30)
    small(app, stages=2, micro=3, transport="processes")  # a new setting: this session runs it now, and waits
    other.join()
    assert waiting.is_set() and not app.exception and not app.error
    assert any("waited its turn" in c.value and "another session" in c.value for c in app.caption)


def test_a_second_session_on_measured_settings_is_answered_from_the_cache(app):
    app.run()
    small(app, stages=2, micro=4)
    measured, _ = gantt(app)
    second = AppTest.from_file(APP, default_timeout=120)  # another tab of the same server
    second.run()
    small(second, stages=2, micro=4)
    assert not second.exception and not second.error
    assert gantt(second)[0]["layout"]["title"] == measured["layout"]["title"]  # the same step, not a new one


@pytest.mark.parametrize("schedule,ops", [("interleaved", {"forward", "backward"}),
                                          ("zb-h1", {"forward", "backward", "weight gradient"})])
def test_later_schedules_run_from_the_sidebar(app, schedule, ops):
    app.run()
    small(app, stages=2, micro=4, recompute="off", schedule=schedule)
    assert not app.exception and not app.error
    _, bars = gantt(app)
    assert {name for name in bars} == ops
    chunks = 2 if schedule == "interleaved" else 1
    assert len(bars["forward"]["x"]) == 2 * 4 * chunks  # K stages x M micro-batches x v chunks
    if schedule == "interleaved":
        assert any("@" in text for text in bars["forward"]["text"])  # bars say their chunk


def test_the_four_schedules_side_by_side(app):
    app.run()
    small(app, stages=2, micro=4, blocks=8, recompute="off")
    app.button(key="compare_schedules").click().run()
    assert not app.exception
    table = app.dataframe[-1].value
    assert list(table["schedule"]) == [name + (", v=2" if SCHEDULES[name].fewest_chunks > 1 else "")
                                       for name in SCHEDULE_ORDER]
    spec = json.loads(next(c for c in app.get("plotly_chart") if "schedules_gantt" in c.proto.id).proto.spec)
    titles = [a["text"] for a in spec["layout"]["annotations"]]
    assert [t.split(" ")[0] for t in titles] == list(SCHEDULE_ORDER)
    small(app, stages=2, micro=3, blocks=8, recompute="off")  # M=3 is not a multiple of K=2
    app.button(key="compare_schedules").click().run()
    assert any("Left out: interleaved" in w.value for w in app.warning)


@pytest.mark.parametrize("devices", [1, 8, 16])
def test_pages_are_right_on_hosts_of_other_sizes(app, monkeypatch, devices):
    """What the lab reads as the host's parallel devices decides what is measured and what is replayed."""
    monkeypatch.setenv("GPIPE_LAB_DEVICES", str(devices))
    app.run()
    small(app, stages=4, micro=4, batch=16, blocks=8)
    assert not app.exception and not app.error
    sharing = [w.value for w in app.warning if "share" in w.value]
    assert bool(sharing) == (4 > devices)  # the note that stages share devices, only when they do
    app.button(key="measure_speedup").click().run()
    assert not app.exception
    table = app.dataframe[-1].value
    for row in table.itertuples():
        assert row.how == ("ideal replay" if row.K > devices else "measured (threads)"), (devices, row.K, row.how)


def test_where_stages_run_is_offered_only_on_a_host_with_gpus(app, monkeypatch):
    """The app counts GPUs without torch. Without any it offers no choice and runs on the CPU; with
    some it offers CPU cores (its default, so the page reads the same as on a CPU host) or GPUs."""
    app.run()
    small(app)
    assert [r.key for r in app.sidebar.radio if r.key == "device"] == []
    import lab.config
    monkeypatch.setattr(lab.machine.gpus, "visible_gpus", lambda: 2)
    small(app)
    choice = app.radio(key="device")
    assert choice.options == ["CPU cores", "GPUs (2 here)"] and choice.value == "cpu"
    assert not app.exception and not app.error and app.radio(key="transport").value == "threads"


def test_a_bad_round_count_in_the_environment_is_an_error_on_the_page(app, monkeypatch):
    monkeypatch.setenv("GPIPE_LAB_ROUNDS", "lots")
    app.run()
    assert not app.exception
    assert "GPIPE_LAB_ROUNDS='lots'" in app.error[0].value


def test_a_written_schedule_stays_when_the_settings_change_and_runs_only_at_its_own_k(app):
    app.run()
    small(app, stages=2, micro=4, blocks=8, recompute="off")
    mine = "stage 0: F0 F1 F2 F3 B3 B2 B1 B0\nstage 1: F0 F1 F2 F3 B3 B2 B1 B0\nstage 2: F0 F1 F2 F3 B3 B2 B1 B0"
    app.text_area(key="writer_text").input(mine).run()
    assert "✓ legal" in app.success[-1].value
    spec = json.loads(next(c for c in app.get("plotly_chart") if "writer_predicted" in c.proto.id).proto.spec)
    assert [a["text"] for a in spec["layout"]["annotations"]] == ["theory (unit costs), written: bubble 33%"], \
        "no replay of 3 stages from K = 2's measured tasks"
    assert any("It has 3 stages, these settings 2: set K = 3" in i.value for i in app.info)
    small(app, stages=2, micro=6, blocks=8, recompute="off")
    assert app.text_area(key="writer_text").value == mine, "a change of M keeps the learner's text"
    assert any("Your text stays as you wrote it, for K = 2, M = 4" in i.value for i in app.info)
    app.selectbox(key="writer_preset").set_value("1f1b").run()
    assert app.text_area(key="writer_text").value.startswith("stage 0: F0 F1 B0 F2 B1"), "a preset replaces it"
    small(app, stages=3, micro=6, blocks=8, recompute="off")
    assert app.text_area(key="writer_text").value.count("stage ") == 3, "an untouched preset follows the settings"


def test_a_written_schedule_is_checked_predicted_and_run_beside_gpipe(app):
    app.run()
    small(app, stages=2, micro=4, blocks=8, recompute="off")
    assert app.text_area(key="writer_text").value == ("stage 0: F0 F1 F2 F3 B3 B2 B1 B0\n"
                                                      "stage 1: F0 F1 F2 F3 B3 B2 B1 B0")
    assert "✓ legal: makespan 15 units, bubble 20%, at most 4 micro-batches held on a stage" in \
        [s.value for s in app.success]
    app.number_input(key="writer_cap").set_value(4).run()   # KiB: the preset's GPipe holds more on stage 0
    said = [e.value for e in app.error]   # in bytes, and in the KiB the cap is typed in
    assert any(e.startswith("✗ stage 0 holds ") and " KiB) of activations after " in e and
               e.endswith("over its cap of 4096 bytes (4.0 KiB)") for e in said), said
    app.number_input(key="writer_cap").set_value(10_000).run()
    assert any(s.value.startswith("✓ within the cap of 10000 KiB on every stage: predicted peaks ")
               for s in app.success)
    app.number_input(key="writer_cap").set_value(0).run()
    app.text_area(key="writer_text").input("stage 0: F0 B0 F1 B1 F2 B2 F3 B3\nstage 1: F0 F1 B1 B0 F2 B2 F3 B3").run()
    assert "✗ the schedule deadlocks: stage 0 waits for B0 from stage 1, which waits for F1 from stage 0" in \
        [e.value for e in app.error]
    app.selectbox(key="writer_preset").set_value("zb-v").run()
    assert app.text_area(key="writer_text").value.startswith("placement: V\nstage 0: F0@0 F1@0")
    spec = json.loads(next(c for c in app.get("plotly_chart") if "writer_predicted" in c.proto.id).proto.spec)
    assert [a["text"] for a in spec["layout"]["annotations"]][0] == "theory (unit costs), written: bubble 4%"
    app.button(key="writer_run").click().run()
    assert not app.exception
    table = app.dataframe[-1].value
    assert list(table["schedule"]) == ["written", "GPipe"]
    assert all(float(cell) < 1e-5 for cell in table["largest gradient difference"]), table  # the mlp has no dropout
    assert any(c.value.endswith("from the unpipelined step.") for c in app.caption), [c.value for c in app.caption]
    for measured, predicted in zip(table["activation peak per stage (KiB)"], table["predicted from its tasks (KiB)"]):
        pairs = zip(map(int, measured.split(", ")), map(int, predicted.split(", ")))  # each R and W where it sits
        assert all(abs(p - m) <= 0.1 * m + 1 for m, p in pairs), (measured, predicted)
    spec = json.loads(next(c for c in app.get("plotly_chart") if "writer_measured" in c.proto.id).proto.spec)
    assert {t["name"] for t in spec["data"]} >= {"forward", "backward", "weight gradient"}
    small(app, stages=3, micro=3, blocks=4, recompute="off")  # ZB-V's 6 chunks, but 4 layers
    app.button(key="writer_run").click().run()
    assert not app.exception
    assert any("It cannot run on this model" in e.value and "only 4 layers" in e.value for e in app.error), \
        [e.value for e in app.error]


def test_section_9_finds_a_schedule_under_the_cap_and_runs_it_beside_the_others(app):
    """The search on the page: predicted no slower than 1F1B and ZB-H1 on this model's measured
    costs, within the cap, put into the box on a click, and run beside the built-in schedules with
    the gradients of the unpipelined step."""
    app.run()
    small(app, stages=2, micro=4, blocks=8, recompute="off")
    app.button(key="search_find").click().run()
    assert not app.exception and app.success[-1].value.startswith("found: predicted ")
    table = app.dataframe[-1].value
    assert list(table["schedule"]) == ["searched", "GPipe (fill, drain)", "1F1B", "zero bubble (ZB-H1)",
                                       "zero bubble V (ZB-V)"]
    time = dict(zip(table["schedule"], table["predicted makespan (ms)"]))
    assert time["searched"] <= min(time["1F1B"], time["zero bubble (ZB-H1)"])
    one_f_one_b = max(map(int, table["predicted activation peak per stage (KiB)"][2].split(", ")))
    app.number_input(key="writer_cap").set_value(one_f_one_b - 1).run()  # under 1F1B's peak: it no longer fits
    app.button(key="search_find").click().run()
    table = app.dataframe[-1].value
    assert list(table["within the cap"])[:3] == ["yes", "no", "no"], table
    assert max(map(int, table["predicted activation peak per stage (KiB)"][0].split(", "))) <= one_f_one_b - 1
    found = app.code[-1].value
    app.button(key="search_to_box").click().run()
    assert app.text_area(key="writer_text").value == found
    app.button(key="search_run").click().run()
    assert not app.exception
    measured = app.dataframe[-1].value
    assert list(measured["schedule"]) == ["searched", "GPipe", "1F1B", "zero bubble (ZB-H1)", "zero bubble V (ZB-V)"]
    assert all(float(cell) < 1e-5 for cell in measured["largest gradient difference"]), measured


def test_section_9_recomputes_as_written_when_asked(app):
    """With "recompute as written", the R's typed decide (here stage 0's micro-batch 0 alone, which the
    sidebar's "off" refuses): checked, run beside GPipe, with the gradients of the unpipelined step."""
    app.run()
    small(app, stages=2, micro=4, blocks=8, recompute="off")
    mine = "stage 0: F0 F1 F2 F3 B3 B2 B1 R0 B0\nstage 1: F0 F1 F2 F3 B3 B2 B1 B0"
    app.text_area(key="writer_text").input(mine).run()
    assert any("a recompute of micro-batch 0, which kept its activations under checkpoint='never'" in e.value
               for e in app.error), [e.value for e in app.error]
    app.checkbox(key="writer_as_written").check().run()
    assert any(s.value.startswith("✓ legal") for s in app.success), [s.value for s in app.success]
    assert "checkpoint 'as_written'" in app.text_area(key="writer_text").label
    app.button(key="writer_run").click().run()
    assert not app.exception
    table = app.dataframe[-1].value
    assert list(table["schedule"]) == ["written", "GPipe"]
    assert all(float(cell) < 1e-5 for cell in table["largest gradient difference"]), table
