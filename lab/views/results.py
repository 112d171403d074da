"""The tables and figures `python -m lab.reproduce` writes: rows as markdown, and one Plotly figure
per command."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from lab.timelines import breakdown


def markdown(rows: list[dict]) -> str:
    """Rows as a markdown table: every column any row has, in the order they first appear (a row
    may lack some: the K=1 cells have no "threads beside" figure), blank where a row has none."""
    if not rows:
        return "(no rows finished)"
    columns = list(dict.fromkeys(column for row in rows for column in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join("" if r.get(c) is None else str(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def figure(name: str, rows: list[dict]) -> go.Figure:
    """The figure of one command's rows (an empty one where it has none)."""
    frame = pd.DataFrame(rows)
    figure = go.Figure()
    if name == "speedup" and rows:
        labels = [f"K={k}, M={m}" for k, m in zip(frame["K"], frame["M"])]
        figure.add_bar(name="this host, vs its K=2, M=1", x=labels, y=frame["vs K=2,M=1"],
                       text=frame["how"], hovertemplate="%{x}: %{y:.2f}x (%{text})<extra></extra>")
        figure.add_bar(name="paper Transformer, vs its K=2, M=1", x=labels, y=frame["paper Transformer (vs K=2,M=1)"])
        figure.add_bar(name="paper AmoebaNet, vs its K=2, M=1", x=labels, y=frame["paper AmoebaNet (vs K=2,M=1)"])
        figure.add_scatter(name="unit-cost model with recompute, vs its K=2, M=1", x=labels,
                           y=frame["model with recompute (vs K=2,M=1)"], mode="markers")
        figure.update_layout(title="Table 2: throughput normalized to K=2, M=1", yaxis_title="x")
    elif name == "memory" and rows:
        figure.add_bar(x=frame["training"], y=frame["parameters"], text=frame["layers"],
                       hovertemplate="%{x}: %{y} parameters, %{text} layers<extra></extra>")
        figure.update_layout(title="Largest Transformer within the budget", yaxis_title="parameters")
    elif name == "peers" and rows:
        for implementation, group in frame.groupby("implementation"):
            figure.add_scatter(name=implementation, x=group["M"], y=group["speedup vs one core"], mode="lines+markers")
        figure.update_layout(title="K=2 speedup over one core, by implementation", xaxis_title="M",
                             yaxis_title="x", xaxis_type="log")
    elif name == "schedules" and rows:
        for schedule, group in frame.groupby("schedule", sort=False):
            figure.add_scatter(name=f"{schedule}", x=group["M"], y=group["bubble"], mode="lines+markers")
            figure.add_scatter(name=f"{schedule}, theory", x=group["M"], y=group["bubble, theory"], mode="lines",
                               line_dash="dot")
        figure.update_layout(title="Bubble by schedule and M", xaxis_title="M", yaxis_title="bubble",
                             yaxis_tickformat=".0%")
    elif name == "breakdown" and rows:
        for component, group in frame[frame["component"] != breakdown.STEP].groupby("component", sort=False):
            figure.add_bar(name=component, x=group["setting"], y=group["ms"])
        steps = frame[frame["component"] == breakdown.STEP]
        figure.add_scatter(name=breakdown.STEP, x=steps["setting"], y=steps["ms"], mode="markers",
                           marker=dict(symbol="line-ew-open", size=30, line_width=3, color="#333"))
        figure.update_layout(title="Where the time of each step went", barmode="stack", yaxis_title="ms")
    elif name == "transports" and rows:
        figure.add_bar(x=frame["stages run as"], y=frame["speedup over K=1"], text=frame["speedup range"],
                       hovertemplate="%{x}: %{y:.2f}x (rounds %{text})<extra></extra>")
        figure.update_layout(title="Speedup over K=1: stages as threads vs as processes", yaxis_title="x")
    return figure


