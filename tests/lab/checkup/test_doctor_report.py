"""python -m lab.doctor's GPU rows in processes of their own, and --report: one markdown file with the
versions, the rows and each part's status, figures and output tail; on this CPU host the GPU parts
say they were skipped. The parts' commands are faked here (their real ones need a GPU)."""
import os
import signal
import sys
from pathlib import Path

import pytest

from engine.schedule import SCHEDULES
from lab import doctor
from lab.checkup import report, subprocesses


def test_a_row_runs_in_a_process_of_its_own_and_says_what_it_saw():
    assert "22 tasks of K=2" in doctor.isolated("trace order, CPU")()
    try:
        doctor.isolated("no such row")()
    except doctor.Failed as error:
        assert "exited with 2" in str(error) and "no check named 'no such row'" in str(error)
    else:
        raise AssertionError("an unknown row passed")


def test_the_reports_rows_each_run_in_a_process_bounded_by_its_deadline(monkeypatch):
    """With the report's deadline every row, the CPU ones too, runs in a process of its own stopped at
    that deadline: the rows end by it by construction, whatever a row does."""
    limits = []
    monkeypatch.setattr(subprocesses, "bounded", lambda args, limit, env=None, grace=0.0: limits.append((args, limit))
                        or (None, ""))
    checks, _ = doctor.checklist(cli=False, deadline=doctor.time.monotonic() + 30)
    assert [name for name, _ in checks][:len(doctor.CPU_ROWS)] == list(doctor.CPU_ROWS)
    rows = doctor.run_checks(checks[:2])
    assert [args[-1] for args, _ in limits] == list(doctor.CPU_ROWS)[:2] and all(0 < limit <= 30 for _, limit in limits)
    assert not any(row.passed for row in rows) and "ran out of its" in rows[0].detail
    assert doctor.checklist(cli=True)[0][0] == (next(iter(doctor.CPU_ROWS)), next(iter(doctor.CPU_ROWS.values())))


def test_the_report_on_a_cpu_host_has_every_section_and_skips_the_gpu_parts(tmp_path, monkeypatch, capsys):
    quick = [(name, doctor.CPU_ROWS[name]) for name in ("threads: K=2 equals K=1", "trace order, CPU")]
    monkeypatch.setattr(doctor, "checklist", lambda cli, deadline: (quick, ["no GPU: the CUDA rows were not run"]))
    monkeypatch.setattr(doctor.torch.cuda, "is_available", lambda: False)
    out = tmp_path / "report.md"
    assert doctor.main(["--report", "--out", str(out)]) == 0
    text = out.read_text()
    for words in ("## Versions", "| torch | " + doctor.torch.__version__, "| threads: K=2 equals K=1 | pass |",
                  "| trace order, CPU | pass |", "no GPU: the CUDA rows were not run", "everything passed"):
        assert words in text, words
    assert text.count("skipped: no CUDA GPU") == 2 * len(report.report_parts(tmp_path))  # table and section
    assert "`python -m pytest -q -p no:cacheprovider -n 0 tests/engine/test_cuda.py`: skipped: no CUDA GPU" in text
    assert f"report written to {out}" in capsys.readouterr().out


def test_each_part_is_bounded_says_its_exit_status_and_leaves_no_process(tmp_path, monkeypatch):
    figures = tmp_path / "table.md"
    figures.write_text("| K | x |\n|---|---|\n| 2 | 1.9 |")
    deadline = doctor.time.monotonic() + 60
    done = report.run_part(report.Part("fine", ["-c", "print('step 20 loss 1.5')"], 30, figures=figures), deadline, 1)
    assert done.passed and done.status == "exit status 0" and "loss 1.5" in done.tail and "| 2 | 1.9 |" in done.figures
    failed = report.run_part(report.Part("fails", ["-c", "import sys; print('oops'); sys.exit(3)"], 30), deadline, 1)
    assert not failed.passed and failed.status == "exit status 3" and failed.tail == "oops"
    pid_file = tmp_path / "pid"
    slow = ["-c", f"import subprocess, time; open({str(pid_file)!r}, 'w').write(str(subprocess.Popen(['sleep', '60'], "
                  f"start_new_session=True).pid)); time.sleep(60)"]   # in a session of its own, as torchrun's workers
    monkeypatch.setattr(report, "MIN_PART_SECONDS", 0.5)
    stopped = report.run_part(report.Part("slow", slow, 2), doctor.time.monotonic() + 2, 1)
    assert not stopped.passed and stopped.status.startswith("timed out after 2 s") and stopped.seconds < 10
    grandchild, until = int(pid_file.read_text()), doctor.time.monotonic() + 5   # killed with the tree: gone soon
    while os.path.exists(f"/proc/{grandchild}") and doctor.time.monotonic() < until:
        doctor.time.sleep(0.05)
    assert not os.path.exists(f"/proc/{grandchild}")
    rows = tmp_path / "rows.md"   # a part that writes its finished rows on Ctrl-C, as lab.reproduce does
    writes = ["-c", f"import time\nprint('sleeping')\ntry:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n"
                    f"    print('interrupted')\n"
                    f"    with open({str(rows)!r}, 'w') as rows:\n"
                    f"        rows.write('| K | x |\\n|---|---|\\n| 2 | 1.8 |')"]
    monkeypatch.setattr(report, "PART_GRACE_SECONDS", 2)
    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a shell's background job: the part gets Ctrl-C all
    try:                                                     # the same (an ignored signal is inherited)
        interrupted = report.run_part(report.Part("interrupted", writes, 4, figures=rows),
                                      doctor.time.monotonic() + 8, 1)
    finally:
        signal.signal(signal.SIGINT, ignored)
    assert interrupted.status.startswith("timed out after 8 s (interrupted") and interrupted.seconds < 9
    assert "| 2 | 1.8 |" in interrupted.figures, \
        f"the rows finished before the deadline are in the report: {interrupted}"
    spent = report.run_part(report.Part("late", ["-c", "pass"], 30), doctor.time.monotonic(), 1)
    assert not spent.passed and spent.status.startswith("skipped: the report's")
    text = report.report_text([("python", sys.version.split()[0])], [], [], [done, failed, stopped, spent], 3.0)
    assert "SOMETHING FAILED" in text and "| fails | exit status 3 |" in text and "```text\noops\n```" in text


def test_the_parts_share_what_the_rows_left_and_end_by_the_reports_deadline(tmp_path, monkeypatch):
    """Each part that runs out its whole limit: still the last one ends by the deadline, and each got
    its share of the time the rows left (here the rows took all of theirs)."""
    clock = [1000.0]
    monkeypatch.setattr(doctor.time, "monotonic", lambda: clock[0])

    def runs_out(args, limit, env=None, grace=0.0):
        clock[0] += limit
        return None, ""
    monkeypatch.setattr(subprocesses, "bounded", runs_out)
    parts = report.report_parts(tmp_path)
    deadline = clock[0] + doctor.REPORT_SECONDS
    clock[0] += doctor.REPORT_ROWS_SECONDS   # the rows' deadline
    outcomes = [report.run_part(part, deadline, 1, later=tuple(parts[i + 1:])) for i, part in enumerate(parts)]
    assert clock[0] <= deadline + 1e-6 and all(o.status.startswith("timed out") for o in outcomes)
    left = doctor.REPORT_SECONDS - doctor.REPORT_ROWS_SECONDS
    for part, outcome in zip(parts, outcomes):
        share = left * part.share / sum(p.share for p in parts)
        assert abs(float(outcome.status.split()[3]) - share) < 1, (part.title, outcome.status, share)


def fake_train_runs(monkeypatch, lane="gloo+nccl", communicators=4, drift=0.0):
    """lab.train's two runs as the NCCL row reads them: the threads' trace, then the ranks' trace
    and output (faked: they need two GPUs)."""
    import json

    def run_module(args, timeout, env=None):
        path = args[args.index("--trace-out") + 1]
        ranks = "torch.distributed.run" in args
        losses = [1.5 * (1 + drift), 1.4] if ranks else [1.5, 1.4]
        with open(path, "w") as f:
            json.dump({"backend": "nccl" if ranks else None, "lane": lane if ranks else "", "losses": losses,
                       "messages": [{"kind": "act"}] * 6 if ranks else []}, f)
        return "NCCL INFO comm 0x1 rank 0 nranks 2 - Init COMPLETE\n" * communicators if ranks else ""
    monkeypatch.setattr(subprocesses, "run_module", run_module)


def test_the_nccl_row_wants_nccl_to_have_carried_the_payloads_and_equal_losses(monkeypatch):
    fake_train_runs(monkeypatch)
    assert "lane gloo+nccl, 4 NCCL communicator(s) made, 6 messages" in doctor.over_nccl()()
    for change, words in (({"lane": "gloo"}, "payloads went through host memory"),
                          ({"communicators": 0}, "NCCL made no communicator"),
                          ({"drift": 1e-3}, "over gloo+nccl")):
        fake_train_runs(monkeypatch, **change)
        try:
            doctor.over_nccl()()
        except AssertionError as error:
            assert words in str(error), (change, error)
        else:
            raise AssertionError(f"passed with {change}")


def test_the_nccl_row_stays_on_loopback_and_within_its_rows_time(monkeypatch):
    """Its two runs together fit in the time an isolated row gets (the report's deadline caps that),
    and its ranks bind gloo and NCCL to the loopback interface."""
    from lab.machine.loopback import loopback_interface
    seen = []
    fake_train_runs(monkeypatch)
    fake = subprocesses.run_module
    monkeypatch.setattr(subprocesses, "run_module", lambda args, timeout, env=None: seen.append((timeout, env)) or
                        fake(args, timeout, env))
    doctor.over_nccl()()
    assert sum(timeout for timeout, _ in seen) <= doctor.ROW_SECONDS
    assert seen[1][1]["NCCL_SOCKET_IFNAME"] == seen[1][1]["GLOO_SOCKET_IFNAME"] == loopback_interface()
    assert "NCCL, 2 GPUs" in doctor.TWO_GPU_ROWS  # run by `isolated`, under the report's deadline


@pytest.mark.timeout(120)
def test_the_check_of_a_schedule_over_nccl_runs_for_real_over_gloo_here():
    """What `--every-schedule-over-nccl` runs per schedule, on this host's CPU: the same two lab.train
    runs, compared; and on a host without two GPUs the command says why it cannot run."""
    said = doctor.over_nccl("interleaved", device="cpu")()
    assert said.startswith("torchrun, 2 ranks, interleaved: group gloo, lane ") and "of two stage threads" in said
    assert set(doctor.SCHEDULE_ROWS) == {f"NCCL, {name}" for name in SCHEDULES}


def test_every_schedule_over_nccl_needs_two_gpus(capsys, monkeypatch):
    monkeypatch.setattr(doctor.torch.cuda, "is_available", lambda: False)
    assert doctor.main(["--every-schedule-over-nccl"]) == 2
    assert "needs 2 GPUs or more, this host has 0" in capsys.readouterr().err


def test_the_gpu_tests_run_in_one_process(tmp_path):
    """A GPU in EXCLUSIVE_PROCESS mode serves one process: the report's pytest part runs
    tests/engine/test_cuda.py in one process (not a pytest-xdist worker per core, each holding contexts of
    its own), and in the suite those tests and the doctor's GPU rows share one worker."""
    import importlib.util

    import test_doctor
    path = Path(__file__).resolve().parents[2] / "engine" / "test_cuda.py"
    spec = importlib.util.spec_from_file_location("gpu_tests", path)
    test_cuda = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(test_cuda)
    [tests] = [part for part in report.report_parts(tmp_path) if part.title == "tests/engine/test_cuda.py"]
    assert tests.args[tests.args.index("-n") + 1] == "0"
    assert test_cuda.pytestmark.name == "xdist_group" and test_cuda.pytestmark.args == ("gpus",)
    assert [m.args for m in test_doctor.test_the_gpu_rows_pass.pytestmark if m.name == "xdist_group"] == [("gpus",)]


def test_a_part_this_hosts_gpus_refuse_is_skipped_saying_why(tmp_path, monkeypatch):
    """One GPU in EXCLUSIVE_PROCESS mode serves one process: the 2-rank lab.train part cannot run
    there (lab.train refuses it), so the report skips it with that reason instead of failing."""
    monkeypatch.setattr(doctor.host, "exclusive_gpus", lambda: True)
    monkeypatch.setattr(doctor.torch.cuda, "device_count", lambda: 1)
    [train] = [part for part in report.report_parts(tmp_path) if part.title.startswith("lab.train")]
    done = report.run_part(train, doctor.time.monotonic() + 60, 1)
    assert done.passed and done.status.startswith("skipped: the GPUs are in EXCLUSIVE_PROCESS compute mode")


@pytest.mark.parametrize("gpus", [1, 8])
def test_on_many_gpus_the_nccl_row_keeps_its_own_time_and_the_rows_end_by_their_deadline(monkeypatch, gpus):
    """On 8 (faked) GPUs, rows that each run out their time leave the NCCL row, last, its
    NCCL_ROW_SECONDS; on one GPU there is no NCCL row and nothing is kept back. Every row ends by the
    rows' deadline, by construction: a row with under a second left is not started, and says so."""
    clock, limits = [1000.0], []
    monkeypatch.setattr(doctor.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(doctor.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(doctor.torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(doctor.host, "stage_processes_refused_here", lambda stages, initialized: None)

    def runs_out(args, limit, env=None, grace=0.0):
        limits.append((args[-1], limit))
        clock[0] += limit
        return None, ""
    monkeypatch.setattr(subprocesses, "bounded", runs_out)
    deadline = clock[0] + doctor.REPORT_ROWS_SECONDS
    checks, _ = doctor.checklist(cli=False, deadline=deadline)
    names = [name for name, _ in checks]
    assert ("NCCL, 2 GPUs" in names) == (gpus >= 2) and (gpus < 2 or names[-1] == "NCCL, 2 GPUs")
    rows = doctor.run_checks(checks)
    assert clock[0] <= deadline and all(row.detail.startswith(("its process ran out", "not run: the rows before"))
                                        for row in rows)
    if gpus >= 2:
        assert limits[-1] == ("NCCL, 2 GPUs", doctor.NCCL_ROW_SECONDS)
