"""--report: the commands after the doctor's rows, each within its share of the time left, and the
one markdown file a GPU host sends back."""
from __future__ import annotations

import datetime
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from lab.checkup import subprocesses
from lab.machine import host
from lab.machine.torchrun import ROOT, free_port

REPORT_SECONDS = 480   # --report: the rows and every part together, on one GPU
REPORT_ROWS_SECONDS = 180  # of which the rows get at most this; the parts share the rest (`part_limit`)
MIN_PART_SECONDS = 5   # a part is not started with less time left than this
PART_GRACE_SECONDS = 20  # a part out of time gets a Ctrl-C this long before it is killed, to write its rows


@dataclass(frozen=True)
class Row:
    """One check's outcome."""

    name: str
    passed: bool
    seconds: float
    detail: str


@dataclass(frozen=True)
class Part:
    """One command of the report after the rows: `python args...`, given `share` of the time the
    rows left (`part_limit`); `figures` names the markdown table it writes, if any."""

    title: str
    args: list[str]
    share: float
    env: dict = field(default_factory=dict)
    figures: Optional[Path] = None
    refused: Optional[str] = None  # why this host cannot run it (it is skipped, saying so)


@dataclass(frozen=True)
class Outcome:
    """What one part did: its status line ("exit status 0", "timed out ...", "skipped: ..."), its
    time, the tail of its output and its figures."""

    part: Part
    status: str
    passed: bool
    seconds: float = 0.0
    tail: str = ""
    figures: str = ""


def report_parts(folder: Path) -> list[Part]:
    """The report's commands after the doctor's rows, each with its share of the time they leave."""
    reproduce = ["-m", "lab.reproduce", "--device", "cuda", "--quick", "--out", str(folder)]
    # "-n 0", one process: a worker per core would each hold a context
    return [Part("tests/engine/test_cuda.py", ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                                               "tests/engine/test_cuda.py"], 150),
            Part("lab.reproduce speedup --device cuda --quick", [*reproduce[:2], "speedup", *reproduce[2:]], 150,
                 figures=folder / "speedup.md"),
            Part("lab.reproduce memory --device cuda --quick", [*reproduce[:2], "memory", *reproduce[2:]], 120,
                 figures=folder / "memory.md"),
            Part("lab.bench --host-time --quick (this host's share of a task, beside docs/benchmarks.md's CPU host)",
                 ["-m", "lab.bench", "--host-time", "--quick"], 20),
            Part("lab.train --device cuda, 2 ranks (torchrun, loopback)",
                 ["-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "lab.train", "--steps", "20", "--log-every",
                  "5", "--device", "cuda"], 90, env=subprocesses.NCCL_ON_LOOPBACK,
                 refused=host.stage_processes_refused_here(2, False))]


def part_limit(part: Part, later: list[Part], deadline: float) -> float:
    """The seconds `part` may run: its share of what is left before the report's `deadline`, the
    `later` parts keeping theirs. So the parts end by the deadline by construction, whatever the
    rows took, and a part that ends early leaves its time to the next ones."""
    left = deadline - time.monotonic()
    return left * part.share / (part.share + sum(p.share for p in later))


def run_part(part: Part, deadline: float, gpus: int, later: tuple = (), tail_lines: int = 40) -> Outcome:
    """Run one part within its share of the time left before the report's `deadline`
    (time.monotonic(); `later`: the parts still to run); skipped without a GPU or without time left."""
    if gpus == 0:
        return Outcome(part, "skipped: no CUDA GPU", True)
    if part.refused:
        return Outcome(part, f"skipped: {part.refused}", True)
    limit = part_limit(part, list(later), deadline)
    if limit < MIN_PART_SECONDS:
        return Outcome(part, f"skipped: the report's {REPORT_SECONDS} s were spent", False)
    start = time.perf_counter()
    code, output = subprocesses.bounded(part.args, limit, part.env, grace=min(PART_GRACE_SECONDS, limit / 4))
    status = f"timed out after {limit:.0f} s (interrupted, then stopped)" if code is None else f"exit status {code}"
    figures = part.figures.read_text() if part.figures is not None and part.figures.exists() else ""
    return Outcome(part, status, code == 0, time.perf_counter() - start,
                   "\n".join(output.rstrip().splitlines()[-tail_lines:]), figures)


def commit() -> str:
    """The project's git commit, so that a report names the code it ran."""
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() or "unknown (not a git checkout)"


def report_text(facts: list[tuple[str, str]], rows: list[Row], skipped: list[str], outcomes: list[Outcome],
                seconds: float) -> str:
    """The report as markdown: versions, the doctor's rows, each part's status, figures and output tail."""
    passed = all(row.passed for row in rows) and all(o.passed for o in outcomes)
    lines = ["# GPipe lab: host report", "",
             f"`python -m lab.doctor --report`, {datetime.datetime.now().isoformat(timespec='seconds')}, "
             f"{seconds:.0f} s, commit {commit()}; {'everything passed' if passed else 'SOMETHING FAILED: see below'}",
             "",
             "## Versions", "", "| what | value |", "|---|---|"]
    lines += [f"| {what} | {value} |" for what, value in facts]
    lines += ["", "## The doctor's rows", "", "| check | result | seconds | what it saw |", "|---|---|---|---|"]
    lines += [f"| {r.name} | {'pass' if r.passed else 'FAIL'} | {r.seconds:.1f} | {r.detail.replace('|', '/')} |"
              for r in rows]
    lines += [f"- {line}" for line in skipped]
    lines += ["", "## Parts", "", "| part | status | seconds |", "|---|---|---|"]
    lines += [f"| {o.part.title} | {o.status} | {o.seconds:.1f} |" for o in outcomes]
    for o in outcomes:
        lines += ["", f"### {o.part.title}", "", f"`python {' '.join(o.part.args)}`: {o.status}"]
        if o.figures:
            lines += ["", o.figures.strip()]
        if o.tail:
            lines += ["", "Last lines of its output:", "", "```text", o.tail, "```"]
    return "\n".join(lines) + "\n"

