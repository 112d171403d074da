"""The host's share of a task (lab.engine_time.host_time), judged on counts, which are the same on every host:
the engine's Python calls and ATen operators per task beside plain PyTorch's on the same layers."""
import sys

import pytest
import torch

from lab import bench
from lab.engine_time import host_time


@pytest.fixture(scope="module")
def threads():
    return host_time.measure_here(16, rounds=1)


def test_the_engine_makes_at_most_a_quarter_more_python_calls_per_micro_batch_than_plain_pytorch(threads):
    calls = threads["calls"]
    assert calls.ratio() <= 1.25, calls
    assert all(calls.plain[op] > 0 for op in host_time.TASKS)  # each phase was counted, not left at zero
    assert calls.engine["F"] > calls.engine["B"] and calls.engine["between"] > 0  # the loop apart from the tasks


def test_the_engine_runs_the_layers_own_operators(threads):
    ops = threads["ops"]
    assert ops.plain["B"] > ops.plain["F"] > 0  # the backward has more operators than the forward
    for op in host_time.TASKS:
        assert ops.plain[op] <= ops.engine[op] <= ops.plain[op] + 5, (op, ops)  # the layers', plus a few


def test_the_tally_counts_each_task_apart_and_restores_the_profile():
    stage, tally = host_time.Stage(16), host_time._Tally()
    previous = sys.getprofile()
    sys.setprofile(tally)
    try:
        stage.engine_step(2, serial=True)
        counted = tally.counting(lambda: stage.engine_step(2, serial=True))
    finally:
        sys.setprofile(previous)
        stage.close()
    assert set(counted) == {"F", "R", "B", "between"} and min(counted.values()) > 0


def test_a_stage_process_counts_the_same_calls_as_the_stage_thread(threads):
    found = host_time.measure_in_process([16], rounds=1)[16]
    assert found["ops"].engine == threads["ops"].engine  # the chunk's own work, whichever runner
    for op in host_time.TASKS:
        assert found["calls"].engine[op] == threads["calls"].engine[op]
    assert found["calls"].ratio() <= 1.25
    assert all(value > 0 for value in found["seconds"]["engine per micro-batch"])


def test_host_time_prints_its_rows_and_leaves_the_thread_count(capsys):
    before = torch.get_num_threads()
    bench.main(["--host-time", "--quick"])
    rows = [line for line in capsys.readouterr().out.splitlines() if "host time per task" in line]
    assert len(rows) == 6 and all("per micro-batch" in row for row in rows)
    assert torch.get_num_threads() == before
