"""python -m lab.doctor: the first command to run on a new host. It says what the host has and checks,
each in a row of a table with its time, that the engine works there: stage threads and stage
processes agree bit for bit, gloo works on loopback, every schedule gives the unpipelined gradients,
traces are in order, and, on a host with GPUs, the same on the GPUs (one GPU shared by K=1, 2 and 3
stages, a hop to the host, serial timing, stage processes on GPUs, NCCL with two GPUs, and the
reproduction CLI). The exit code is 0 only if every row passed.

    python -m lab.doctor            # under ten seconds on a 2-core CPU host
    python -m lab.doctor --no-cli   # leave out the slowest GPU row (lab.reproduce --quick on cuda)
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from engine import GPipe
from engine.schedule import SCHEDULES, Task, upstream

from . import host
from .allreduce import time_all_reduce
from .launch import ROOT

Check = Callable[[], str]   # returns what it saw; raises (AssertionError or any error) if it failed
BATCH, MICRO = 16, 4


@dataclass(frozen=True)
class Row:
    """One check's outcome."""

    name: str
    passed: bool
    seconds: float
    detail: str


def versions() -> list[tuple[str, str]]:
    """What the host has, as (what, value) lines: Python, torch and its CUDA/NCCL, cores, GPUs."""
    info = host.describe()
    lines = [("python", platform.python_version()), ("torch", torch.__version__),
             ("CPU", f"{info['cpu']}, {info['cores']} cores for this process"),
             ("gloo", "available" if dist.is_available() and dist.is_gloo_available() else "missing")]
    if torch.cuda.is_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else "missing"
        lines += [("CUDA", f"{torch.version.cuda} (cuDNN {torch.backends.cudnn.version()}, NCCL {nccl})")]
        lines += [(f"cuda:{k}", f"{torch.cuda.get_device_name(k)}, "
                                f"{torch.cuda.get_device_properties(k).total_memory / 2 ** 30:.0f} GiB")
                  for k in range(torch.cuda.device_count())]
    else:
        lines.append(("GPUs", f"none that torch can use (CUDA build: {torch.version.cuda or 'no, a CPU build'})"))
    shm = shutil.disk_usage("/dev/shm").free / 2 ** 20 if os.path.isdir("/dev/shm") else 0
    lines.append(("/dev/shm", f"{shm:.0f} MiB free (the shared-memory lane between stage processes)"))
    lines.append((host.DEVICE_VARIABLE, os.environ.get(host.DEVICE_VARIABLE, "unset: notebooks use the CPU")))
    return lines


# --- what every check trains -------------------------------------------------------------------

def tanh_stack(layers: int = 6, width: int = 32, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Sequential:
    """A small Linear/Tanh stack, built alike from the seed: the model every check trains."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers - 1)],
                         nn.Linear(width, 4)).to(dtype)


def batch(width: int = 32, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, width, generator=generator, dtype=dtype), torch.randint(0, 4, (BATCH,), generator=generator)


def gradients(devices, stages: int, dtype=torch.float32, **options) -> tuple[list[torch.Tensor], object]:
    """The gradients (on the CPU) and trace of one step of the check model as K stages on `devices`."""
    model = tanh_stack(dtype=dtype)
    x, y = batch(dtype=dtype)
    pipe = GPipe(model, stages, devices=devices, chunks=MICRO, threads_per_stage=1, **options)
    try:
        pipe.step(x, y, nn.functional.cross_entropy)
        return [p.grad.detach().cpu() for p in model.parameters()], pipe.trace
    finally:
        pipe.close()


def unpipelined(dtype=torch.float64) -> list[torch.Tensor]:
    """The same step on the whole mini-batch, no pipeline: the reference every schedule must give."""
    model = tanh_stack(dtype=dtype)
    x, y = batch(dtype=dtype)
    nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.detach() for p in model.parameters()]


def largest_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


def out_of_order(trace) -> list[str]:
    """Tasks that started before the task that produced their input had ended."""
    ends = {(e.chunk, e.micro, e.op): e.end for e in trace.events}
    chunks = 1 + max(e.chunk for e in trace.events)
    late = []
    for e in trace.events:
        before = upstream(Task(e.op, e.micro, e.chunk), chunks)
        if before is not None and e.start < ends[(before.chunk, before.micro, before.op)] - 1e-6:
            late.append(f"{e.op}{e.micro} of chunk {e.chunk}")
    return late


# --- the checks ----------------------------------------------------------------------------------

def threads_equal_one_stage() -> str:
    one, _ = gradients("cpu", 1)
    two, _ = gradients("cpu", 2)
    assert all(torch.equal(a, b) for a, b in zip(one, two)), \
        f"K=2 differs from K=1 by {largest_difference(one, two):.2e}"
    return "K=2 as threads gives K=1's gradients bit for bit"


def processes_equal_threads(lane: str = "auto", device: str = "cpu") -> Check:
    """K=2 as two stage processes (ProcessPool, the model built from this module by name) against
    the same step as threads on the same devices: the losses must be equal bit for bit."""
    def check() -> str:
        from engine.distributed.pool import ProcessPool
        x, y = batch()
        threads = GPipe(tanh_stack(), 2, devices=device, chunks=MICRO, threads_per_stage=1)
        expected = threads.step(x, y, nn.functional.cross_entropy).cpu()
        threads.close()
        with ProcessPool(2, timeout=120, lane=lane, device=device) as pool:
            pool.build("lab.doctor:tanh_stack", {}, chunks=MICRO)
            loss = pool.step(x, y, nn.functional.cross_entropy).cpu()
            used = pool.trace.lane
        assert torch.equal(loss, expected), f"processes' loss {loss.item()!r}, threads' {expected.item()!r}"
        return f"K=2 as two processes on {device} ({used} lane): the threads' loss bit for bit"
    return check


def gloo_on_loopback() -> str:
    result = time_all_reduce(1 << 20, devices=2, rounds=2, timeout=60)
    return f"all-reduce of 1 MiB among 2 processes: {result['seconds'] * 1e3:.1f} ms"


def schedules_match(device: str) -> Check:
    def check() -> str:
        reference = unpipelined()
        worst = []
        for name in SCHEDULES:
            options = {"schedule": name, "virtual_stages": 2} if name == "interleaved" else {"schedule": name}
            got, _ = gradients(device, 2, dtype=torch.float64, **options)
            difference = largest_difference(got, reference)
            assert difference < 1e-10, f"{name} on {device} differs from the unpipelined step by {difference:.2e}"
            worst.append(difference)
        return f"{', '.join(SCHEDULES)}: K=2 within {max(worst):.0e} of the unpipelined step (float64)"
    return check


def trace_in_order(device: str) -> Check:
    def check() -> str:
        _, trace = gradients(device, 2)
        late = out_of_order(trace)
        assert not late, f"started before their input was ready: {', '.join(late[:4])}"
        return f"{len(trace.events)} tasks of K=2, each after the task that produced its input"
    return check


def one_gpu_every_k() -> str:
    got = {k: gradients(["cuda:0"] * k, k)[0] for k in (1, 2, 3)}
    assert all(torch.equal(a, b) for k in (2, 3) for a, b in zip(got[1], got[k])), "K=2 or 3 differs from K=1 on cuda:0"
    cpu, _ = gradients("cpu", 1)
    difference = largest_difference(got[1], cpu)
    assert difference < 1e-4, f"cuda:0 differs from the CPU by {difference:.2e}"
    return f"K=1, 2, 3 on cuda:0 bit for bit alike; {difference:.1e} from the CPU (float32)"


def hop_to_host() -> str:
    got, _ = gradients(["cuda:0", "cpu"], 2, dtype=torch.float64)
    difference = largest_difference(got, unpipelined())
    assert difference < 1e-10, f"a GPU stage then a CPU stage differs by {difference:.2e}"
    return f"stage 0 on cuda:0, stage 1 on the CPU: within {difference:.0e} of the unpipelined step"


def serial_alone() -> str:
    model = tanh_stack(width=256)
    x, y = torch.randn(256, 256), torch.randint(0, 4, (256,))
    pipe = GPipe(model, 2, devices="cuda", chunks=MICRO)
    try:
        pipe.step(x, y, nn.functional.cross_entropy, serial=True)
        events = sorted(pipe.trace.events, key=lambda e: e.start)
    finally:
        pipe.close()
    overlaps = [(a, b) for a, b in zip(events, events[1:]) if b.start < a.end - 1e-6]
    assert not overlaps, f"{len(overlaps)} serial tasks overlap on the GPU, e.g. {overlaps[0]}"
    return f"{len(events)} tasks of a serial run, none overlapping another"


def run_module(args: list[str], timeout: float, env: Optional[dict] = None) -> str:
    """Run `python args...` (a torchrun or lab command) in the project; its output, or an error with it."""
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    if done.returncode != 0:
        raise RuntimeError(f"`python {' '.join(args)}` exited with {done.returncode}: "
                           f"{(done.stdout + done.stderr).strip().splitlines()[-1:]}")
    return done.stdout


def nccl_two_gpus() -> str:
    out = run_module(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "lab.train",
                      "--steps", "3", "--log-every", "1", "--device", "cuda"], timeout=240)
    assert "(nccl)" in out and "# done" in out, f"lab.train over NCCL did not finish: {out[-300:]}"
    return "torchrun -m lab.train --device cuda: 2 ranks, one GPU each, over NCCL, 3 steps"


def reproduce_on_cuda() -> str:
    with tempfile.TemporaryDirectory() as out:
        run_module(["-m", "lab.reproduce", "speedup", "--device", "cuda", "--quick", "--out", out], timeout=300)
        run_module(["-m", "lab.reproduce", "memory", "--device", "cuda", "--quick", "--out", out], timeout=300)
        written = sorted(p.name for p in Path(out).iterdir())
    return f"lab.reproduce speedup and memory --device cuda --quick wrote {', '.join(written)}"


def plan(cli: bool = True) -> tuple[list[tuple[str, Check]], list[str]]:
    """The checks for this host, and lines saying what was left out and why."""
    checks = [("threads: K=2 equals K=1", threads_equal_one_stage),
              ("processes (shared memory)", processes_equal_threads("shm")),
              ("processes (gloo lane)", processes_equal_threads("gloo")),
              ("gloo on loopback", gloo_on_loopback),
              ("every schedule, CPU", schedules_match("cpu")),
              ("trace order, CPU", trace_in_order("cpu"))]
    skipped = []
    if not torch.cuda.is_available():
        skipped.append("no GPU: the CUDA rows (one GPU for K=1..3, schedules, trace order, hop, serial timing, "
                       "processes, NCCL, reproduce --device cuda) were not run")
        return checks, skipped
    checks += [("one GPU: K=1, 2, 3", one_gpu_every_k),
               ("every schedule, GPU", schedules_match("cuda")),
               ("trace order, GPU", trace_in_order("cuda")),
               ("hop GPU to CPU", hop_to_host),
               ("serial timing, GPU", serial_alone),
               ("processes on GPUs", processes_equal_threads(device="cuda"))]
    if torch.cuda.device_count() >= 2:
        checks.append(("NCCL, 2 GPUs", nccl_two_gpus))
    else:
        skipped.append("NCCL: needs 2 GPUs, this host has 1 (stage processes on one GPU talk over gloo, checked above)")
    if cli:
        checks.append(("reproduce --quick on cuda", reproduce_on_cuda))
    else:
        skipped.append("lab.reproduce --device cuda --quick: left out (--no-cli)")
    return checks, skipped


def run_checks(checks: list[tuple[str, Check]], on_row: Callable[[Row], None] = lambda row: None) -> list[Row]:
    """Run each check, timing it; a check that raises fails with the error as its detail."""
    rows = []
    for name, check in checks:
        start = time.perf_counter()
        try:
            detail, passed = check(), True
        except Exception as error:  # every failure becomes a row; the next check still runs
            detail, passed = f"{type(error).__name__}: {error}".splitlines()[0][:300], False
        rows.append(Row(name, passed, time.perf_counter() - start, detail))
        on_row(rows[-1])
    return rows


def format_row(row: Row) -> str:
    return f"{row.name:<30} {'pass' if row.passed else 'FAIL':<5} {row.seconds:6.1f} s  {row.detail}"


def main(argv=None) -> int:
    options = argparse.ArgumentParser(prog="python -m lab.doctor", description=__doc__.splitlines()[0])
    options.add_argument("--no-cli", action="store_true", help="leave out lab.reproduce --device cuda --quick")
    args = options.parse_args(argv)
    for what, value in versions():
        print(f"{what:<18} {value}")
    checks, skipped = plan(cli=not args.no_cli)
    print(f"\n{'check':<30} {'':<5} {'time':>8}  what it saw")
    start = time.perf_counter()
    rows = run_checks(checks, on_row=lambda row: print(format_row(row), flush=True))
    for line in skipped:
        print(f"# {line}")
    failed = [row.name for row in rows if not row.passed]
    print(f"# {len(rows) - len(failed)} of {len(rows)} checks passed in {time.perf_counter() - start:.0f} s"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
