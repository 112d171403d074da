"""python -m lab.doctor as a user runs it first on a new host: a table of checks and an exit code."""
import dataclasses
import os
import sys
from pathlib import Path

import pytest
from listeners import beyond_loopback, run_watching_sockets

from lab import doctor
from lab.checkup import comparisons

ROOT = Path(__file__).resolve().parents[3]


# A liveness bound, not a timing: the CPU rows take 22-52 s on the project's 2-core host (docs/gpu.md).
# The GPUs are hidden: on a host with 2 GPUs the NCCL row's torchrun listens beyond loopback (its c10d
# store, as torchrun does, docs/processes.md), and test_the_gpu_rows_pass judges the GPU rows.
@pytest.mark.timeout(180)
def test_the_doctor_passes_every_row_on_this_host_listening_on_loopback_only():
    done, sockets = run_watching_sockets([sys.executable, "-m", "lab.doctor"], timeout=120, cwd=ROOT,
                                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    print(done.stdout)
    assert sockets and not beyond_loopback(sockets), sockets  # its stage processes and all-reduce members
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if line[31:36].strip() in ("pass", "FAIL")]
    assert len(rows) >= 6 and all(line[31:35] == "pass" for line in rows), done.stdout
    for words in ("torch", "cores", "/dev/shm", "processes (shared memory)", "processes (gloo lane)",
                  "gloo on loopback", "every schedule, CPU", "trace order, CPU"):
        assert words in done.stdout, words
    assert float(done.stdout.strip().splitlines()[-1].split(" in ")[1].split(" s")[0]) > 0  # says how long it took


def test_a_failing_check_is_a_fail_row_and_exit_code_one(monkeypatch, capsys):
    def broken() -> str:
        raise AssertionError("K=2 differs from K=1 by 1e-3")
    monkeypatch.setattr(doctor, "checklist", lambda cli, deadline: ([("fine", lambda: "ok"), ("broken", broken)],
                                                               ["left out: x"]))
    assert doctor.main([]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "AssertionError: K=2 differs from K=1 by 1e-3" in out and "# left out: x" in out
    assert "1 of 2 checks passed" in out and "failed: broken" in out


def test_trace_order_finds_a_task_that_started_before_its_input_was_ready():
    _, trace = comparisons.gradients("cpu", 2)
    assert comparisons.out_of_order(trace) == []
    forward = next(e for e in trace.events if e.stage == 1 and e.op == "F")
    producer = next(e for e in trace.events if e.stage == 0 and e.op == "F" and e.micro == forward.micro)
    early = dataclasses.replace(forward, start=producer.end - 1e-3)
    shifted = dataclasses.replace(trace, events=[early if e is forward else e for e in trace.events])
    assert comparisons.out_of_order(shifted) == [f"F{forward.micro} of chunk 1"]
    assert comparisons.out_of_order(shifted, slack=2e-3) == []   # within the GPUs' origin skew, say
    assert comparisons.trace_slack("cpu") == comparisons.CPU_SLACK


@pytest.mark.parametrize("row", [doctor.every_k_on_one, doctor.hop_to_host, doctor.serial_alone,
                                 doctor.schedules_match, doctor.trace_in_order,
                                 lambda device: doctor.processes_equal_threads(device=device)],
                         ids=["every K on one", "hop", "serial", "schedules", "trace order", "processes"])
def test_each_gpu_rows_body_runs_on_the_cpu(row):
    """The doctor's GPU rows are written over a device: CI runs each one's code on the CPU, so a
    mistake in it fails here and not first on a rented GPU (the sizing row's judgement has its own
    test in test_gpu_logic.py; its measurement needs a GPU)."""
    said = row("cpu")()
    assert said and "cuda" not in said


@pytest.mark.xdist_group("gpus")  # beside tests/engine/test_cuda.py, never beside another worker's CUDA context
@pytest.mark.timeout(900)  # the GPU rows, each in a process of its own, up to ROW_SECONDS each
@pytest.mark.skipif(not doctor.torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_gpu_rows_pass():
    if doctor.host.exclusive_gpus() and doctor.torch.cuda.is_initialized():
        pytest.skip("EXCLUSIVE_PROCESS GPUs: this worker's own CUDA context (tests/engine/test_cuda.py ran here) would "
                    "refuse the rows' processes; `python -m lab.doctor` runs them")
    checks, _ = doctor.checklist(cli=False)  # each GPU row in a process of its own
    rows = doctor.run_checks(checks)
    assert all(row.passed for row in rows), [doctor.format_row(row) for row in rows if not row.passed]
