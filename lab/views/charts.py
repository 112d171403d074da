"""Plotly figures shared by the app and the notebooks. Every builder returns a go.Figure whose
data says what it shows (traces named by what they are), so tests can read the figure back."""
from __future__ import annotations

from html import escape
from typing import Iterable, Optional, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from lab import theory
from lab.timelines.replay import Timeline

OPS = {"F": ("forward", "#4C78A8"), "R": ("recompute", "#F58518"), "B": ("backward", "#54A24B"),
       "W": ("weight gradient", "#72B7B2")}
MIB = 2 ** 20


def stage_names(stages: int) -> list[str]:
    return [f"stage {k}" for k in range(stages)]


MESSAGES = {"send": ("sending", "#B279A2"), "receive": ("receiving", "#9E765F")}
ALL_REDUCE = "#E45756"


def message_row(stage: int) -> str:
    return f"stage {stage} · messages"


def gantt(timeline: Timeline, title: Optional[str] = None, height: Optional[int] = None,
          critical: Sequence = ()) -> go.Figure:
    """Per-stage Gantt chart: one horizontal-bar trace per op (forward, recompute, backward, weight
    gradient), each bar labelled with its micro-batch (and "@chunk" when stages hold several chunks);
    empty stretches are the idle time (the bubble). When the stages were processes, a row under
    each stage shows its thread sending and reading messages ("act 3" forward, "grad 3" back);
    with replicas, an "all-reduce" bar after each stage's last task shows its gradients' sum.
    `critical`, the pieces of a critical path (lab.timelines.breakdown.critical_path), is drawn over the bars
    as one line (critical_path_line), near their top edge, clear of the labels in their middle."""
    scale = 1000.0 if timeline.unit == "s" else 1.0
    unit = "ms" if timeline.unit == "s" else timeline.unit
    figure = go.Figure(task_bars(timeline, scale, unit) + message_bars(timeline, scale, unit)
                       + reduction_bars(timeline, scale, unit))
    rows = stage_names(timeline.stages)
    if timeline.messages:
        rows = [row for k in range(timeline.stages) for row in (f"stage {k}", message_row(k))]
    default_title = (f"{timeline.label}: makespan {timeline.makespan * scale:.1f} {unit}, "
                     f"bubble {timeline.bubble:.0%}")
    if critical:  # on a hidden numeric axis laid over the rows, so that it can sit above a row's middle
        figure.add_trace(critical_path_line(critical, rows[::-1], scale, unit))
        figure.update_layout(yaxis2=dict(overlaying="y", range=[-0.5, len(rows) - 0.5], visible=False))
    figure.update_layout(
        title=title or default_title, barmode="overlay", bargap=0.25, legend_title_text="task", uniformtext=LABELS,
        xaxis_title=f"time ({unit})", height=height or 120 + 40 * len(rows),
        yaxis=dict(categoryorder="array", categoryarray=rows[::-1], range=[-0.5, len(rows) - 0.5]),
        margin=dict(l=10, r=10, t=50, b=40))
    return figure


LABELS = dict(minsize=9, mode="hide")  # a bar's label too long for its bar is left out, not shrunk unreadable:
                                      # its hover still names the micro-batch and chunk


def task_bars(timeline: Timeline, scale: float, unit: str) -> list[go.Bar]:
    """One bar trace per op of the stages' tasks, each bar labelled with its micro-batch (and "@chunk"
    where stages hold several chunks)."""
    chunked = any(b.chunk != b.stage for b in timeline.bars)
    traces = []
    for op, (name, color) in OPS.items():
        bars = [b for b in timeline.bars if b.op == op]
        if bars:
            traces.append(go.Bar(
                name=name, orientation="h", marker_color=color, marker_line_width=0.5, marker_line_color="white",
                y=[f"stage {b.stage}" for b in bars], base=[b.start * scale for b in bars],
                x=[(b.end - b.start) * scale for b in bars],
                text=[f"{b.micro}@{b.chunk}" if chunked else str(b.micro) for b in bars],
                customdata=[[b.micro, b.chunk] for b in bars], textposition="inside", insidetextanchor="middle",
                hovertemplate=f"{name} of micro-batch %{{customdata[0]}}, chunk %{{customdata[1]}}<br>"
                              f"%{{base:.2f}}, %{{x:.2f}} {unit} long<extra>%{{y}}</extra>"))
    return traces


def message_bars(timeline: Timeline, scale: float, unit: str) -> list[go.Bar]:
    """A stage thread sending and reading messages, on a row under its stage (stages as processes)."""
    traces = []
    for direction, (name, color) in MESSAGES.items():
        sent = [m for m in timeline.messages if m.direction == direction]
        if sent:
            traces.append(go.Bar(
                name=name, orientation="h", marker_color=color, y=[message_row(m.stage) for m in sent],
                base=[m.start * scale for m in sent], x=[max(m.end - m.start, 0.0) * scale for m in sent],
                text=[f"{m.kind} {m.micro}" for m in sent], customdata=[[m.peer, m.bytes] for m in sent],
                textposition="inside", insidetextanchor="middle",
                hovertemplate=f"{name} %{{text}} (peer stage %{{customdata[0]}}, %{{customdata[1]:,}} bytes)<br>"
                              f"%{{base:.2f}}, %{{x:.3f}} {unit} long<extra>%{{y}}</extra>"))
    return traces


def reduction_bars(timeline: Timeline, scale: float, unit: str) -> list[go.Bar]:
    """With replicas, each stage's all-reduce of its gradients, after its last task."""
    reductions = timeline.reductions
    if not reductions:
        return []
    return [go.Bar(
        name="all-reduce", orientation="h", marker_color=ALL_REDUCE, y=[f"stage {r.stage}" for r in reductions],
        base=[r.start * scale for r in reductions], x=[max(r.end - r.start, 0.0) * scale for r in reductions],
        text=["all-reduce"] * len(reductions), customdata=[[r.bytes] for r in reductions],
        textposition="inside", insidetextanchor="middle",
        hovertemplate=f"gradients all-reduced with the replicas' same stage, %{{customdata[0]:,}} bytes<br>"
                      f"%{{base:.2f}}, %{{x:.3f}} {unit} long<extra>%{{y}}</extra>")]


ABOVE_THE_LABELS = 0.28  # of a row's height, from its middle: inside a bar (bargap 0.25: 0.375 high), over its label


def critical_path_line(pieces: Sequence, rows: Sequence[str], scale: float = 1000.0, unit: str = "ms") -> go.Scatter:
    """The critical path as one line over a Gantt chart: along each of its tasks on that task's
    stage row (`rows`, bottom up: the row's position on the axis "y2", a little above its middle),
    jumping rows where a hand-over carried an activation or a gradient to the next stage. Its
    points say what each piece was (task, hand-over, gap), on which stage, and how long it took."""
    x, y, text = [], [], []
    for piece in pieces:
        if piece.kind == "start":
            continue
        what = (f"{OPS[piece.event.op][0]} {piece.event.micro}" if piece.kind == "task" else piece.kind)
        for at in (piece.start, piece.end):
            x.append(at * scale)
            y.append(rows.index(f"stage {piece.stage}") + ABOVE_THE_LABELS)
            text.append(f"stage {piece.stage}: {what}, {(piece.end - piece.start) * scale:.2f} {unit}")
    return go.Scatter(name="critical path", x=x, y=y, text=text, mode="lines", line=dict(color="#222", width=2.5),
                      yaxis="y2", hovertemplate="critical path, %{text}<extra></extra>")


WATERFALL_COLORS = {"increasing": "#E45756", "decreasing": "#54A24B", "totals": "#4C78A8"}


def waterfall(parts: dict[str, float], step: float, title: str, start: Optional[tuple[str, float]] = None) -> go.Figure:
    """Where a step's time went, as a waterfall: one bar per part (seconds in `parts`, shown in ms)
    climbing to a last bar, the measured `step`. With `start`, (name, seconds), the climb begins
    from that bar instead of 0 and a part may be negative (it shortened the step)."""
    names = ([start[0]] if start else []) + list(parts) + ["measured step"]
    values = ([start[1]] if start else []) + list(parts.values()) + [step]
    measures = (["absolute"] if start else []) + ["relative"] * len(parts) + ["total"]
    figure = go.Figure(go.Waterfall(
        name="where the time went", x=names, y=[v * 1e3 for v in values], measure=measures,
        text=[f"{v * 1e3:+.1f}" if m == "relative" and start else f"{v * 1e3:.1f}" for v, m in zip(values, measures)],
        textposition="outside", connector=dict(line=dict(color="#999", width=1)),
        increasing=dict(marker_color=WATERFALL_COLORS["increasing"]),
        decreasing=dict(marker_color=WATERFALL_COLORS["decreasing"]),
        totals=dict(marker_color=WATERFALL_COLORS["totals"]),
        hovertemplate="%{x}: %{y:.2f} ms<extra></extra>"))
    figure.update_layout(title=title, yaxis_title="ms", showlegend=False, margin=dict(l=10, r=10, t=50, b=40))
    return figure


def stacked_gantt(timelines: Sequence[Timeline], titles: Sequence[str]) -> go.Figure:
    """Several Gantt charts, one under the other, so that schedules of the same step compare at a
    glance; one legend for all. Timelines in one unit share one time axis (same scale); in several
    (unit costs beside milliseconds) each keeps its own, labelled with its unit."""
    units = ["ms" if line.unit == "s" else line.unit for line in timelines]
    shared = len(set(units)) <= 1
    height = 80 + sum((60 if shared else 100) + 34 * line.stages for line in timelines)
    margin = dict(l=10, r=10, t=50, b=40)
    # room for the next title (and, on its own axis, the tick labels and axis title above it), in pixels of
    # the plotting area: a subplot's spacing is a share of the height left inside the margins
    gap = (40 if shared else 90) / (height - margin["t"] - margin["b"])
    figure = make_subplots(rows=len(timelines), cols=1, shared_xaxes=shared, subplot_titles=list(titles),
                           vertical_spacing=min(gap, 0.9 / max(len(timelines) - 1, 1)))
    shown: set[str] = set()
    for row, line in enumerate(timelines, start=1):
        single = gantt(line)
        for trace in single.data:
            trace.legendgroup, trace.showlegend = trace.name, trace.name not in shown
            shown.add(trace.name)
            figure.add_trace(trace, row=row, col=1)
        figure.update_yaxes(categoryorder="array", categoryarray=single.layout.yaxis.categoryarray, row=row, col=1)
    figure.update_layout(barmode="overlay", bargap=0.25, legend_title_text="task", height=height, margin=margin,
                         uniformtext=LABELS)
    for row, unit in enumerate(units, start=1):
        if row == len(units) or not shared:
            figure.update_xaxes(title_text=f"time ({unit})", row=row, col=1)
    return figure


def boundary_chart(boundary_bytes: Sequence[dict], how: str, param_bytes: int, stages: int) -> go.Figure:
    """What crossed each cut between stages in one step (activations forward, gradients back),
    beside what data parallelism on K devices would all-reduce per device for the same model:
    every gradient, 2(K-1)/K times over in a ring."""
    cuts = [f"stage {b['stages'][0]} → stage {b['stages'][1]}" for b in boundary_bytes]
    figure = go.Figure()
    figure.add_trace(go.Bar(name=f"activations forward ({how})", x=cuts,
                            y=[b["activations"] / MIB for b in boundary_bytes], marker_color="#4C78A8"))
    figure.add_trace(go.Bar(name=f"gradients back ({how})", x=cuts,
                            y=[b["gradients"] / MIB for b in boundary_bytes], marker_color="#54A24B"))
    all_reduce = param_bytes * 2 * (stages - 1) / stages
    figure.add_trace(go.Bar(name=f"data parallel, K={stages}: all-reduce per device", x=["data parallel"],
                            y=[all_reduce / MIB], marker_color="#E45756"))
    figure.update_layout(title="What crosses per step: the pipeline's cuts vs data parallelism's all-reduce",
                         barmode="group", yaxis_title="MiB per step", margin=dict(l=10, r=10, t=50, b=40))
    return figure


def memory_chart(rows: Sequence[dict], title: str = "Activation memory per stage",
                 schedule: str = "gpipe") -> go.Figure:
    """Measured activation peaks per stage without and with recompute, and the predicted values: GPipe's
    formula, or for a later `schedule` its own task lists replayed (lab.runs.schedule_memory).

    `rows` has one dict per stage with keys measured_never, measured_recompute, predicted_never,
    predicted_recompute (bytes)."""
    names = stage_names(len(rows))
    figure = go.Figure()
    for key, name, color in (("measured_never", "measured, no recompute", "#9D755D"),
                             ("measured_recompute", "measured, recompute", "#F58518")):
        figure.add_trace(go.Bar(name=name, x=names, y=[r[key] / MIB for r in rows], marker_color=color))
    labels = (("formula N*(input + L/K layers)", "formula N*input + (L/K)(N/M) layers") if schedule == "gpipe" else
              (f"{schedule}'s tasks replayed, no recompute", f"{schedule}'s tasks replayed, recompute"))
    for key, name in zip(("predicted_never", "predicted_recompute"), labels):
        figure.add_trace(go.Scatter(name=name, x=names, y=[r[key] / MIB for r in rows], mode="markers",
                                    marker=dict(symbol="line-ew-open", size=40, line_width=3, color="#333")))
    figure.update_layout(title=title, barmode="group", yaxis_title="MiB", margin=dict(l=10, r=10, t=50, b=40))
    return figure


def bubble_curve(stages: int, points: Iterable[tuple[int, float]] = (), max_micro_batches: int = 64,
                 label: str = "measured") -> go.Figure:
    """The bubble (K-1)/(M+K-1) against M, with measured points and the M = 4K rule marked."""
    ms = list(range(1, max_micro_batches + 1))
    figure = go.Figure(go.Scatter(name=f"theory (K-1)/(M+K-1), K={stages}", x=ms,
                                  y=[theory.bubble(stages, m) for m in ms], mode="lines"))
    points = list(points)
    if points:
        figure.add_trace(go.Scatter(name=label, x=[m for m, _ in points], y=[b for _, b in points],
                                    mode="markers", marker=dict(size=11, color="#E45756")))
    rule = theory.micro_batches_for_small_bubble(stages)
    figure.add_vline(x=rule, line_dash="dot", annotation_text=f"M = 4K = {rule}")
    figure.update_layout(title=f"Bubble fraction vs micro-batches (K={stages})", xaxis_title="M (micro-batches)",
                         yaxis_title="bubble", yaxis_tickformat=".0%", yaxis_range=[0, 1],
                         margin=dict(l=10, r=10, t=50, b=40))
    return figure


def lines(series: dict[str, Sequence[float]], title: str, x_title: str, y_title: str,
          x: Optional[Sequence] = None) -> go.Figure:
    """One line per named series (loss curves, memory against model size, ...)."""
    figure = go.Figure()
    for name, values in series.items():
        figure.add_trace(go.Scatter(name=name, x=list(x) if x is not None else list(range(len(values))),
                                    y=list(values), mode="lines+markers"))
    figure.update_layout(title=title, xaxis_title=x_title, yaxis_title=y_title, margin=dict(l=10, r=10, t=50, b=40))
    return figure


def gantt_svg(timeline: Timeline, title: str, width: int = 900) -> str:
    """The same Gantt chart as `gantt`, as a self-contained SVG string: what the app draws first,
    before the browser has loaded Plotly's script (seconds on a small laptop). One row per stage,
    a bar per task coloured as in `gantt` and labelled with its micro-batch; no interaction."""
    left, top, row, bottom = 70, 34, 30, 26
    height = top + row * timeline.stages + bottom
    span = max(timeline.makespan, 1e-12)
    scale = (width - left - 12) / span
    parts = [f'<svg class="gantt-sketch" xmlns="http://www.w3.org/2000/svg" width="100%" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}" font-family="sans-serif">',
             f'<text x="{left}" y="20" font-size="15">{escape(title)}</text>']
    for stage in range(timeline.stages):
        y = top + row * stage
        parts.append(f'<text x="{left - 8}" y="{y + row / 2 + 4}" font-size="12" text-anchor="end">'
                     f'stage {stage}</text>')
    for bar in timeline.bars:
        name, color = OPS[bar.op]
        x, y, w = left + bar.start * scale, top + row * bar.stage + 3, max((bar.end - bar.start) * scale, 1.0)
        parts.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row - 6}" fill="{color}" stroke="white">'
                     f'<title>{name} of micro-batch {bar.micro}</title></rect>')
        if w > 14:
            parts.append(f'<text x="{x + w / 2:.1f}" y="{y + row / 2 + 1}" font-size="11" fill="white" '
                         f'text-anchor="middle">{bar.micro}</text>')
    parts.append(f'<text x="{left}" y="{height - 6}" font-size="12">time ({timeline.unit}): makespan '
                 f'{timeline.makespan:g}, bubble {timeline.bubble:.0%}'
                 f'{" (its recomputes fill some of it)" if any(b.op == "R" for b in timeline.bars) else ""}</text>')
    x = width - 12 - 110 * len({bar.op for bar in timeline.bars})
    for op, (name, color) in OPS.items():  # the legend, in the order of `gantt`'s traces
        if any(bar.op == op for bar in timeline.bars):
            parts.append(f'<rect x="{x}" y="{height - 16}" width="12" height="12" fill="{color}"/>'
                         f'<text x="{x + 16}" y="{height - 6}" font-size="12">{name}</text>')
            x += 110
    return "".join(parts) + "</svg>"
