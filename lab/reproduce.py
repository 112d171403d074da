"""Reproduce the paper's tables on this host, and race the peers.

    python -m lab.reproduce speedup [--device cpu|cuda] [--model transformer|cnn] [--transport threads|processes]
                                    [--quick] [--out DIR]
    python -m lab.reproduce memory  [--device cpu|cuda] [--budget BYTES] [--quick] [--out DIR]
    python -m lab.reproduce peers   [--quick] [--out DIR]
    python -m lab.reproduce transports [--model M] [--width W] [--batch N] [--stages K] [--micro-batches M]
                                       [--stages-as both|threads|processes] [--quick]
    python -m lab.reproduce schedules [--stages K] [--virtual V] [--quick] [--out DIR]
    python -m lab.reproduce breakdown [--quick] [--out DIR]
    python -m lab.reproduce all     [--quick] [--out DIR]

Each command writes <out>/<name>.md, .csv and .html (a Plotly chart) and prints the markdown table
last. Ctrl-C stops cleanly: the rows finished so far are written and printed.
"""
from __future__ import annotations

import argparse
import datetime
import shlex
import sys
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import pandas as pd
import torch
from tqdm import tqdm

from lab import theory, zoo
from lab.config import APP_DEFAULT, MEASURE_ROUNDS, MEASURE_WARMUP, PRECISIONS, RunConfig, measure_rounds
from lab.config import check as check_config
from lab.engine_time import peers
from lab.machine import host
from lab.machine.host import keep_freed_cpu_memory
from lab.schedules import race as schedule_race
from lab.studies import fit, speedup
from lab.timelines import breakdown
from lab.views import results
from lab.views.results import markdown


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments end with one line on stderr and exit code 2, no usage dump."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parser() -> argparse.ArgumentParser:
    main = OneLineParser(prog="python -m lab.reproduce", description=__doc__.splitlines()[0])
    commands = main.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for name, help_text in (("speedup", "the paper's Table 2: speedup over K and M"),
                            ("memory", "the paper's Table 1 idea: largest model within a memory budget"),
                            ("peers", "our engine vs torch.distributed.pipelining and torchgpipe"),
                            ("transports", "stages as threads vs as processes at one setting (the app's default)"),
                            ("schedules", "GPipe, 1F1B, interleaved 1F1B and ZB-H1 side by side, by M"),
                            ("breakdown", "where the time of a step went, part by part, for three models"),
                            ("all", "speedup, memory and peers")):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("--quick", action="store_true", help="small sizes: seconds, for a smoke run or CI")
        command.add_argument("--out", default="results", help="folder for .md, .csv and .html (default results/)")
        command.add_argument("--seed", type=int, default=0)
        if name in ("speedup", "memory", "all"):
            command.add_argument("--device", default="cpu", help="cpu (default) or cuda")
        if name in ("speedup", "all"):
            command.add_argument("--model", default="transformer",
                                 help=f"a zoo model: {', '.join(zoo.CARDS)} (default transformer)")
            command.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4, 8], help="K values")
            command.add_argument("--micro-batches", type=int, nargs="+", default=[1, 4, 32], help="M values")
            command.add_argument("--transport", default=None, choices=["threads", "processes"],
                                 help="measured cells: stages as threads or one process per stage (default: "
                                      "processes on 2+ GPUs, NCCL between them, with threads measured beside; "
                                      "else threads)")
            command.add_argument("--precision", default="float32", choices=list(PRECISIONS),
                                 help="float32 (default), or bf16: every task under torch.autocast in bfloat16, "
                                      "recompute included; on GPUs the table is sized for it")
        if name == "transports":
            default = APP_DEFAULT
            command.add_argument("--model", default=default.model, help=f"zoo model (default {default.model})")
            command.add_argument("--blocks", type=int, default=default.blocks)
            command.add_argument("--width", type=int, default=default.width)
            command.add_argument("--batch", type=int, default=default.batch)
            command.add_argument("--stages", type=int, default=default.stages, help="K")
            command.add_argument("--micro-batches", type=int, default=default.micro_batches, help="M")
            command.add_argument("--checkpoint", default=default.checkpoint,
                                 choices=["always", "except_last", "never"])
            command.add_argument("--rounds", type=int, default=None,
                                 help=f"measured rounds, each a step beside a K=1 step (default {MEASURE_ROUNDS} "
                                      f"or GPIPE_LAB_ROUNDS, as the app)")
            command.add_argument("--stages-as", default="both", choices=["both", "threads", "processes"],
                                 help="which transports to measure (default both, side by side)")
        if name == "schedules":
            command.add_argument("--stages", type=int, default=4, help="K (default 4)")
            command.add_argument("--virtual", type=int, default=2, help="chunks per stage of interleaved (default 2)")
        if name in ("memory", "all"):
            command.add_argument("--budget", type=int, default=None,
                                 help="bytes per device (default 24 MiB, 3 MiB with --quick; "
                                      "on cuda 1 GiB, 256 MiB with --quick)")
    return main


def check(args: argparse.Namespace) -> None:
    """Refuse what cannot run, with a message naming the bad value."""
    device = getattr(args, "device", "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r}: expected cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but this host has no CUDA GPU (torch.cuda.is_available() is False)")
    if device == "cuda" and getattr(args, "transport", None) == "processes" and host.exclusive_gpus():
        # this process sizes and measures on the GPUs too: its contexts and the stage processes would meet
        refused = host.stage_processes_refused(2, torch.cuda.device_count(), True, True)
        raise ValueError(f"--transport processes: {refused}")
    model = getattr(args, "model", "transformer")
    if model not in zoo.CARDS:
        raise ValueError(f"--model {model!r}: expected one of the zoo's models, {', '.join(zoo.CARDS)}")
    if args.command == "schedules":
        base = schedules_config(args)
        check_config(base)
        if args.virtual < 2 or base.stages * args.virtual > base.layers:
            raise ValueError(f"--virtual {args.virtual}: expected 2 <= v and K*v <= {base.layers} layers")
        return
    if args.command == "transports":
        check_config(transports_config(args).but(transport="processes"))
        if transports_rounds(args) < 1:
            raise ValueError(f"--rounds {args.rounds}: expected at least 1")
        return
    if hasattr(args, "stages"):
        layers = speedup_config(args).layers
        too_many = [k for k in args.stages if k > layers or k < 1]
        if too_many:
            raise ValueError(f"--stages {too_many[0]}: the {model} used here has {layers} layers; use 1..{layers}")
        if any(m < 1 for m in args.micro_batches):
            raise ValueError("--micro-batches must all be at least 1")
    if getattr(args, "budget", None) is not None and args.budget <= 0:
        raise ValueError(f"--budget {args.budget}: expected a positive number of bytes")


# --- configurations ----------------------------------------------------------------------------

def model_line(base: RunConfig) -> str:
    """The header line that says which zoo model a table trained, and at what size."""
    context = f", context {base.context}" if base.context else ""
    return (f"# model {base.model}: {base.blocks} blocks ({base.layers} layers), width {base.width}{context}, "
            f"batch {base.batch}")


def speedup_config(args) -> RunConfig:
    """The model each speedup cell trains (speedup.table_setting): 8 layers, so K runs up to 8."""
    return speedup.table_setting(args.device, args.quick, model=args.model, seed=args.seed,
                                 transport=speedup_transport(args), precision=args.precision)


def speedup_transport(args) -> str:
    """How the measured cells' stages run: --transport, else one process per GPU where there are
    two GPUs or more, else threads (speedup.table_transport)."""
    return getattr(args, "transport", None) or speedup.table_transport(args.device)


def transports_config(args) -> RunConfig:
    """The setting compared (the app's default unless changed); --quick shrinks it for a smoke run."""
    config = RunConfig(model=args.model, blocks=args.blocks, width=args.width, batch=args.batch, stages=args.stages,
                       micro_batches=args.micro_batches, checkpoint=args.checkpoint, seed=args.seed)
    return config.but(width=32, blocks=2, batch=16, micro_batches=4) if args.quick else config


def transports_rounds(args) -> int:
    """The rounds the transports comparison asks for: --rounds, else the app's (measure_rounds,
    which GPIPE_LAB_ROUNDS sets)."""
    return measure_rounds() if args.rounds is None else args.rounds


def memory_config(args) -> tuple[RunConfig, int, int]:
    """(model template, budget in bytes, largest block count searched): fit.table1_setting."""
    return fit.table1_setting(args.device, args.quick, seed=args.seed, budget=args.budget)


def peers_workload(args) -> tuple[peers.Workload, list[int], int]:
    if args.quick:
        return peers.Workload(width=128, blocks=4, batch=64, seed=args.seed), [1, 4], 1
    return peers.Workload(width=1024, blocks=8, batch=512, seed=args.seed), [1, 4, 8, 16, 32], 7


# --- the three commands ------------------------------------------------------------------------

def speedup_rows(args, progress) -> Iterator[dict]:
    base = speedup_config(args)
    for cell in speedup.measure_table(base, args.stages, args.micro_batches, progress):
        key = (cell.stages, cell.micro_batches)
        yield {"K": cell.stages, "M": cell.micro_batches, "samples/s": round(cell.samples_per_second, 1),
               "vs K=2,M=1": None if cell.vs_pair is None else round(cell.vs_pair, 2),
               "paper Transformer (vs K=2,M=1)": theory.PAPER_TABLE2["Transformer-48"].get(key),
               "paper AmoebaNet (vs K=2,M=1)": theory.PAPER_TABLE2["AmoebaNet-D (18, 256)"].get(key),
               "speedup vs K=1,M=1": round(cell.vs_single, 2), "speedup vs K=1, same M": round(cell.vs_same_m, 2),
               "model with recompute (vs K=2,M=1)": round(theory.on_paper_scale(*key), 2),
               "ideal without recompute K*M/(M+K-1)": round(theory.ideal_speedup(*key), 2),
               "bubble": round(cell.bubble, 3),
               **({} if cell.gpu_ratio is None else {"GPU/host time per task": round(cell.gpu_ratio, 1)}),
               **({} if cell.tflops is None else {"TFLOP/s per stage": ", ".join(f"{t:.1f}" for t in cell.tflops)}),
               **({} if cell.threads_vs_same_m is None else
                  {"threads beside: vs K=1, same M": round(cell.threads_vs_same_m, 2)}),
               "how": cell.label}


ALLOCATOR, COUNT = "allocator's peak, capped", "engine's count"


def memory_measures(device: str) -> list[tuple[str, int]]:
    """How the memory table judges a fit, as (measure, most stages it can judge): on GPUs the
    allocator's real peak under a real cap for K up to the GPU count, then the engine's count for
    every K (so each measure has its own naive row); on the CPU only the count."""
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    return ([(ALLOCATOR, gpus)] if gpus else []) + [(COUNT, max(k for _, k, _ in fit.LADDER))]


def memory_rows(args, progress) -> Iterator[dict]:
    """The ladder of fit.LADDER once per measure (memory_measures); growth is against the naive row
    of the same measure, never across measures."""
    base, budget, max_blocks = memory_config(args)
    for measure, most in memory_measures(args.device):
        first = None
        for label, stages, checkpoint in fit.LADDER:
            if stages > most:
                continue
            said = lambda p: progress(f"{label}: {p.blocks} blocks {'fit' if p.fits else 'too big'}")
            best = fit.largest(base, stages, checkpoint, budget, max_blocks, label=label, counted=measure == COUNT,
                               progress=said)
            row = {"training": label, "K": stages, "measured by": measure}
            if best is None:
                yield {**row, "layers": 0, "parameters": 0, "peak bytes": 0, "growth vs naive": 0.0, "paper": "",
                       "probes": 0, "allocator (torch.profiler)": "", "count over allocator": ""}
                continue
            first = first or best
            capped = best.blocks >= max_blocks  # the search stopped at its cap, not at the budget
            yield {**row, "layers": f">= {best.layers} (search cap)" if capped else best.layers,
                   "parameters": best.params, "peak bytes": best.peak_bytes,
                   "growth vs naive": round(best.params / first.params, 2),
                   "paper": {"K=1 with recompute": f"{theory.PAPER_REMAT_GROWTH}x"}.get(label, ""),
                   "probes": len(best.probes), **beside_the_allocator(args, base, best)}


def beside_the_allocator(args, base: RunConfig, best: fit.Largest) -> dict:
    """On the CPU, for a row of one stage, the allocator's peak of the chosen model's steady-state
    step (torch.profiler, fit.allocator_peak) beside the engine's count; blank elsewhere (a process
    of K stages holds them all in one allocator; on GPUs the allocator's rows are its own)."""
    if args.device == "cuda" or best.stages != 1:
        return {"allocator (torch.profiler)": "", "count over allocator": ""}
    allocated = fit.allocator_peak(base.but(blocks=best.blocks, stages=1, checkpoint=best.checkpoint))
    return {"allocator (torch.profiler)": allocated, "count over allocator": round(best.peak_bytes / allocated, 3)}


def schedules_config(args) -> RunConfig:
    """The step every schedule runs: the zoo's Transformer, checkpoint never (recompute would hide
    what the orders hold), M = 4 to 32."""
    return RunConfig(model="transformer", blocks=6, width=32 if args.quick else 64, batch=32, stages=args.stages,
                     micro_batches=4, checkpoint="never", seed=args.seed)


def schedules_micro_batches(args) -> list[int]:
    """M values for the table: multiples of K (interleaved needs them), up to the batch."""
    return [m for m in ((4, 8) if args.quick else (4, 8, 16, 32)) if m % args.stages == 0 and m <= 32] or [args.stages]


def schedules_rows(args, progress) -> Iterator[dict]:
    base = schedules_config(args)
    for micro in schedules_micro_batches(args):
        for result in schedule_race.compare(base.but(micro_batches=micro), virtual=args.virtual,
                                        progress=lambda name: progress(f"M={micro}: {name}")):
            yield {"schedule": result.schedule, "v": result.virtual, "M": micro, "how": result.how,
                   "bubble": round(result.timeline.bubble, 3), "bubble, theory": round(result.theory_bubble, 3),
                   "makespan (ms)": round(result.timeline.makespan * 1e3, 1),
                   "peak activations, max stage (MiB)": round(max(result.peaks) / 2 ** 20, 3),
                   "micro-batches held, theory (max stage)": max(result.theory_in_flight())}


def breakdown_settings(quick: bool, seed: int = 0) -> list[tuple[str, RunConfig]]:
    """The steps the breakdown takes apart, by name: the app's default, a small model (8 x
    Linear(256)+ReLU, batch 64) and the peers race's large one (8 x Linear(1024)+ReLU, batch 512),
    both at K=2, M=8 without recompute as in the race; --quick shrinks them to seconds."""
    mlp = RunConfig(model="mlp", blocks=8, stages=2, micro_batches=8, checkpoint="never", seed=seed)
    settings = [("app default", APP_DEFAULT.but(seed=seed)), ("small model", mlp.but(width=256, batch=64)),
                ("large model", mlp.but(width=1024, batch=512))]
    if quick:
        settings = [("app default", APP_DEFAULT.but(width=32, blocks=2, batch=16, micro_batches=4, seed=seed)),
                    ("small model", mlp.but(blocks=4, width=64, batch=16, micro_batches=4)),
                    ("large model", mlp.but(blocks=4, width=256, batch=128, micro_batches=4))]
    return settings


def breakdown_rows(args, progress) -> Iterator[dict]:
    """Each setting with its stages as processes, then as threads, measured as the app measures
    (rounds of a step beside a K=1 step; one round with --quick) with its tasks also timed alone:
    the median step's parts, then those of the K=1 step measured beside the threads."""
    rounds, warmup = (1, 1) if args.quick else (measure_rounds(), MEASURE_WARMUP)
    for name, config in breakdown_settings(args.quick, args.seed):
        for transport in ("processes", "threads"):
            record = breakdown.measure(config.but(transport=transport), rounds, warmup)
            progress(f"{name}, {transport}")
            yield from breakdown.of_record(record).rows(f"{name}, K={config.stages}, {transport}")
        yield from breakdown.of_baseline(record).rows(f"{name}, K=1")


def wide(rows: list[dict]) -> list[dict]:
    """The breakdown's rows (setting, component, ms) as one row per component, a column per setting."""
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    table: dict[str, dict] = {}
    for r in rows:
        table.setdefault(r["component"], {"component (ms)": r["component"]})[r["setting"]] = r["ms"]
    return [{"component (ms)": entry["component (ms)"], **{s: entry.get(s) for s in settings}}
            for entry in table.values()]


def transports_rows(args, progress) -> Iterator[dict]:
    kinds = ("threads", "processes") if args.stages_as == "both" else (args.stages_as,)
    rounds = 1 if args.quick else transports_rounds(args)
    yield from speedup.transports(transports_config(args), rounds, progress, kinds)


def peers_rows(args, progress) -> Iterator[dict]:
    work, micros, rounds = peers_workload(args)
    for raced in peers.race(work, micros, rounds, progress):
        yield from peers.table_rows(raced, work.batch)


# --- running, writing, printing ----------------------------------------------------------------

def header(args, name: str, details: str) -> list[str]:
    info = host.describe()
    command = "python -m lab.reproduce " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:] else \
        f"python -m lab.reproduce {name}"
    return [f"# {name}: {details}",
            f"# command: {command}",
            f"# date: {datetime.datetime.now().isoformat(timespec='seconds')}; seed {args.seed}",
            f"# host: {host.summary(info)}; intra-op threads {info['threads']}; python {info['python']}"]


DETAILS = {
    "speedup": "samples/s normalized to K=1, M=1 and to K=1 at the same M; one core per stage on CPU; "
               "cells with more stages than devices are ideal replays of task times measured one at a time",
    "memory": "largest Transformer whose real training step (forward, backward, Adam) fits the budget per device",
    "peers": "same model, batch and K=2; one core per stage; max grad diff against the unpipelined model",
    "schedules": "the same step under each schedule; measured where the host has a core per stage, else the "
                 "ideal replay of task times measured one at a time; theory: unit costs (F=1, B=2; zb-h1: "
                 "F=B=W=1); memory: the ledger's activation peak",
    "breakdown": "each median step's makespan as parts that add up to it (lab/timelines/breakdown.py defines them): "
                 "compute of the critical stage and recompute at one-task-alone speed, contention beside the "
                 "other stages, the schedule's bubble, unequal stages, messages and gaps; one core per stage",
    "transports": "the same steps with the stages as threads of one process and as one process each (gloo); "
                  "one core per stage; speedup = median per-round ratio to K=1 of the same round",
}


def setting_lines(name: str, args) -> list[str]:
    """The lines under a command's header that say what it runs: the model, its sizes, the budget."""
    lines = []
    if name == "memory":
        base, budget, _ = memory_config(args)
        counted = "the budget is applied to each stage's measured parameters + gradients + Adam state + activations"
        how = f"CPU: {counted}; for one stage, the chosen model's steady-state step as the allocator held it " \
              f"(torch.profiler's memory events) beside the count" if args.device != "cuda" else (
            f"GPUs: {torch.cuda.device_count()}; rows measured by the {ALLOCATOR} (K up to that many stages, each "
            f"on a GPU of its own): a real cap, the allocator's peak per GPU and real out-of-memory errors; rows "
            f"measured by the {COUNT} (every K, whether stages share GPUs or not): {counted}; growth vs naive is "
            f"against the naive row of the same measure")
        lines.append(f"# budget {budget} bytes per device ({budget / 2 ** 20:.1f} MiB); {how}; "
                     f"width {base.width}, batch {base.batch}, M {base.micro_batches}")
    if name == "speedup":
        base = speedup_config(args)
        lines.append(f"{model_line(base)}, checkpoint {base.checkpoint}, precision {base.precision}, balance "
                     f"{base.balance}, device {base.device}, stages as "
                     f"{base.transport} (K=1 and replayed cells: threads)")
        on_gpus = args.device == "cuda"
        sizing = speedup.gpu_sizing(args.quick, args.model, args.seed, base.transport, base.precision) \
            if on_gpus else None
        if sizing is not None:
            lines.append(f"# {sizing.describe()}; a cell whose lowest stage is under {speedup.GPU_FLOOR:g}x is "
                         f"launch-bound: Python, not the GPU, set its pace, so it is not called measured")
    if name == "schedules":
        base = schedules_config(args)
        lines.append(f"{model_line(base)}, K={base.stages}, M in {schedules_micro_batches(args)}, interleaved "
                     f"v={args.virtual}, checkpoint never")
    if name == "transports":
        base = transports_config(args)
        lines.append(f"{model_line(base)}, K={base.stages}, M={base.micro_batches}, checkpoint {base.checkpoint}, "
                     f"{1 if args.quick else transports_rounds(args)} round(s)")
    if name == "breakdown":
        lines += [f"{model_line(config)}, K={config.stages}, M={config.micro_batches}, checkpoint {config.checkpoint} "
                  f"({name})" for name, config in breakdown_settings(args.quick, args.seed)]
        lines.append(f"# {1 if args.quick else measure_rounds()} round(s), each a step beside a K=1 step; the "
                     f"tasks also timed one at a time (serial steps)")
    if name == "peers":
        work, micros, rounds = peers_workload(args)
        lines.append(f"# model {work.blocks} x (Linear({work.width},{work.width}) + ReLU), batch {work.batch}, "
                     f"M in {micros}, {rounds} interleaved round(s) of one step each after a warm-up, "
                     f"speedup = median per-round ratio to one core, checkpoint never; torchgpipe "
                     f"{'installed' if peers.torchgpipe_available() else 'not installed'}")
    return lines


def measured(name: str, args, rows_of: Callable, lines: list[str]) -> tuple[list[dict], Optional[BaseException]]:
    """A command's rows as they finish, with a progress bar; on Ctrl-C or an error, the rows that
    finished before it and the error (a line added to `lines` says so)."""
    rows, stopped = [], None
    with tqdm(desc=name, unit="run", leave=False, file=sys.stderr) as bar:
        def progress(label: str) -> None:
            bar.set_postfix_str(label)
            bar.update(1)
        try:
            for row in rows_of(args, progress):
                rows.append(row)
        except KeyboardInterrupt as error:
            stopped = error
            lines.append("# interrupted: the rows below are those finished before Ctrl-C")
        except Exception as error:  # an out-of-memory cell, say: the rows finished before it are kept
            stopped = error
            said = (str(error).strip().splitlines() or [""])[0][:300]
            lines.append(f"# stopped by an error ({type(error).__name__}: {said}): the rows below are those "
                         f"finished before it")
    return rows, stopped


def paper_tables() -> str:
    """The paper's Tables 2 and 3, printed after a speedup table for comparison."""
    return "\n".join(["# the paper's Table 2 (TPUs; each model normalized to its own K=2, M=1 cell):",
                      markdown([{"M": m, **{f"{model.split(' ')[0]} K={k}": table[(k, m)] for model, table in
                                            theory.PAPER_TABLE2.items() for k in (2, 4, 8)}} for m in (1, 4, 32)]),
                      "# Table 3 (P100 GPUs without NVLink, M=32, normalized to K=2):",
                      markdown([{"model": model, **{f"K={k}": v for k, v in table.items()}}
                                for model, table in theory.PAPER_TABLE3.items()]),
                      f"# the cells against the unit-cost model: {theory.why_cells_exceed()}"])


def run_command(name: str, args, rows_of: Callable, out: Path) -> list[dict]:
    """Run one command with a progress bar; on Ctrl-C or an error keep what finished (and raise it
    again once written). Write and print the table."""
    lines = header(args, name, DETAILS[name]) + setting_lines(name, args)
    rows, stopped = measured(name, args, rows_of, lines)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(wide(rows) if name == "breakdown" else rows)
    (out / f"{name}.md").write_text("\n".join(lines) + "\n\n" + table + "\n")
    pd.DataFrame(rows).to_csv(out / f"{name}.csv", index=False)
    results.figure(name, rows).write_html(out / f"{name}.html", include_plotlyjs=True)
    if name == "speedup":
        print(paper_tables())
    print("\n".join(lines))
    print(table)
    if stopped is not None:
        raise stopped
    return rows


COMMANDS = {"speedup": speedup_rows, "memory": memory_rows, "peers": peers_rows, "transports": transports_rows,
            "schedules": schedules_rows, "breakdown": breakdown_rows}
ALL = ("speedup", "memory", "peers")


def main(argv: Iterable[str] = None) -> int:
    args = parser().parse_args(argv)
    try:
        check(args)  # on a GPU this sizes the table's model (lab.studies.gpu_sizing): about two minutes
    except ValueError as error:
        print(f"python -m lab.reproduce: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("stopped by Ctrl-C before any row was measured (while sizing the model for the GPU)", file=sys.stderr)
        return 130
    if getattr(args, "device", "cpu") == "cpu":
        keep_freed_cpu_memory()
    names = list(ALL) if args.command == "all" else [args.command]
    try:
        for name in names:
            run_command(name, args, COMMANDS[name], Path(args.out))
    except KeyboardInterrupt:
        print("stopped by Ctrl-C; finished rows were written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
