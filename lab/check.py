"""python -m lab.check MODULE:FUNCTION: your own model, pipelined. It says whether GPipe keeps its
gradients (and why not, where it does not), what each stage holds, how to cut it, and the K, M,
recompute and schedule to pick under a memory budget; it prints all of it and writes one HTML page
with the charts.

    python -m lab.check mymodels:build --shape 32,3,32,32             # FUNCTION returns an nn.Sequential
    python -m lab.check path/to/models.py:tiny --budget 64MiB --stages 1 2 4 --micro-batches 1 4 8
    python -m lab.check mymodels:with_batch --loss mse                 # FUNCTION returns (model, inputs)

FUNCTION returns an nn.Sequential (or a module whose forward is a chain of its children), or
(model, inputs), or (model, (inputs, targets)). A model that is not a chain of layers is refused,
naming the first thing that stops it. Everything runs on this host's CPU cores.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Optional

import plotly.graph_objects as go

from engine import GPipe
from lab.studies.fit import stage_bytes
from lab.timelines import replay
from lab.views import charts
from lab.yours import exactness, memory, plan
from lab.yours.model import LOSSES, Refused, Yours, function_of, take

UNITS = {"": 1, "b": 1, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9}


def bytes_of(text: str) -> int:
    """`--budget`'s bytes: a number with an optional unit (64MiB, 1.5GB, 2000000)."""
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not found or found.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected bytes, e.g. 64MiB, 1.5GB or 2000000")
    return int(float(found.group(1)) * UNITS[found.group(2).lower()])


def shape_of(text: str) -> tuple[int, ...]:
    """`--shape`'s dimensions: 32,3,32,32."""
    try:
        dims = tuple(int(d) for d in text.split(","))
    except ValueError:
        dims = ()
    if not dims or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected the mini-batch's shape as positive whole numbers, "
                                         f"e.g. 32,3,32,32")
    return dims


def said(count: float) -> str:
    """Bytes in the unit that reads best."""
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count:.0f} B"


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"python -m lab.check: error: {message}\n")


def parser() -> argparse.ArgumentParser:
    options = OneLineParser(prog="python -m lab.check", description=__doc__.splitlines()[0])
    options.add_argument("target", help="MODULE:FUNCTION (a module on the path, or a .py file)")
    options.add_argument("--shape", type=shape_of, help="the mini-batch's shape, when FUNCTION returns no batch")
    options.add_argument("--loss", default="cross_entropy", choices=list(LOSSES))
    options.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4], help="the K to try (default 1 2 4)")
    options.add_argument("--micro-batches", type=int, nargs="+", default=[1, 4, 8], help="the M to try")
    options.add_argument("--budget", type=bytes_of, help="memory per device, e.g. 64MiB (default: none)")
    options.add_argument("--device", default="cpu", help="where the stages run: cpu (the only one checked yet)")
    options.add_argument("--out", help="the HTML page (default results/check-FUNCTION.html)")
    return options


class Report:
    """Everything the check found, for the printed tables and the page."""

    def __init__(self, yours: Yours, stages: list[int], micro: list[int], budget: Optional[int]):
        self.yours, self.budget = yours, budget
        self.stages = [k for k in stages if k <= len(yours.model)]
        self.exactness = exactness.table(yours, self.stages, micro)
        widest = max(self.stages)
        self.statistics = exactness.running_statistics(yours, widest, max(micro))
        costs = plan.measured_costs(yours, micro)
        self.plans = plan.plans(yours, self.stages, micro, costs)
        self.best = plan.best_fitting(self.plans, budget)
        if not self.best:
            smallest = min(self.plans, key=lambda p: p.peak_bytes)
            raise Refused(f"--budget {said(budget)}: no plan fits; the smallest budget one fits is "
                          f"{said(smallest.peak_bytes)} ({smallest.label})")
        self.chosen = min(self.best.values(), key=lambda p: p.step_seconds)
        self.balance = plan.balance(yours, self.stages, self.chosen.micro_batches, costs[self.chosen.micro_batches])
        self.memory = [row for schedule in plan.SCHEDULES_TRIED for checkpoint in plan.RECOMPUTE_TRIED
                       if schedule == "gpipe" or self.chosen.micro_batches >= self.chosen.stages > 1
                       for row in memory.per_stage(yours, self.chosen.cut, self.chosen.micro_batches, checkpoint,
                                                   schedule)]
        self.allocator = memory.checked(yours, self.chosen.cut, self.chosen.micro_batches, self.chosen.checkpoint)
        self.trace, self.ran = self.run_chosen()

    def run_chosen(self):
        """A real step of the chosen plan on this host (after a warm-up): its trace, and each stage's
        bytes as that step held them."""
        chosen = self.chosen
        pipe = GPipe(self.yours.fresh(), chosen.cut, chunks=chosen.micro_batches, checkpoint=chosen.checkpoint,
                     schedule=chosen.schedule, seed=0, threads_per_stage=1)
        try:
            pipe.step(self.yours.inputs, self.yours.targets, self.yours.loss_fn)
            ran = stage_bytes(pipe, self.yours.inputs, self.yours.targets, self.yours.loss_fn)
            return pipe.trace, [memory.StageMemory(chosen.schedule, chosen.checkpoint, k, "", r["parameters"],
                                                   r["gradients"], r["optimizer state"], r["activations"],
                                                   memory.update_bytes(part)).total
                                for k, (r, part) in enumerate(zip(ran, pipe.partitions))]
        finally:
            pipe.close()

    def lines(self) -> list[str]:
        """The report as printed."""
        y = self.yours
        out = [f"# {y.name}: {len(y.model)} layers, {sum(p.numel() for p in y.model.parameters()):,} parameters, "
               f"batch {tuple(y.inputs.shape)}" + (f"; {y.note}" if y.note else "")]
        out += ["", "## Exactness: the pipeline's gradients against one device's on the whole batch",
                "| K | M | largest relative difference (parameter) | the same bits as K=1 | why |",
                "|---|---|---|---|---|"]
        for r in self.exactness:
            out.append(f"| {r.stages} | {r.micro_batches} | refused | | {r.refused} |" if r.refused else
                       f"| {r.stages} | {r.micro_batches} | {r.largest_rel:.1e} ({r.worst}) | "
                       f"{'yes' if r.same_bits_as_k1 else 'NO'} | {r.cause or 'bitwise equal to one device'} |")
        if self.statistics:
            out.append(f"- {self.statistics}")
        c = self.chosen
        out += ["", f"## Balance: each layer's forward+backward on one micro-batch of M={c.micro_batches}",
                "| layer | ms | size |", "|---|---|---|"]
        out += [f"| {i} | {t * 1e3:.2f} | {said(s)} |" for i, (t, s) in enumerate(zip(self.balance.times,
                                                                                     self.balance.sizes))]
        out += [f"- K={k}: " + "; ".join(f"{how} {cut} ({self.shares(cut)} of the time)" for how, cut in cuts.items())
                for k, cuts in self.balance.cuts.items()]
        out += ["", "## The plan" + (f" within {said(self.budget)} per device" if self.budget else ""),
                "| K | fastest that fits | most loaded stage | step (replayed) | bubble | speedup |",
                "|---|---|---|---|---|---|"]
        out += [f"| {k} | M={p.micro_batches}, {p.schedule}, recompute {p.checkpoint}, cut {p.cut} | "
                f"{said(p.peak_bytes)} | {p.step_seconds * 1e3:.1f} ms | {p.bubble:.0%} | {p.speedup:.2f}x |"
                for k, p in sorted(self.best.items())]
        out += ["", f"## Memory per stage at the chosen cut {c.cut}, M={c.micro_batches} (a real step's count)",
                "| schedule | recompute | stage | layers | weights | gradients | Adam's moments | activations | "
                "Adam's update | high-water mark |", "|---|---|---|---|---|---|---|---|---|---|"]
        out += [f"| {m.schedule} | {m.checkpoint} | {m.stage} | {m.layers} | {said(m.weights)} | {said(m.gradients)} | "
                f"{said(m.optimizer)} | {said(m.activations)} | {said(m.update)} | {said(m.total)} |"
                for m in self.memory]
        out.append("- the high-water mark: weights and moments, with the gradients and the larger of the activations "
                   "(the backward) and Adam's update (its step); the backward's own working memory is not counted")
        out += ["", f"## Each stage alone, counted and by the CPU allocator (torch.profiler), recompute {c.checkpoint}",
                "| stage | counted | allocator's peak | counted / allocator |", "|---|---|---|---|"]
        out += [f"| {m.stage} | {said(m.total)} | {said(m.allocator)} | {m.total / m.allocator:.2f} |"
                for m in self.allocator]
        verdict = "" if self.budget is None else \
            f", {'within' if max(self.ran) <= self.budget else 'OVER'} the budget of {said(self.budget)}"
        out += ["", f"## Chosen: {c.label}, cut {c.cut}: a step measured here took {self.trace.makespan * 1e3:.1f} ms "
                    f"(replayed on K devices {c.step_seconds * 1e3:.1f} ms); its most loaded stage held "
                    f"{said(max(self.ran))}{verdict}"]
        return out

    def shares(self, cut: list[int]) -> str:
        """Each stage's share of the layers' measured time under `cut`."""
        times = self.balance.times
        return ", ".join(f"{sum(times[a:b]) / sum(times):.0%}" for a, b in memory.edges_of(cut))

    def page(self) -> str:
        """One HTML page: the tables and the charts (Plotly, inline, so that it opens offline)."""
        c = self.chosen
        figures = [self.exactness_figure(), self.balance_figure(), self.memory_figure(), self.plan_figure(),
                   charts.gantt(replay.measured(self.trace.to_records(), self.trace.stages,
                                                f"measured here: {c.label}"))]
        parts = [f.to_html(full_html=False, include_plotlyjs=index == 0) for index, f in enumerate(figures)]
        rows = "".join(f"<pre>{line}</pre>" if not line.startswith("|") else f"<code>{line}</code><br>"
                       for line in self.lines())
        return (f"<!doctype html><html><head><meta charset='utf-8'><title>lab.check: {self.yours.name}</title>"
                f"</head><body style='font-family:sans-serif'>{''.join(parts)}<h2>The report</h2>{rows}</body></html>")

    def exactness_figure(self) -> go.Figure:
        runs = [r for r in self.exactness if not r.refused]
        return go.Figure(go.Bar(x=[f"K={r.stages}, M={r.micro_batches}" for r in runs],
                                y=[max(r.largest_rel, 1e-12) for r in runs], text=[r.cause or "bitwise" for r in runs],
                                name="largest relative difference"),
                         layout=dict(title="Gradients against one device (1e-12: bitwise equal)", yaxis_type="log"))

    def balance_figure(self) -> go.Figure:
        cut = self.chosen.cut
        stage_of = [k for k, n in enumerate(cut) for _ in range(n)]
        return go.Figure(go.Bar(x=list(range(len(self.balance.times))), y=[t * 1e3 for t in self.balance.times],
                                marker_color=[charts.OPS["F"][1] if s % 2 == 0 else charts.OPS["B"][1]
                                              for s in stage_of], name="forward+backward (ms)"),
                         layout=dict(title=f"Each layer's time, coloured by stage of the cut {cut}",
                                     xaxis_title="layer", yaxis_title="ms"))

    def memory_figure(self) -> go.Figure:
        labels = [f"{m.schedule}, {m.checkpoint}, stage {m.stage}" for m in self.memory]
        figure = go.Figure(layout=dict(title="What each stage holds in a step", barmode="stack", yaxis_title="MiB"))
        parts = {"weights": lambda m: m.weights, "Adam's moments": lambda m: m.optimizer,
                 "gradients": lambda m: m.gradients, "activations, or Adam's update where larger":
                 lambda m: max(m.activations, m.update)}
        for part, size in parts.items():
            figure.add_bar(name=part, x=labels, y=[size(m) / 2 ** 20 for m in self.memory])
        return figure

    def plan_figure(self) -> go.Figure:
        best = sorted(self.best.items())
        return go.Figure(go.Bar(x=[f"K={k}" for k, _ in best], y=[p.speedup for _, p in best],
                                text=[f"M={p.micro_batches}, {p.schedule}, {p.checkpoint}" for _, p in best]),
                         layout=dict(title="The fastest plan that fits, by K: speedup over one device (replayed)",
                                     yaxis_title="x"))


def made_by(target: str):
    """What FUNCTION returns, or Refused saying what it raised."""
    function = function_of(target)
    try:
        return function()
    except Exception as error:
        raise Refused(f"{target} raised {type(error).__name__}: {str(error).strip()[:200]}; expected it to "
                      f"return the model") from None


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.device != "cpu":
            raise Refused(f"--device {args.device!r}: the check runs its stages on this host's CPU cores; "
                          f"expected cpu")
        if min(args.stages) < 1 or min(args.micro_batches) < 1:
            raise Refused("--stages and --micro-batches: expected whole numbers of at least 1")
        yours = take(made_by(args.target), args.target, args.shape, args.loss)
        report = Report(yours, args.stages, args.micro_batches, args.budget)
    except Refused as refused:
        print(f"python -m lab.check: error: {refused}", file=sys.stderr)
        return 2
    print("\n".join(report.lines()))
    out = Path(args.out or f"results/check-{args.target.rpartition(':')[2]}.html")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report.page())
    print(f"\n# the page: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
