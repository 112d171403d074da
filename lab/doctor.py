"""python -m lab.doctor: the first command to run on a new host. It says what the host has and checks,
each in a row of a table with its time, that the engine works there: stage threads and stage
processes agree bit for bit, gloo works on loopback, every schedule gives the unpipelined gradients,
traces are in order, and, on a host with GPUs, the same on the GPUs (one GPU shared by K=1, 2 and 3
stages, a hop to the host, serial timing, stage processes on GPUs, NCCL with two GPUs, and the
reproduction CLI). Each GPU row runs in a process of its own, so this one never holds a CUDA context
(in EXCLUSIVE_PROCESS mode a GPU serves one process at a time). The exit code is 0 only if every row
passed.

    python -m lab.doctor            # about 25 s on a 2-core CPU host
    python -m lab.doctor --no-cli   # leave out the slowest GPU row (lab.reproduce --quick on cuda)
    python -m lab.doctor --report [--out FILE]   # one markdown file to send back from a GPU host

--report runs, within 8 minutes on one GPU, the rows, tests/engine/test_cuda.py, `lab.reproduce speedup`
and `memory --device cuda --quick` and a 2-rank `lab.train --device cuda` under torchrun on
loopback, each bounded in time, and writes every figure, the versions, and each part's exit status
and the tail of its output to FILE (gpu-report.md). Without a GPU the GPU parts say so.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from engine import GPipe
from engine.schedule import SCHEDULES
from lab.checkup import subprocesses
from lab.checkup.comparisons import (
    CHECK_MODEL,
    GPU_TOLERANCE,
    LOSS,
    MICRO,
    batch,
    check_model,
    gradients,
    largest_difference,
    out_of_order,
    relative_difference,
    trace_slack,
    unpipelined,
)
from lab.checkup.report import (
    REPORT_ROWS_SECONDS,
    REPORT_SECONDS,
    Row,
    report_parts,
    report_text,
    run_part,
)
from lab.machine import host
from lab.machine.gpus import nvidia_smi
from lab.machine.torchrun import free_port
from lab.runs.stepper import Stepper
from lab.studies.allreduce import time_all_reduce
from lab.zoo import mlp

Check = Callable[[], str]   # returns what it saw; raises (AssertionError or any error) if it failed
ROW_SECONDS = 240      # at most, for one GPU row in its own process
NCCL_ROW_SECONDS = 60  # of the rows' time, kept for the NCCL row (it comes last), whatever the rows before it take




def versions() -> list[tuple[str, str]]:
    """What the host has, as (what, value) lines: Python, torch and its CUDA/NCCL, cores, GPUs."""
    info = host.describe()
    lines = [("python", platform.python_version()), ("torch", torch.__version__),
             ("CPU", f"{info['cpu']}, {info['cores']} cores for this process"),
             ("gloo", "available" if dist.is_available() and dist.is_gloo_available() else "missing")]
    if torch.cuda.is_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else "missing"
        lines += [("CUDA", f"{torch.version.cuda} (cuDNN {torch.backends.cudnn.version()}, NCCL {nccl})")]
        lines += gpu_facts()
    else:
        lines.append(("GPUs", f"none that torch can use (CUDA build: {torch.version.cuda or 'no, a CPU build'})"))
    shm = shutil.disk_usage("/dev/shm").free / 2 ** 20 if os.path.isdir("/dev/shm") else 0
    lines.append(("/dev/shm", f"{shm:.0f} MiB free (the shared-memory lane between stage processes)"))
    lines.append((host.DEVICE_VARIABLE, os.environ.get(host.DEVICE_VARIABLE, "unset: notebooks use the CPU")))
    return lines


def gpu_facts() -> list[tuple[str, str]]:
    """The driver, and each GPU's name, memory and compute mode, as nvidia-smi numbers them (it
    creates no CUDA context here); from torch where there is no nvidia-smi."""
    listing = nvidia_smi(["--query-gpu=index,name,memory.total,compute_mode,driver_version",
                          "--format=csv,noheader"])
    if listing is None:
        return [("driver", "unknown (no nvidia-smi)")] + [
            (f"cuda:{k}", f"{torch.cuda.get_device_name(k)}, "
                          f"{torch.cuda.get_device_properties(k).total_memory / 2 ** 30:.0f} GiB")
            for k in range(torch.cuda.device_count())]
    gpus = [[cell.strip() for cell in line.split(",")] for line in listing.strip().splitlines()]
    lines = [("driver", gpus[0][4])] + [(f"GPU {g[0]} (nvidia-smi)", f"{g[1]}, {g[2]}, compute mode {g[3]}")
                                        for g in gpus]
    if any("exclusive" in g[3].lower() for g in gpus):
        lines.append(("compute mode", "exclusive: one process per GPU at a time; the doctor runs each GPU row in "
                                      "a process of its own and holds no CUDA context itself"))
    return lines



def threads_equal_one_stage() -> str:
    """K=2 as stage threads on the CPU gives K=1's gradients bit for bit."""
    one, _ = gradients("cpu", 1)
    two, _ = gradients("cpu", 2)
    assert all(torch.equal(a, b) for a, b in zip(one, two)), \
        f"K=2 differs from K=1 by {largest_difference(one, two):.2e}"
    return "K=2 as threads gives K=1's gradients bit for bit"


def processes_equal_threads(lane: str = "auto", device: str = "cpu") -> Check:
    """K=2 as two stage processes (ProcessPool, the check model built by name) against the same step
    as threads on the same devices: the losses must be equal, bit for bit on the CPU, within
    GPU_TOLERANCE on GPUs. The processes run first: in EXCLUSIVE_PROCESS mode they need GPUs that no
    context of this process holds yet."""
    def check() -> str:
        from lab.processes.pool import ProcessPool
        x, y = batch()
        with ProcessPool(2, timeout=120, lane=lane, device=device) as pool:
            loss, trace, _ = Stepper(CHECK_MODEL, check_model(), 2, pool=pool, chunks=MICRO).step(x, y, LOSS)
        with Stepper(CHECK_MODEL, check_model(), 2, devices=device, chunks=MICRO, threads_per_stage=1) as threads:
            expected, _, _ = threads.step(x, y, LOSS)
        if device == "cpu":
            assert loss == expected, f"processes' loss {loss!r}, threads' {expected!r}"
            return f"K=2 as two processes on {device} ({trace.lane} lane): the threads' loss bit for bit"
        apart = abs(loss - expected) / abs(expected)
        assert apart <= GPU_TOLERANCE, f"processes' loss {loss!r}, threads' {expected!r}"
        return (f"K=2 as two processes on {device} ({trace.lane} lane): the threads' loss within {apart:.0e} "
                f"(tolerance {GPU_TOLERANCE:g})")
    return check


def gloo_on_loopback() -> str:
    """An all-reduce among two processes over gloo on loopback."""
    result = time_all_reduce(1 << 20, devices=2, rounds=2, timeout=60)
    return f"all-reduce of 1 MiB among 2 processes: {result['seconds'] * 1e3:.1f} ms"


def schedules_match(device: str) -> Check:
    """Every schedule's K=2 gradients on `device` against the unpipelined step, in float64."""
    def check() -> str:
        reference = unpipelined()
        worst = []
        for name in SCHEDULES:
            got, _ = gradients(device, 2, dtype=torch.float64, schedule=name,
                               virtual_stages=SCHEDULES[name].fewest_chunks)
            difference = largest_difference(got, reference)
            assert difference < 1e-10, f"{name} on {device} differs from the unpipelined step by {difference:.2e}"
            worst.append(difference)
        return f"{', '.join(SCHEDULES)}: K=2 within {max(worst):.0e} of the unpipelined step (float64)"
    return check


def trace_in_order(device: str) -> Check:
    """Every task of a K=2 step on `device` starts after the task that produced its input ended."""
    def check() -> str:
        slack = trace_slack(device)
        _, trace = gradients(device, 2)
        late = out_of_order(trace, slack)
        assert not late, f"started before their input was ready: {', '.join(late[:4])}"
        return (f"{len(trace.events)} tasks of K=2, each after the task that produced its input "
                f"(within {slack * 1e6:.0f} us)")
    return check


def every_k_on_one(device: str) -> Check:
    """K=1, 2 and 3 stages sharing `device` agree (within GPU_TOLERANCE) and are close to the CPU."""
    def check() -> str:
        got = {k: gradients([device] * k, k)[0] for k in (1, 2, 3)}
        apart = max(relative_difference(got[k], got[1]) for k in (2, 3))
        alike = all(torch.equal(a, b) for k in (2, 3) for a, b in zip(got[1], got[k]))
        assert apart <= GPU_TOLERANCE, f"K=2 or 3 differs from K=1 on {device} by {apart:.1e} of the largest gradient"
        cpu, _ = gradients("cpu", 1)
        difference = largest_difference(got[1], cpu)
        assert difference < 1e-4, f"{device} differs from the CPU by {difference:.2e}"
        return (f"K=1, 2, 3 on {device} {'bit for bit alike' if alike else f'within {apart:.0e} of each other'} "
                f"(tolerance {GPU_TOLERANCE:g} of the largest gradient: cuBLAS promises no bitwise equality across "
                f"streams); {difference:.1e} from the CPU (float32)")
    return check


def hop_to_host(device: str) -> Check:
    """A stage on `device` handing over to a CPU stage gives the unpipelined gradients (float64)."""
    def check() -> str:
        got, _ = gradients([device, "cpu"], 2, dtype=torch.float64)
        difference = largest_difference(got, unpipelined())
        assert difference < 1e-10, f"a stage on {device} then a CPU stage differs by {difference:.2e}"
        return f"stage 0 on {device}, stage 1 on the CPU: within {difference:.0e} of the unpipelined step"
    return check


def serial_alone(device: str) -> Check:
    """A serial step on `device` (its GPUs) runs one task at a time: no two overlap (beyond the origin skew)."""
    def check() -> str:
        slack = trace_slack(device)
        model = mlp.build(**check_model(width=256))
        x, y = mlp.batch(256, 256)
        pipe = GPipe(model, 2, devices=device, chunks=MICRO)
        try:
            pipe.step(x, y, LOSS, serial=True)
            events = sorted(pipe.trace.events, key=lambda e: e.start)
        finally:
            pipe.close()
        overlaps = [(a, b) for a, b in zip(events, events[1:]) if b.start < a.end - slack]
        assert not overlaps, f"{len(overlaps)} serial tasks overlap on {device}, e.g. {overlaps[0]}"
        return f"{len(events)} tasks of a serial run, none overlapping another (within {slack * 1e6:.0f} us)"
    return check


def gpu_sets_the_pace() -> str:
    """The quick Table 2's Transformer, sized on these GPUs (lab.studies.gpu_sizing), judged by `climbed`."""
    from lab.studies import speedup
    return climbed(speedup.gpu_sizing(quick=True))  # as reproduce sizes it: one sizing for both


def climbed(sizing) -> str:
    """A GPU table's sizing that worked: each of K=8's stages with its measured GPU time per task over
    the host's time issuing it, at M=32 (the smallest tasks), a positive number. Whether they reach
    GPU_TARGET is said, not required: a GPU too small for every cell to fit at that ratio gets the
    best size that fits, and its sizing says so."""
    ratios = sizing.ratios
    assert len(ratios) == 8 and all(0 < r < float("inf") for r in ratios), \
        f"the sizing measured no usable stage: ratios {ratios}; {'; '.join(sizing.tried)}"
    return f"quick Table 2 model {sizing.describe()}"


LOSS_TOLERANCE = 1e-4  # relative, a few float32 Adam steps on different GPUs and streams


def over_nccl(schedule: str = "gpipe", device: str = "cuda") -> Check:
    """Two ranks of `lab.train --device DEVICE --schedule SCHEDULE` under torchrun, one GPU each,
    against the same steps as two stage threads: on GPUs the pipeline's group must be NCCL and its
    lane carry payloads on NCCL (the trace's lane "gloo+nccl"), and NCCL must have made communicators
    (only the lane's payloads use NCCL: NCCL_DEBUG=INFO says when it makes one); everywhere messages
    must have crossed and the losses agree. On CPUs the same runs over gloo (how it is tested here)."""
    def check() -> str:
        train = ["-m", "lab.train", "--steps", "3", "--log-every", "1", "--device", device, "--schedule", schedule]
        with tempfile.TemporaryDirectory() as folder:
            reference, ranks = Path(folder) / "threads.json", Path(folder) / "ranks.json"
            subprocesses.run_module([*train, "--stages", "2", "--trace-out", str(reference)],
                                    timeout=ROW_SECONDS / 2 - 5)
            out = subprocesses.run_module(["-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                                           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                                           *train, "--trace-out", str(ranks)],
                                          timeout=ROW_SECONDS / 2 - 5, env=subprocesses.NCCL_ON_LOOPBACK)
            expected, got = (json.loads(path.read_text()) for path in (reference, ranks))
        communicators = out.count("Init COMPLETE")
        if device == "cuda":
            assert got["backend"] == "nccl", f"the pipeline's group is {got['backend']}, not NCCL"
            assert "nccl" in got["lane"], f"the pipe's lane is {got['lane']!r}: payloads went through host memory"
            assert communicators, "NCCL made no communicator: the payloads did not go over NCCL"
        assert got["messages"], "no message crossed between the ranks"
        apart = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], expected["losses"]))
        assert apart <= LOSS_TOLERANCE, f"{schedule}: losses {got['losses']} over {got['lane']}, " \
                                        f"{expected['losses']} as threads"
        return (f"torchrun, 2 ranks, {schedule}: group {got['backend']}, lane {got['lane']}, {communicators} NCCL "
                f"communicator(s) made, {len(got['messages'])} messages; losses within {apart:.0e} of two stage "
                "threads")
    return check


def reproduce_on_cuda() -> str:
    """lab.reproduce speedup and memory --device cuda --quick run to the end and write their files."""
    with tempfile.TemporaryDirectory() as out:
        subprocesses.run_module(["-m", "lab.reproduce", "speedup", "--device", "cuda", "--quick", "--out", out],
                                timeout=300)
        subprocesses.run_module(["-m", "lab.reproduce", "memory", "--device", "cuda", "--quick", "--out", out],
                                timeout=300)
        written = sorted(p.name for p in Path(out).iterdir())
    return f"lab.reproduce speedup and memory --device cuda --quick wrote {', '.join(written)}"


CPU_ROWS: dict[str, Check] = {"threads: K=2 equals K=1": threads_equal_one_stage,
                              "processes (shared memory)": processes_equal_threads("shm"),
                              "processes (gloo lane)": processes_equal_threads("gloo"),
                              "gloo on loopback": gloo_on_loopback,
                              "every schedule, CPU": schedules_match("cpu"),
                              "trace order, CPU": trace_in_order("cpu")}
# run each in a process of its own (isolated); `python -m lab.doctor --row NAME` runs one of either here
GPU_ROWS: dict[str, Check] = {"one GPU: K=1, 2, 3": every_k_on_one("cuda:0"),
                              "every schedule, GPU": schedules_match("cuda"),
                              "trace order, GPU": trace_in_order("cuda"),
                              "hop GPU to CPU": hop_to_host("cuda:0"),
                              "serial timing, GPU": serial_alone("cuda"),
                              "processes on GPUs": processes_equal_threads(device="cuda"),
                              "Table 2 sized for the GPU": gpu_sets_the_pace}


TWO_GPU_ROWS: dict[str, Check] = {"NCCL, 2 GPUs": over_nccl("gpipe")}
# `python -m lab.doctor --every-schedule-over-nccl`: each built-in schedule's own NCCL row (about 3 minutes)
SCHEDULE_ROWS: dict[str, Check] = {f"NCCL, {name}": over_nccl(name) for name in SCHEDULES}


class Failed(Exception):
    """A check that failed in another process; its message is that row's detail."""


def isolated(name: str, deadline: Optional[float] = None) -> Check:
    """The check `name` run by `python -m lab.doctor --row NAME`, a process of its own, for at most
    ROW_SECONDS (or until `deadline`, a time.monotonic() reading): this process holds no CUDA context
    while it, or any later row, runs."""
    def check() -> str:
        limit = ROW_SECONDS if deadline is None else min(ROW_SECONDS, deadline - time.monotonic())
        if limit < 1.0:  # started anyway, it would eat the time kept for the rows after it
            raise Failed("not run: the rows before it used up the report's time for them")
        code, output = subprocesses.bounded(["-m", "lab.doctor", "--row", name], limit)
        said = [line for line in output.splitlines() if line.startswith('{"name": ')]  # stderr is mixed in
        if code is None or not said:
            ended = f"ran out of its {limit:.0f} s" if code is None else f"exited with {code}"
            raise Failed(f"its process {ended}: {(output.strip().splitlines() or [''])[-1][:300]}")
        row = json.loads(said[-1])
        if not row["passed"]:
            raise Failed(row["detail"])
        return row["detail"]
    return check


def checklist(cli: bool = True, deadline: Optional[float] = None) -> tuple[list[tuple[str, Check]], list[str]]:
    """The checks for this host, and lines saying what was left out and why. With a `deadline` (the
    report's), the CPU rows too run each in a process bounded by it: the rows end by it by construction,
    and on two GPUs or more every row but the NCCL one by NCCL_ROW_SECONDS before it (that row's own)."""
    several = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    earlier = deadline - NCCL_ROW_SECONDS if deadline is not None and several else deadline
    checks = list(CPU_ROWS.items()) if deadline is None else [(name, isolated(name, earlier)) for name in CPU_ROWS]
    skipped = []
    if not torch.cuda.is_available():
        skipped.append("no GPU: the CUDA rows (one GPU for K=1..3, schedules, trace order, hop, serial timing, "
                       "processes, NCCL, reproduce --device cuda) were not run")
        return checks, skipped
    refused = host.stage_processes_refused_here(2, False)
    checks += [(name, isolated(name, earlier)) for name in GPU_ROWS if not (refused and name == "processes on GPUs")]
    if refused:
        skipped.append(f"processes on GPUs: {refused}")
    if several:
        checks += [(name, isolated(name, deadline)) for name in TWO_GPU_ROWS]
    else:
        skipped.append("NCCL: needs 2 GPUs, this host has 1 (stage processes on one GPU talk over gloo, checked above)")
    if cli:
        checks.append(("reproduce --quick on cuda", reproduce_on_cuda))
    else:
        skipped.append("lab.reproduce --device cuda --quick: not a row here (--no-cli; --report runs it as a part)")
    return checks, skipped


def run_checks(checks: list[tuple[str, Check]], on_row: Callable[[Row], None] = lambda row: None) -> list[Row]:
    """Run each check, timing it; a check that raises fails with the error as its detail."""
    rows = []
    for name, check in checks:
        start = time.perf_counter()
        try:
            detail, passed = check(), True
        except Exception as error:  # every failure becomes a row; the next check still runs
            said = str(error) if isinstance(error, Failed) else f"{type(error).__name__}: {error}"
            detail, passed = (said.splitlines() or [""])[0][:300], False
        rows.append(Row(name, passed, time.perf_counter() - start, detail))
        on_row(rows[-1])
    return rows


def format_row(row: Row) -> str:
    """A row as one line of the printed table."""
    return f"{row.name:<30} {'pass' if row.passed else 'FAIL':<5} {row.seconds:6.1f} s  {row.detail}"



def run_row(name: str) -> int:
    """Run one check here and print its row as JSON, the last line (`isolated` reads it)."""
    checks = {**CPU_ROWS, **GPU_ROWS, **TWO_GPU_ROWS, **SCHEDULE_ROWS}
    if name not in checks:
        print(f"python -m lab.doctor: error: no check named {name!r}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(run_checks([(name, checks[name])])[0])), flush=True)
    return 0


def every_schedule_over_nccl() -> int:
    """Each built-in schedule's NCCL row, printed as it ends; exit status 1 if one fails (2 GPUs needed)."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print("python -m lab.doctor: error: --every-schedule-over-nccl needs 2 GPUs or more, this host has "
              f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}", file=sys.stderr)
        return 2
    rows = run_checks(list(SCHEDULE_ROWS.items()), on_row=lambda row: print(format_row(row), flush=True))
    return 0 if all(row.passed for row in rows) else 1


def main(argv=None) -> int:
    """Print the versions and run the rows (with --report, the parts too, and write the report)."""
    options = argparse.ArgumentParser(prog="python -m lab.doctor", description=__doc__.splitlines()[0])
    options.add_argument("--no-cli", action="store_true", help="leave out lab.reproduce --device cuda --quick")
    options.add_argument("--report", action="store_true", help="also run the GPU parts and write one markdown file")
    options.add_argument("--out", default="gpu-report.md", help="the report's file (default gpu-report.md)")
    options.add_argument("--every-schedule-over-nccl", action="store_true",
                         help="only the NCCL row, once per built-in schedule (2 GPUs or more)")
    options.add_argument("--row", help=argparse.SUPPRESS)  # one check, in this process, as JSON (see isolated)
    args = options.parse_args(argv)
    if args.row:
        return run_row(args.row)
    if args.every_schedule_over_nccl:
        return every_schedule_over_nccl()
    with sizing_kept():
        return run_doctor(args)


@contextmanager
def sizing_kept():
    """For this run, a file where the GPU sizing is kept (gpu_sizing.SIZING_FILE): the sizing row's
    process finds it once, and reproduce --quick reads it instead of sizing again."""
    from lab.studies.gpu_sizing import SIZING_FILE
    if os.environ.get(SIZING_FILE):
        yield
        return
    with tempfile.TemporaryDirectory() as folder:
        os.environ[SIZING_FILE] = os.path.join(folder, "gpu-sizing.json")
        try:
            yield
        finally:
            del os.environ[SIZING_FILE]


def run_doctor(args) -> int:
    """The rows, printed as they end (with --report the parts too, and the report written)."""
    start = time.perf_counter()
    deadline = time.monotonic() + REPORT_SECONDS if args.report else None
    rows_deadline = deadline - (REPORT_SECONDS - REPORT_ROWS_SECONDS) if args.report else None
    facts = versions()
    for what, value in facts:
        print(f"{what:<18} {value}")
    checks, skipped = checklist(cli=not (args.no_cli or args.report), deadline=rows_deadline)
    print(f"\n{'check':<30} {'':<5} {'time':>8}  what it saw")
    rows = run_checks(checks, on_row=lambda row: print(format_row(row), flush=True))
    for line in skipped:
        print(f"# {line}")
    failed = [row.name for row in rows if not row.passed]
    print(f"# {len(rows) - len(failed)} of {len(rows)} checks passed in {time.perf_counter() - start:.0f} s"
          + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    if not args.report:
        return 1 if failed else 0
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with tempfile.TemporaryDirectory() as folder:
        outcomes, parts = [], report_parts(Path(folder))
        for index, part in enumerate(parts):
            outcomes.append(run_part(part, deadline, gpus, later=tuple(parts[index + 1:])))
            print(f"# {part.title}: {outcomes[-1].status}", flush=True)
    Path(args.out).write_text(report_text(facts, rows, skipped, outcomes, time.perf_counter() - start))
    print(f"# report written to {args.out}: please send this one file back")
    return 1 if failed or not all(o.passed for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
