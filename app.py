"""The GPipe lab in the browser: `streamlit run app.py`.

Every chart is drawn from the real engine running on this machine. This file only lays out the
page; the work is done by lab/ (which drives engine/).
"""
from __future__ import annotations

import sys
import time
from typing import Optional

import streamlit as st

from lab import theory  # like lab.config, no torch: see open_page
from lab.config import (
    APP_DEFAULT,
    BALANCES,
    MEASURE_WARMUP,
    PAGE_MICRO,
    PAGE_PINS,
    PAGE_SEED,
    PAGE_STAGES,
    SCHEDULE_ORDER,
    SCHEDULES,
    RunConfig,
    check,
    check_page,
    chunks_offered,
    measure_rounds,
    micro_batch_count,
)
from lab.machine.gpus import visible_gpus
from lab.schedules import writer as schedule_writer
from lab.timelines import breakdown, replay
from lab.views import charts
from lab.zoo import CARDS

RECOMPUTE = {"on, except the last micro-batch": "except_last", "on, every micro-batch": "always", "off": "never"}
TRANSPORTS = {"processes": "one process per stage (torch.distributed, gloo)", "threads": "threads in this process"}
LIVE_REDRAW_SECONDS = 0.25
BROWSER_HEAD_START_SECONDS = 2.5

st.set_page_config(page_title="GPipe lab", layout="wide")


_handed_over: dict[RunConfig, RunRecord] = {}  # a record just measured live, on its way into the cache


@st.cache_data(max_entries=200, show_spinner=False)
def measured_run(config: RunConfig) -> RunRecord:
    """One configuration, measured over `measure_rounds()` steps beside K=1 (and timed task by task for
    the ideal replay); cached."""
    record = _handed_over.pop(config, None)
    if record is None:
        record = run(config, replay=True, rounds=measure_rounds(), baseline=True, warmup=MEASURE_WARMUP,
                     pools=SHARED)
    return record


@st.cache_data(max_entries=200, show_spinner=False)
def side_run(config: RunConfig, warmup: int) -> RunRecord:
    """A configuration run only for comparison (K=1 baseline, the other recompute setting); cached."""
    return run(config, warmup=warmup, pools=SHARED)


@st.cache_data(max_entries=20, show_spinner=False)
def speedup_cells(config: RunConfig) -> list:
    return speedup.table(config.but(checkpoint=speedup.TABLE_CHECKPOINT))


@st.cache_data(max_entries=20, show_spinner=False)
def schedule_runs(config: RunConfig) -> tuple[list, list[str]]:
    """The four schedules at these settings (and why any was left out); cached."""
    skipped: list[str] = []
    runs = schedule_race.compare(config, virtual=max(2, config.virtual_stages), skipped=skipped, pools=SHARED)
    return list(runs), skipped


@st.cache_data(max_entries=20, show_spinner=False)
def time_went(config: RunConfig) -> tuple:
    """The measured run's median step and the K=1 step beside it, taken apart (lab.timelines.breakdown); the
    step's tasks are timed alone here if the run did not time them; cached."""
    record = measured_run(config)
    return breakdown.of_record(record, breakdown.alone_events(record)), breakdown.of_baseline(record)


@st.cache_data(max_entries=20, show_spinner=False)
def bubble_points(config: RunConfig) -> list:
    return speedup.bubble_points(config, pools=SHARED)


def slider(label: str, low: int, high: int, value: int, key: str) -> int:
    """A sidebar slider of whole numbers. A value the session holds for it that the slider cannot
    show (set by hand, not by moving it) is dropped first, and said so: Streamlit would raise."""
    held = st.session_state.get(key)
    if held is not None and (type(held) is not int or not low <= held <= high):
        del st.session_state[key]
        st.sidebar.warning(f"{label}: {held!r} is not one of {low} to {high}, so {value} is used")
    return st.sidebar.slider(label, low, high, value, key=key)


def controls() -> RunConfig:
    side = st.sidebar
    side.header("Pipeline")
    model = side.selectbox("model", list(CARDS), index=list(CARDS).index(APP_DEFAULT.model), key="model",
                           format_func=lambda m: f"{m}: {CARDS[m].description}")
    card = CARDS[model]
    blocks = slider(f"blocks (the model has blocks + {card.extra_layers} layers)", 1, card.page_blocks,
                    min(APP_DEFAULT.blocks, card.page_blocks), key=f"blocks-{model}")
    width = side.select_slider("width", card.page_widths, value=card.page_width, key=f"width-{model}")
    batch = side.select_slider("mini-batch N", card.page_batches, value=card.page_batch, key=f"batch-{model}")
    stages = slider("stages K", 1, PAGE_STAGES, APP_DEFAULT.stages, key="stages")
    micro = slider("micro-batches M", 1, PAGE_MICRO, APP_DEFAULT.micro_batches, key="micro")
    recompute = RECOMPUTE[side.radio("re-materialization (recompute)", list(RECOMPUTE), key="recompute")]
    schedule = side.selectbox("schedule", SCHEDULE_ORDER, key="schedule",
                              format_func=lambda name: SCHEDULES[name].label)
    offered = chunks_offered(schedule)
    virtual = (slider("chunks per stage v", offered[0], offered[-1], offered[0], key="virtual")
               if len(offered) > 1 else offered[0])
    said = {"uniform": "equal layer counts", "blocks": "equal block counts", "time": "by measured time",
            "size": "by memory"}
    balance = side.radio("balance", BALANCES, key="balance", format_func=said.get)
    gpus = visible_gpus()
    device = side.radio("stages run on", ("cpu", "cuda"), key="device", horizontal=True,
                        format_func={"cpu": "CPU cores", "cuda": f"GPUs ({gpus} here)"}.get) if gpus else "cpu"
    if device == "cuda":
        transport = "threads"
        side.caption("On GPUs every stage is a thread of this server with a CUDA stream of its own (the page can "
                     "measure them as one process per GPU too, NCCL between them)"
                     + (f"; {stages} stages share the {gpus} GPU(s) here, so measured tasks wait for each other "
                        f"and the ideal replay shows a GPU per stage." if stages > gpus else "."))
    else:
        transport = side.radio("stages run as", list(TRANSPORTS), index=list(TRANSPORTS).index(APP_DEFAULT.transport),
                               key="transport", format_func=TRANSPORTS.get,
                               help="Threads share one Python interpreter, so on small models their work barely "
                                    "overlaps; processes (one per stage, the way torchrun runs them on many "
                                    "machines) overlap fully but pay for every message between stages.")
    seed = int(side.number_input("seed", 0, PAGE_SEED, 0, key="seed"))
    return RunConfig(model=model, blocks=blocks, width=width, batch=batch, stages=stages, micro_batches=micro,
                     checkpoint=recompute, balance=balance, seed=seed, transport=transport, schedule=schedule,
                     virtual_stages=virtual, device=device)


@st.cache_resource
def measured_settings() -> set[RunConfig]:
    """The settings some session of this server has measured live: measured_run's cache holds
    their records, so another session (a second tab, a reload) shows them at once."""
    return set()


def measured(config: RunConfig) -> bool:
    return config in measured_settings()


def live_run(config: RunConfig, chart) -> RunRecord:
    """Run the configuration, unless a session of this server has run it already (then the cache
    answers at once): in `chart`, which shows the theory diagram (open_page), the warm-up step's
    Gantt chart grows as its tasks finish; the chart that stays is the median of the measured
    steps, run with nothing drawn meanwhile. Drawing happens outside the cached function, which
    must not call Streamlit elements; the finished record is handed to the cache."""
    if not measured(config):
        events, last = [], [0.0]

        def on_event(event) -> None:
            events.append(event)
            if time.perf_counter() - last[0] > LIVE_REDRAW_SECONDS:
                last[0] = time.perf_counter()
                line = replay.measured([vars_of(e) for e in events], config.stages, "warm-up step, live")
                chart.plotly_chart(charts.gantt(line), key=f"live-{len(events)}")

        waiting: list[float] = []

        def on_wait() -> None:
            waiting.append(time.perf_counter())
            chart.info("Waiting: another session is running on the shared stage processes; this run "
                       "starts as soon as that one is done.")

        _handed_over[config] = run(config, on_event=on_event, replay=True, on_wait=on_wait, rounds=measure_rounds(),
                                   baseline=True, warmup=MEASURE_WARMUP, pools=SHARED)
        chart.empty()
        if waiting:
            st.session_state.setdefault("waited", {})[config] = time.perf_counter() - waiting[0]
        measured_settings().add(config)
    return measured_run(config)


def vars_of(event) -> dict:
    return {"stage": event.stage, "micro": event.micro, "op": event.op, "start": event.start, "end": event.end}


def show_pipeline(record: RunRecord, config: RunConfig) -> None:
    st.subheader("1 · The pipeline")
    st.markdown(
        "Each row is a stage (one device); each bar a task on one micro-batch: **forward**, **recompute** "
        "(re-materialization rebuilds the activations just before the backward) and **backward**. Blank space "
        "is idle time, the *bubble*: the pipe fills at the start and drains at the end.")
    view = st.radio("timeline", ["measured", "ideal replay", "theory"], horizontal=True, key="view",
                    help="measured: as it ran here. ideal replay: the task times of this step, each timed alone, "
                         "laid out as if every stage had a device of its own. theory: unit costs, the paper's picture.")
    for note in record.notes + speedup.launch_bound_notes(record):
        st.warning(note)
    waited = st.session_state.get("waited", {}).get(config)
    if waited is not None:
        st.caption(f"This run waited its turn for {waited:.1f} s: another session was using the shared stage "
                   f"processes (one run at a time, so runs never disturb each other's timings).")
    line = replay.of_record(record, view)
    st.plotly_chart(charts.gantt(line, critical=breakdown.critical_path(line.trace) if view == "measured" else ()),
                    key="gantt")
    if record.messages and view == "measured":
        st.caption("Under each stage, its own thread's time spent on messages: encoding and handing over what it "
                   "sends (act m forward, grad m back), reading what arrived. The gap between a send and the "
                   "matching read is the message on its way, or waiting while its receiver computes.")
    if view == "measured":
        st.caption("The black line is the critical path: the chain of tasks and hand-overs that set the step's time "
                   "(each task started when the later of its stage's previous task and its input was done).")


def show_numbers(record: RunRecord, config: RunConfig) -> None:
    st.subheader("2 · Measured against theory")
    ideal = replay.of_record(record, "ideal replay")
    micro = record.micro_batches  # what torch.chunk made of M
    bubble, step, rate, speed = (record.spread(what) for what in
                                 ("bubble", "step", "samples_per_second", "speedup"))
    cols = st.columns(5)
    # under each figure a reference or a range, not a change: no arrow
    cols[0].metric("bubble", f"{bubble[0]:.0%}", f"(K-1)/(M+K-1) = {theory.bubble(config.stages, micro):.0%}",
                   delta_color="off", delta_arrow="off")
    cols[1].metric("step time", f"{step[0] * 1e3:.0f} ms", f"{step[1] * 1e3:.0f} to {step[2] * 1e3:.0f} ms",
                   delta_color="off", delta_arrow="off")
    cols[2].metric("samples/s", f"{rate[0]:,.0f}", f"{rate[1]:,.0f} to {rate[2]:,.0f}", delta_color="off",
                   delta_arrow="off")
    cols[3].metric("speedup over K=1", f"{speed[0]:.2f}x", f"{speed[1]:.2f} to {speed[2]:.2f}x", delta_color="off",
                   delta_arrow="off")
    cols[4].metric("loss", f"{record.loss:.3f}")
    unit = "GPU" if config.device == "cuda" else "core"
    st.caption(f"Medians of {len(record.rounds)} measured steps, each followed by a step of K=1 at the same M (one "
               f"stage on one {unit}, in the server's own process), so that both share this host's noise; under each "
               f"figure its range. The bubble's theory is (K-1)/(M+K-1). The ideal replay of this step (its task "
               f"times laid out as if every stage had a device of its own) takes {ideal.makespan * 1e3:.0f} ms; "
               f"the unit-cost ideal without recompute, K·M/(M+K-1), is "
               f"{theory.ideal_speedup(config.stages, micro):.2f}x.")
    if micro < 4 * config.stages:
        st.caption(f"Rule of thumb from the paper: M >= 4K, here M >= {4 * config.stages}, makes the bubble "
                   "negligible.")
    st.caption("The measured speedup can exceed K·M/(M+K-1): the K=1 step runs M small micro-batches one after "
               f"another on one {unit}, while each stage of the pipeline keeps only its own layers' weights and "
               "activations hot in its cache.")
    show_time_went(config)
    show_traffic(record, config)


def show_time_went(config: RunConfig) -> None:
    """Where the median step's time went, beside the K=1 step's, and the speedup's shortfall from K as
    the difference of the two, part by part (lab.timelines.breakdown defines the parts)."""
    step, single = time_went(config)
    stages = config.stages
    figures = [charts.waterfall(step.parts, step.step, f"Where the time went: K={stages}, median step")]
    if stages > 1:
        figures += [charts.waterfall(single.parts, single.step, "K=1 step, beside it"),
                    charts.waterfall(breakdown.shortfall(step, single, stages), step.step,
                                     f"From the K=1 step / {stages} to this step",
                                     start=(f"K=1 step / {stages}", single.step / stages))]
    for index, (column, figure) in enumerate(zip(st.columns(len(figures)), figures)):
        column.plotly_chart(figure, key=f"time_went_{index}")
    st.caption(f"Every part is measured, and the parts add up to the step. The critical stage (stage "
               f"{step.critical_stage}, the one with the most work) computes at its one-task-alone speed (the "
               "same tasks run one at a time); contention is how much "
               "slower the tasks ran beside the other stages; the schedule's bubble and unequal stages are the "
               "critical stage waiting for others' tasks; messages are hand-overs it waited for; gaps are the time "
               f"between tasks. Here the step's tasks took {step.slowdown:.0%} longer than alone. The last chart "
               f"starts from the K=1 step divided by K, a speedup of exactly K, and adds what each part costs "
               "more (or less) than its K=1 share.")


def show_traffic(record: RunRecord, config: RunConfig) -> None:
    """What the stages sent each other, and the speedup of both transports at these settings."""
    if config.stages > 1:
        cols = st.columns(3)
        share = record.spread("communication_share")
        cols[0].metric("communication share", f"{share[0]:.0%}",
                       f"{share[1]:.0%} to {share[2]:.0%}" if record.messages else "none: threads share memory",
                       delta_color="off")
        per_cut = [(b["activations"] + b["gradients"]) / 2 ** 20 for b in record.boundary_bytes]
        cols[1].metric("bytes per boundary per step", ", ".join(f"{mib:.2f} MiB" for mib in per_cut),
                       record.boundary_how, delta_color="off")
        other = "threads" if config.transport == "processes" else "processes"
        refused = refusal(config.but(transport=other))
        if refused:  # offer only what can run
            cols[2].caption(f"Stages as {other} are not offered at these settings: {refused}")
        elif cols[2].button(f"measure with {other} too", key="other_transport"):
            st.session_state.setdefault("compared", set()).add(config.but(transport=other))
        if config.but(transport=other) in st.session_state.get("compared", set()):
            runs = {config.transport: record, other: measured_run(config.but(transport=other))}
            st.dataframe([{"stages run as": name, "step (ms)": round(r.spread("step")[0] * 1e3, 1),
                           "speedup over K=1 (same M)": round(r.spread("speedup")[0], 2),
                           "speedup range": "{1:.2f} to {2:.2f}".format(*r.spread("speedup")),
                           "communication share": f"{r.spread('communication_share')[0]:.0%}"}
                          for name, r in runs.items()], hide_index=True)
        params = sum(m["param_bytes"] for m in record.memory)
        st.plotly_chart(charts.boundary_chart(record.boundary_bytes, record.boundary_how, params, config.stages),
                        key="boundary")


def refusal(config: RunConfig) -> Optional[str]:
    """Why a configuration cannot run (lab.config.check's message), or None if it can."""
    try:
        check(config)
    except ValueError as error:
        return str(error)
    return None


def task_seconds(record: RunRecord, op: str = None) -> float:
    """Stage time a step's tasks took, all of them or those of one op."""
    return sum(e["end"] - e["start"] for e in record.events if op is None or e["op"] == op)


def show_memory(record: RunRecord, config: RunConfig) -> None:
    st.subheader("3 · Memory: what re-materialization trades")
    st.markdown(
        "Without recompute a stage keeps every layer's activations for all M micro-batches in flight. "
        "With it, a stage keeps only each micro-batch's input and rebuilds one micro-batch's activations "
        "at a time: activation memory drops from O(N·L) to O(N + (L/K)·(N/M)). The bars are peaks measured "
        "from the tensors autograd saved; the dashes are the formula (GPipe's order), fed with per-layer sizes "
        "measured on one micro-batch, or for a later schedule its own task lists replayed, where each R and W "
        "sits changing what a stage holds.")
    # memory needs no warm-up: the other recompute setting is one cheap extra step
    if record.config["checkpoint"] == "never":
        never, recomputed = record, side_run(config.but(checkpoint="always"), warmup=0)
    else:
        never, recomputed = side_run(config.but(checkpoint="never"), warmup=0), record
    rows = [{"measured_never": a["activation_peak_bytes"], "measured_recompute": b["activation_peak_bytes"],
             "predicted_never": a["predicted_activation_bytes"], "predicted_recompute": b["predicted_activation_bytes"]}
            for a, b in zip(never.memory, recomputed.memory)]
    st.plotly_chart(charts.memory_chart(rows, f"Activation memory per stage: recompute off vs "
                                              f"{recomputed.config['checkpoint']}", config.schedule), key="memory")
    extra = task_seconds(recomputed, "R")
    st.caption(f"The price: about one more forward per micro-batch and stage. Here the recomputes took "
               f"{extra * 1e3:.0f} ms, {extra / max(task_seconds(never, 'F'), 1e-9):.1f}x the forwards of the step "
               f"without recompute and {extra / max(task_seconds(recomputed), 1e-9):.0%} of all the work of the step "
               f"with it; a stage can recompute while the gradient is still on its way from the next one.")


def show_bubble(record: RunRecord, config: RunConfig) -> None:
    st.subheader("4 · More micro-batches, smaller bubble")
    micro, bubble, how = speedup.bubble_point(record)
    points, label = [(micro, bubble)], f"this host, {how}"
    if st.button("measure the curve at M = 1, 2, 4, ... 32", key="measure_bubble"):
        measured = bubble_points(config)
        points, label = [(m, b) for m, b, _ in measured], f"this host, {measured[0][2]}"
    st.plotly_chart(charts.bubble_curve(config.stages, points, label=label), key="bubble")


def show_speedup(config: RunConfig) -> None:
    st.subheader("5 · The paper's Table 2 beside this host")
    st.markdown(
        "Training throughput on TPUs from the paper (Huang et al., Table 2). There is no one-device column: each "
        "model's cells are divided by its own K = 2, M = 1 cell. With one micro-batch, more devices barely help; "
        "with 32, the Transformer, whose layers are alike, scales almost with K, while AmoebaNet's uneven layers "
        "hold it back. How the cells compare with the lab's unit-cost model: " + theory.why_cells_exceed() + ".")
    st.dataframe(tables.paper_table(), width="stretch")
    st.caption("Table 3 of the paper, P100 GPUs without NVLink (M = 32, normalized to K = 2): activations cross "
               "through host memory over PCIe, yet scaling stays close to the TPUs', since only each cut's "
               "activations cross.")
    st.dataframe(tables.paper_table3(), width="stretch")
    if st.button("measure this table on this host (K = 1, 2, 4, 8; M = 1, 4, 32)", key="measure_speedup"):
        cells = speedup_cells(config)
        st.caption("This host on the paper's normalization (vs its own K = 2, M = 1) and, separately, over one "
                   f"device; every micro-batch recomputed (checkpoint '{speedup.TABLE_CHECKPOINT}'), as in the "
                   "paper. Cells with a core (or GPU) per stage are measured; the others are ideal replays of task "
                   "times measured one at a time, and say so.")
        st.dataframe(tables.speedup_table(c for c in cells if c.stages > 1), width="stretch", hide_index=True)


def show_schedules(config: RunConfig) -> None:
    st.subheader("6 · The schedules that came after GPipe")
    st.markdown(
        "The same step in four task orders, on one time axis: **GPipe** (all forwards, then all backwards), "
        "**1F1B** (a backward as soon as possible: same time, fewer micro-batches held), **interleaved 1F1B** "
        "(each stage holds v chunks of layers, so the fill and drain pass through smaller pieces) and **zero "
        "bubble ZB-H1** (each backward split into B, the gradient sent upstream, and W, the weights' gradient, "
        "deferred into what would be the drain).")
    if not st.button("compare the four schedules at these settings", key="compare_schedules"):
        return
    runs, skipped = schedule_runs(config)
    for reason in skipped:
        st.warning(f"Left out: {reason}")
    if not runs:
        return
    st.plotly_chart(charts.stacked_gantt([r.timeline for r in runs],
                                         [f"{r.schedule} ({r.how}): bubble {r.timeline.bubble:.0%}" for r in runs]),
                    key="schedules_gantt")
    st.dataframe([{"schedule": r.schedule + (f", v={r.virtual}" if r.virtual > 1 else ""), "how": r.how,
                   "bubble": f"{r.timeline.bubble:.0%}", "bubble, theory": f"{r.theory_bubble:.0%}",
                   "makespan (ms)": round(r.timeline.makespan * 1e3, 1),
                   "activation peak per stage (KiB)": ", ".join(f"{p / 1024:.0f}" for p in r.peaks),
                   "predicted (KiB)": ", ".join(f"{m['predicted_activation_bytes'] / 1024:.0f}"
                                                for m in r.record.memory),
                   "micro-batches held, theory": ", ".join(f"{n:g}" for n in r.theory_in_flight())}
                  for r in runs], hide_index=True)


def show_compare(record: RunRecord, config: RunConfig) -> None:
    st.subheader("7 · Compare runs")
    pinned = st.session_state.setdefault("pinned", [])
    left, right = st.columns([1, 4])
    if left.button("pin this run", key="pin"):
        pinned.append((f"K={config.stages}, M={config.micro_batches}, {config.checkpoint}, {config.model}, "
                       f"{config.transport}" + ("" if config.schedule == "gpipe" else f", {config.schedule}"),
                       record))
        del pinned[:-PAGE_PINS]
    if pinned and left.button("clear pins", key="clear_pins"):
        pinned.clear()
    right.caption(f"Pin runs with different settings (say M = 1 and M = 16) to see them side by side (the last "
                  f"{PAGE_PINS} are kept).")
    for start in range(0, len(pinned), 2):
        for index, column, (label, pinned_record) in zip(range(start, start + 2), st.columns(2),
                                                         pinned[start:start + 2]):
            column.plotly_chart(charts.gantt(replay.of_record(pinned_record, "measured"), title=label),
                                key=f"pin-{index}-{label}")  # the same run may be pinned twice
            column.caption(f"medians: bubble {pinned_record.spread('bubble')[0]:.0%} · step "
                           f"{pinned_record.spread('step')[0] * 1e3:.0f} ms · "
                           f"{pinned_record.spread('samples_per_second')[0]:,.0f} samples/s · speedup over K=1 "
                           f"{pinned_record.spread('speedup')[0]:.2f}x")


def show_downloads(record: RunRecord) -> None:
    st.subheader("8 · Take the trace with you")
    left, right = st.columns(2)
    # on_click="ignore": a download is no reason to rerun the page (a rerun replaced the files being fetched)
    left.download_button("trace as Chrome-trace JSON (opens in ui.perfetto.dev)", record.chrome_trace(),
                         file_name="gpipe-trace.json", mime="application/json", on_click="ignore")
    right.download_button("events as CSV", record.events_csv(), file_name="gpipe-events.csv", mime="text/csv",
                          on_click="ignore")


def show_writer(record: RunRecord, config: RunConfig) -> None:
    st.subheader("9 · Write your own schedule")
    st.markdown(
        "One line of tasks per stage, each stage running its line in order: **F3** forward of micro-batch 3, "
        "**R3** its recompute, **B3** its backward, **W3** its weights' gradient when W is split off; with "
        "several chunks of layers per stage, **F3@5** names chunk 5, and a line `placement: V` (or `loop`, or "
        "one stage per chunk) says where the chunks are. torch.distributed.pipelining's actions (`1F0,1I0`) "
        "read too. Every edit is checked by the engine; **run it** runs a step of it beside GPipe's.")
    micro = micro_batch_count(config)
    left, right = st.columns([1, 3])
    name = left.selectbox("start from", schedule_writer.PRESETS, key="writer_preset")
    load_preset(left, name, config, micro)
    as_written = left.checkbox("recompute as written", key="writer_as_written",
                               help="The R's you write decide which micro-batches each stage recomputes (any of "
                                    "them, on any stage). Off: they must match the sidebar's recompute setting.")
    mode = "as_written" if as_written else config.checkpoint
    text = right.text_area(f"the schedule (K = {config.stages}, M = {micro}, checkpoint '{mode}')",
                           key="writer_text", max_chars=schedule_writer.MAX_CHARS,
                           height=box_height(st.session_state.get("writer_text", ""), config.stages))
    st.session_state["writer_saved"] = text
    verdict = schedule_writer.examine(text, micro, mode)
    (st.success if verdict.legal else st.error)(verdict.line)
    if verdict.legal and show_predicted(verdict, record, config):
        run_written(left, verdict, config, mode)


def load_preset(left, name: str, config: RunConfig, micro: int) -> None:
    """Put the preset's text in section 9's box when the preset or the settings change, unless the
    learner edited the preset's text: then it stays, and the page says so."""
    wanted, before = (name, config.stages, micro, config.checkpoint), st.session_state.get("writer_for")
    if "writer_text" not in st.session_state and "writer_saved" in st.session_state:  # a run that failed drew no
        st.session_state["writer_text"] = st.session_state["writer_saved"]             # box, and Streamlit forgot it
    if before == wanted:
        return
    st.session_state["writer_for"] = wanted
    edited = st.session_state.get("writer_text") != st.session_state.get("writer_preset_text")
    if before is not None and before[0] == name and edited:
        left.info(f"Your text stays as you wrote it, for K = {before[1]}, M = {before[2]}; pick a preset to "
                  f"start again from one at these settings.")
        return
    try:
        st.session_state["writer_text"] = st.session_state["writer_preset_text"] = schedule_writer.preset(
            name, config.stages, micro, config.checkpoint)
    except ValueError as error:
        left.warning(f"{name} at these settings: {error}")


def show_predicted(verdict, record: RunRecord, config: RunConfig) -> bool:
    """A legal schedule's unit-cost diagram and, where it has this setting's K, its replay on the
    measured tasks; whether it has (then it can run)."""
    fits = len(verdict.schedule) == config.stages
    predicted = [schedule_writer.unit_cost(verdict.schedule)]
    if fits:
        messages = schedule_writer.message_seconds(record.messages)
        predicted.append(schedule_writer.replayed(verdict.schedule, record.solo_events or record.events,
                                                  config.virtual_stages, messages))
    st.plotly_chart(charts.stacked_gantt(predicted, [f"{line.label}: bubble {line.bubble:.0%}" for line in predicted]),
                    key="writer_predicted")
    if not fits:
        st.info(f"It has {len(verdict.schedule)} stages, these settings {config.stages}: set K = "
                f"{len(verdict.schedule)} in the sidebar to replay it on measured tasks and run it.")
    return fits


def run_written(left, verdict, config: RunConfig, mode: str) -> None:
    """The cap's line, if one is typed, and on "run it" a real step of the schedule beside GPipe's."""
    cap = left.number_input("activation cap per stage (KiB; 0: none)", min_value=0, value=0, step=16,
                            key="writer_cap")
    if cap:
        line = schedule_writer.cap_line(config, verdict.schedule, cap * 1024)
        (st.success if line.startswith("✓") else st.error)(line)
    if not st.button("run it", key="writer_run"):
        return
    try:
        runs = schedule_writer.run_beside_gpipe(config, verdict.schedule, checkpoint=mode)
    except ValueError as error:  # e.g. more chunks than the model has layers
        st.error(f"It cannot run on this model: {error}")
        return
    show_runs(runs, "writer_measured")


WRAP_CHARS, ROW_PIXELS, MOST_PIXELS = 90, 25, 560   # a box row holds 90 characters or more on a laptop's screen


def box_height(text: str, stages: int) -> int:
    """Pixels for section 9's box: every line of the text, as wrapped (a placement line included),
    and a row more for the character counter under the last one; at most MOST_PIXELS (then it scrolls)."""
    rows = sum(-(-max(len(line), 1) // WRAP_CHARS) for line in text.splitlines()) if text else stages
    return min(40 + ROW_PIXELS * (max(rows, stages) + 1), MOST_PIXELS)


def show_runs(runs: list, key: str) -> None:
    """Schedules run side by side: their measured timelines, peaks and gradients."""
    st.plotly_chart(charts.stacked_gantt([r.timeline for r in runs],
                                         [f"{r.timeline.label}: bubble {r.timeline.bubble:.0%}" for r in runs]),
                    key=key)
    st.dataframe([{"schedule": r.label, "makespan (ms)": round(r.timeline.makespan * 1e3, 1),
                   "activation peak per stage (KiB)": ", ".join(f"{p / 1024:.0f}" for p in r.peaks),
                   "predicted from its tasks (KiB)": ", ".join(f"{p / 1024:.0f}" for p in r.predicted_peaks),
                   "largest gradient difference": schedule_writer.gradients_cell(r)} for r in runs], hide_index=True)
    st.caption(schedule_writer.gradients_caption(runs))


def show_search(config: RunConfig) -> None:
    """Section 9's search: a schedule found for these settings' measured costs under the cap, its
    predictions beside the built-in schedules', then all of them run in the same rounds."""
    st.markdown("**Or let the lab find one.** It times this model's F, B and W on each stage, then searches "
                "the orders of tasks (W split off or not, no recompute) for the fastest whose predicted "
                "activations stay under the cap above: every order where K and M are small, the zero-bubble "
                "paper's kind of heuristic beyond.")
    cap = st.session_state.get("writer_cap", 0)
    wanted = (config, cap)
    if st.button("find a schedule", key="search_find"):
        try:
            st.session_state["search_found"] = (wanted, *schedule_search.find(config, cap * 1024 or None))
        except ValueError as error:
            st.error(f"No schedule fits: {error}")
            return
    if st.session_state.get("search_found", (None,))[0] != wanted:
        return
    _, found, rows = st.session_state["search_found"]
    st.success(f"found: predicted {found.makespan * 1e3:.2f} ms ({found.how})")
    st.dataframe([{"schedule": r.label, "predicted makespan (ms)": round(r.makespan * 1e3, 2),
                   "predicted activation peak per stage (KiB)": ", ".join(f"{p / 1024:.0f}" for p in r.peaks),
                   "within the cap": "yes" if r.fits else "no"} for r in rows], hide_index=True)
    text = schedule_writer.format(found.schedule)
    st.code(text, language=None)
    st.button("put it in the box above", key="search_to_box", on_click=put_in_box, args=(text,))
    if st.button("run them side by side", key="search_run"):
        runs = schedule_writer.run_beside_gpipe(config.but(checkpoint="never"), found.schedule, rounds=3,
                                                also=tuple(r.name for r in rows[1:]), called="searched")
        show_runs(runs, "search_measured")
        st.caption(compare_rounds({r.label: list(r.steps) for r in runs}).line)


def put_in_box(text: str) -> None:
    """Load a found schedule into section 9's text box (before the box is drawn again)."""
    st.session_state["writer_text"] = text


def open_page() -> tuple[Optional[RunConfig], object]:
    """The title, the controls and, for a setting this server has not measured yet, the theory
    diagram in the chart's place. None of it needs torch, which takes seconds to load on a cold
    server: a learner sees all this at once. Returns the setting (None if it cannot run) and the chart."""
    st.title("GPipe lab")
    st.markdown(
        "Cut a model into **K** stages, one per device, split each mini-batch into **M** micro-batches and stream "
        "them through: that is GPipe. Move the sliders; every chart below comes from the real pipeline engine "
        "running on this machine.")
    config = controls()
    try:
        check(config)
        check_page(config)  # whatever the request said, nothing beyond the controls' ranges runs
        measure_rounds()  # GPIPE_LAB_ROUNDS, if set, must be a number of rounds
    except ValueError as error:
        st.error(f"This combination cannot run: {error}")
        return None, None
    chart = st.empty()
    if not measured(config):
        sketch = replay.unit_cost(config.stages, micro_batch_count(config), config.checkpoint, schedule=config.schedule,
                               virtual=config.virtual_stages)
        # an SVG, not Plotly: the browser draws it before it has loaded Plotly's script (seconds here)
        chart.markdown(charts.gantt_svg(sketch, f"{sketch.label}: measuring this host now..."), unsafe_allow_html=True)
    return config, chart


def main(config: Optional[RunConfig], chart) -> None:
    if config is None:
        return
    if config.transport == "processes":  # start them while the warm-up runs
        processes.start_ahead(config.stages, config.threads_per_stage, config.device)
    try:
        record = live_run(config, chart)
        show_pipeline(record, config)
        show_numbers(record, config)
        show_memory(record, config)
        show_bubble(record, config)
        show_speedup(config)
        show_schedules(config)
        show_compare(record, config)
        show_downloads(record)
        show_writer(record, config)
        show_search(config)
    except StageProcessError as error:
        st.error(f"A stage process stopped: {error}. The next run starts new stage processes.")
    except (RuntimeError, MemoryError) as error:
        st.error(f"The run failed: {error}. Try a smaller model, batch or K.")
    except ValueError as error:  # what the host refuses (lab.config.check said the rest before the run)
        st.error(f"This host cannot run it: {error}")


opening = open_page()
if "torch" not in sys.modules:
    # This server's first page: torch is about to load here and in the stage processes, seconds of
    # CPU and of this process's interpreter lock. Give the browser a head start to fetch and draw
    # the theory diagram first (on 2 cores the diagram then shows after ~6 s instead of ~8 s).
    time.sleep(BROWSER_HEAD_START_SECONDS)
# Only now the engine and torch load (seconds, the first time this server runs the page).
from lab.processes import shared as processes  # noqa: E402
from lab.processes.shared import StageProcessError  # noqa: E402
from lab.processes.sources import SHARED  # noqa: E402  (every session's runs share one pool)
from lab.runs.experiments import RunRecord, run  # noqa: E402
from lab.schedules import race as schedule_race  # noqa: E402
from lab.schedules import search as schedule_search  # noqa: E402
from lab.studies import speedup  # noqa: E402
from lab.timelines.verdict import compare as compare_rounds  # noqa: E402
from lab.views import tables  # noqa: E402

main(*opening)
