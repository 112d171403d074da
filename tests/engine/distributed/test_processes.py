"""Stages as processes (GPipe(..., group=...)): the same results as threads, bit for bit; faults
raised on every rank within bounds; local pools and torchrun launches that leave nothing behind."""
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from listeners import beyond_loopback, listening
from shm_files import shm_left, shm_prefix
from small_models import mlp, pair_model
from torch import nn

from engine import GPipe
from engine.schedule import SCHEDULES
from lab.machine.host import exclusive_gpus
from lab.machine.process_tree import descendants, running
from lab.machine.torchrun import two_nodes
from lab.processes.pool import ProcessPool, StageProcessError

ROOT = Path(__file__).resolve().parents[3]
FAULTS = str(ROOT / "tests" / "helpers" / "distributed_faults.py")
LOSS = nn.functional.cross_entropy


@pytest.fixture(scope="module")
def pools():
    """One long-lived pool per K (and lane), shared by the tests of this module (starting one costs
    seconds). On one host the stages talk through shared memory unless the gloo lane is asked for."""
    made = {}

    def get(stages, lane="auto"):
        if (stages, lane) not in made or not made[(stages, lane)].alive:
            made[(stages, lane)] = ProcessPool(stages, lane=lane)
        return made[(stages, lane)]
    yield get
    for pool in made.values():
        pool.close()


def test_the_tests_that_share_the_pools_run_on_one_worker(pools, request):
    """Under `pytest -n`, every test that takes a shared costly fixture is sent to one worker, so the
    fixture starts once (tests/conftest.py marks them; pytest-xdist reads the mark into the test's id,
    which pytest 9.2 no longer lets it do, and which a mark added after xdist's hook misses)."""
    if not getattr(request.config.option, "loadgroup", False):  # set in a worker of --dist loadgroup
        pytest.skip("only under pytest -n with --dist loadgroup, as pytest.ini runs the suite")
    assert request.node.nodeid.endswith("@pools"), request.node.nodeid


def threads_run(model, batch, steps, **options):
    """The same training with stage threads: (model, losses)."""
    x, y = batch
    pipe = GPipe(model, threads_per_stage=1, **options)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        losses.append(pipe.step(x, y, LOSS))
        optimizer.step()
    pipe.close()
    return model, losses


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stages,lane", [(2, "auto"), (3, "auto"), (2, "gloo")])
def test_three_optimizer_steps_bitwise_equal_to_threads(pools, batch, stages, lane):
    pool = pools(stages, lane)
    for schedule, kind in SCHEDULES.items():
        virtual = kind.fewest_chunks
        for checkpoint in ("never", "always"):
            options = dict(balance=stages, chunks=2 * stages, seed=7, schedule=schedule, checkpoint=checkpoint,
                           deferred_batch_norm=True, virtual_stages=virtual)
            pool.build("small_models:mlp", dict(dropout=0.3, batch_norm=True),
                       optimizer=("torch.optim.SGD", {"lr": 0.1}), **options)
            losses = [pool.step(*batch, LOSS) for _ in range(3)]
            assert all(torch.equal(loss, pool.losses[0]) for loss in pool.losses), "every rank returns the loss"
            assert pool.trace.lane == ("gloo" if lane == "gloo" else "shared memory")
            model, expected = threads_run(mlp(dropout=0.3, batch_norm=True), batch, 3, **options)
            where = f"K={stages}, {schedule}, checkpoint={checkpoint}"
            assert [loss.item() for loss in losses] == [loss.item() for loss in expected], where
            assert all(torch.equal(a, b) for a, b in zip(pool.parameters(), model.parameters())), where
            assert all(torch.equal(a, b) for a, b in zip(pool.buffers(), model.buffers())), where


@pytest.mark.timeout(120)
def test_uneven_micro_batches_tuples_and_forward_cross_processes(pools):
    pool = pools(2)
    torch.manual_seed(3)
    x, y = torch.randn(23, 16), torch.randint(0, 3, (23,))  # torch.chunk: 6, 6, 6, 5
    pool.build("small_models:pair_model", {}, balance=[2, 3], chunks=4)
    loss = pool.step(x, y, LOSS)
    reference = pair_model()
    expected = LOSS(reference(x), y)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    trace = pool.trace
    assert trace.transport == "processes" and trace.micro_batches == 4 and trace.stages == 2
    assert {(e.stage, e.op) for e in trace.events} == {(s, op) for s in (0, 1) for op in "FRB"}
    sent = [m for m in trace.messages if m.direction == "send"]
    assert len(sent) == 8 and {m.kind for m in sent} == {"act", "grad"}
    # activations: features (float32) + mask (bool) per sample; gradients: features only
    assert trace.boundary_bytes == [{"stages": (0, 1), "activations": 23 * (16 * 4 + 1), "gradients": 23 * 16 * 4}]
    assert len(trace.memory) == 2 and all(m.param_bytes > 0 for m in trace.memory)
    out = pool.forward(x)
    assert torch.allclose(out, reference(x), rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(60)
def test_a_failing_stage_is_raised_here_and_the_pool_still_works(pools, batch):
    pool = pools(2)
    x, y = batch
    pool.build("small_models:mlp", {}, chunks=4)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"\[rank 0, stage 0, micro-batch 0, forward \(F0\)\] mat1 and mat2"):
        pool.step(x[:, :5], y, LOSS)
    assert time.monotonic() - start < 5
    assert pool.step(x, y, LOSS).item() > 0


def read_reports(folder):
    return [json.loads(line) for path in sorted(Path(folder).glob("rank*.jsonl"))
            for line in path.read_text().splitlines()]


def run_torchrun(args, timeout, folder):
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", *args], cwd=ROOT, capture_output=True,
                            text=True, timeout=timeout, env={**os.environ, "GPIPE_FAULTS_OUT": str(folder)})
    return result, read_reports(folder)


def by_scenario(reports):
    grouped = {}
    for report in reports:
        grouped.setdefault(report["scenario"], []).append(report)
    return grouped


RUNS, BACKWARD_RUNS = 10, 50  # a failure's clean-up once raced a survivor in 1 backward run of 12, a core busy


@pytest.mark.timeout(240)
def test_faults_under_torchrun_are_raised_on_every_rank_promptly_every_time(tmp_path):
    """Each fault RUNS times (the backward one BACKWARD_RUNS times) in a new pipe, with a process of
    this test keeping a core busy: in every run every rank raises the original failure (the stage,
    micro-batch and exception that started it) within 5 s, never what the failure's clean-up left
    (a segment gone from /dev/shm). A forged "end" message (garbled, pickled, of another form) is a
    clear error naming its sender, and nothing is unpickled."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        result, reports = run_torchrun(["--standalone", "--nproc-per-node", "3", FAULTS, "errors", str(RUNS),
                                                     str(BACKWARD_RUNS)], 230,
                                       tmp_path)
    finally:
        busy.kill()
        busy.wait()
    assert result.returncode == 0, result.stderr[-3000:]
    scenarios = by_scenario(reports)
    assert not [r for r in reports if "/dev/shm" in r.get("message", "")]

    def raised(name, runs=RUNS):
        """Each run's outcome on every rank: {run: {rank: report}}."""
        outcomes = {}
        for run in range(runs):
            failed_at = min(r["failed_at"] for r in scenarios[name] if "failed_at" in r and r["run"] == run)
            outcomes[run] = {r["rank"]: r for r in scenarios[name] if "raised" in r and r["run"] == run}
            assert sorted(outcomes[run]) == [0, 1, 2], f"{name}, run {run}: every rank reports"
            assert max(r["at"] for r in outcomes[run].values()) - failed_at < 5, f"{name}, run {run}: within 5 s"
        return outcomes.values()

    def told(outcome, ranks, cause):
        return all(outcome[r]["raised"] == "StageFailed" and cause in outcome[r]["message"] for r in ranks)

    for forward in raised("forward"):  # in stage 2's forward of micro-batch 2
        assert forward[2]["raised"] == "ZeroDivisionError"
        assert forward[2]["message"].startswith("[rank 2, stage 2, micro-batch 2, forward (F2)] boom in forward")
        assert told(forward, (0, 1), "ZeroDivisionError: [rank 2, stage 2, micro-batch 2, forward (F2)]"), forward
    recovered = [r for r in scenarios["recovers"] if "loss" in r]
    assert len(recovered) == 3 and len({r["loss"] for r in recovered}) == 1  # the same pipe, the same loss

    for backward in raised("backward", runs=BACKWARD_RUNS):  # in stage 0's backward of micro-batch 3
        assert backward[0]["raised"] == "KeyError" and "[rank 0, stage 0, micro-batch 3, backward (B3)]" in \
            backward[0]["message"]
        assert told(backward, (1, 2), "KeyError: [rank 0, stage 0, micro-batch 3, backward (B3)]"), backward

    for missing in raised("missing inputs"):
        assert missing[0]["raised"] == "ValueError" and "inputs are missing on rank 0" in missing[0]["message"]
        assert told(missing, (1, 2), "inputs are missing on rank 0"), missing
    for missing in raised("missing targets"):
        assert missing[2]["raised"] == "ValueError" and "targets are missing on rank 2" in missing[2]["message"]
        assert told(missing, (0, 1), "targets are missing on rank 2"), missing

    outputs = {r["rank"]: r["output"] for r in scenarios["forward only"]}
    assert outputs == {0: None, 1: None, 2: [24, 3]}
    for name, why in (("garbled end", "a row that says loss"), ("pickled end", "a row that says loss"),
                      ("end of another form",
                       "expected (loss, batch size, trace) as bytes, got a float32 tensor of shape (3,)")):
        [forged] = raised(name, runs=1)
        said = "[rank 1, stage 1] the 'end' message from stage 2 is malformed: "
        assert forged[1]["raised"] == "Malformed" and forged[1]["message"].startswith(said + why), forged[1]
        assert told(forged, (0, 2), "Malformed: " + said), forged
    assert not (tmp_path / "unpickled").exists(), "a rank unpickled what another sent"
    garbled = by_scenario(reports)["garbled trace"]  # the step's loss and batch size were true: it stands
    assert len([r for r in garbled if "loss" in r]) == 3 and len({r["loss"] for r in garbled if "loss" in r}) == 1
    read = {r["rank"]: r for r in garbled if "raised" in r}  # the trace read on ranks 0 and 1 names its sender
    assert read[2]["raised"] is None and all(read[r]["raised"] == "Malformed" for r in (0, 1)), read
    assert read[1]["message"].startswith("the trace pieces from stage 2 are malformed: a table of"), read[1]
    assert read[0]["message"].startswith("the trace pieces from stage 1 are malformed: "), read[0]
    [size] = raised("group size", runs=1)
    assert all(r["raised"] == "ValueError" and "the group has 3 ranks but the pipeline has 4 stages" in r["message"]
               for r in size.values())


@pytest.mark.timeout(120)
def test_a_rank_killed_on_another_node_is_raised_by_the_survivor_within_15_seconds(tmp_path):
    prefix = shm_prefix()
    two_nodes([FAULTS, "kill"], "kill-test", timeout=90,
              env={"GPIPE_FAULTS_OUT": str(tmp_path), "GPIPE_SHM_PREFIX": prefix},
              done=lambda: any(r.get("raised") for r in read_reports(tmp_path)))
    reports = read_reports(tmp_path)
    killed_at = next(r["failed_at"] for r in reports if "failed_at" in r)
    survivor = next(r for r in reports if r.get("raised"))
    assert survivor["rank"] == 0 and survivor["raised"] == "StageFailed"
    assert "[rank 1, stage 1] unreachable" in survivor["message"]
    assert survivor["at"] - killed_at < 15
    # both "nodes" are this host: the survivor waited on a shared-memory slot when its writer died
    assert [r["lane"] for r in reports if "lane" in r] == ["shared memory"]
    assert shm_left(prefix) == [], "nothing of the pipe stays in /dev/shm"


@pytest.mark.timeout(90)
def test_a_payload_that_never_lands_is_reported_by_every_rank_within_its_bound(tmp_path, monkeypatch):
    """Rank 1's receive of F1's activation is a transfer that never completes (as an NCCL receive whose
    send never came). A pending payload is never taken for a deadlock, but it is posted with its edge:
    at the wait bound the first rank to reach it fails the call on every rank, saying what each waits
    for, rank 1's payload and its edge among them."""
    monkeypatch.setenv("GPIPE_LANE", "gloo")
    monkeypatch.setenv("GPIPE_WAIT_SECONDS", "3")      # a header; a payload gets 1 s more to move
    monkeypatch.setenv("GPIPE_TRANSFER_SECONDS", "1")
    result, reports = run_torchrun(["--standalone", "--nproc-per-node", "3", FAULTS, "stall"], 80, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    started = min(r["failed_at"] for r in reports if "failed_at" in r)
    raised = {r["rank"]: r for r in reports if "raised" in r}
    assert sorted(raised) == [0, 1, 2] and len({r["message"] for r in raised.values()}) == 1, raised
    said = raised[0]["message"]
    assert re.match(r"stalled: stage [02] waited 3\.\d s for (B3|F1) from stage 1 \(bound 3\.0 s, "
                    r"GPIPE_WAIT_SECONDS\); the others wait: ", said), said
    assert "stage 1 waits for the payload of F1 from stage 0 on the edge ('act', 0, 1)" in said, said
    for report in raised.values():
        assert report["raised"] == "StageFailed" and 3 <= report["at"] - started < 3 + 5, report


@pytest.mark.timeout(120)
def test_a_rank_stopped_while_the_lane_is_made_is_reported_within_the_set_up_bound(tmp_path):
    """Rank 1 stops (SIGSTOP; the test's end kills it) as the gloo lane's groups are made, which block
    until every rank has come, up to the group's one-year timeout: the other gives up on that set-up
    at its bound and says so."""
    try:
        two_nodes([FAULTS, "setup"], "setup-test", timeout=90,
                  env={"GPIPE_FAULTS_OUT": str(tmp_path), "GPIPE_LANE": "gloo", "GPIPE_SETUP_SECONDS": "5"},
                  done=lambda: any(r.get("raised") for r in read_reports(tmp_path)))
    finally:  # the stopped rank outlives its agent (torchrun starts workers in sessions of their own)
        for pid in [r["pid"] for r in read_reports(tmp_path) if "pid" in r]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    reports = read_reports(tmp_path)
    stopped_at = next(r["failed_at"] for r in reports if "failed_at" in r)
    survivor = next(r for r in reports if r.get("raised"))
    assert survivor["rank"] == 0 and survivor["raised"] == "StageFailed", survivor
    assert survivor["message"].startswith("rank 0: making the gloo lane's groups did not finish within 5 s; "
                                          "has a rank died or stopped?"), survivor
    assert survivor["at"] - stopped_at < 5 + 10


@pytest.mark.timeout(120)
def test_a_pool_listens_on_loopback_only(pools, batch):
    """Nothing of a ProcessPool listens where another machine could reach it: its stage processes
    meet at a Store in a file of a private folder (a TCPStore listened on every interface) and bind
    gloo to loopback, also on its gloo lane."""
    before = listening([os.getpid()])
    pool = pools(2, "gloo")
    pool.build("small_models:mlp", {}, chunks=4)
    pool.step(*batch, LOSS)
    sockets = listening([os.getpid(), *pool.pids])
    assert {pid for pid, _, _ in sockets} == set(pool.pids) and listening([os.getpid()]) == before, sockets
    assert not beyond_loopback(sockets), sockets
    assert os.stat(pool._meeting.folder).st_mode & 0o777 == 0o700


def test_stage_processes_bind_gloo_and_nccl_to_loopback_whatever_the_host_name_resolves_to(monkeypatch):
    """Where the host name resolves to a network address, gloo would listen there: each stage process
    starts with GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME naming the loopback interface (a child gets
    the environment it is started with: test_forker.py)."""
    from lab.machine.loopback import loopback_interface
    from lab.processes import children
    started, start = [], children._start
    monkeypatch.setattr(children, "_start", lambda fd, name, env: started.append(env) or start(fd, name, env))
    with ProcessPool(2):
        pass
    assert [(env["GLOO_SOCKET_IFNAME"], env["NCCL_SOCKET_IFNAME"]) for env in started] \
        == [(loopback_interface(),) * 2] * 2


@pytest.mark.timeout(120)
@pytest.mark.parametrize("lane", ["shm", "gloo"])
def test_a_pool_closes_without_waiting_out_a_timeout(batch, lane):
    """Closing ends the lane's threads as soon as the goodbyes are through: a sender thread that
    waited on a send forever used to hold every close for the 5 s join timeout, on every close. The
    bound is a liveness bound, ten times the 0.5-0.8 s a close takes on a 2-core host: it fails when
    a close waits out a timeout, not when the host is slow."""
    x, y = batch
    pool = ProcessPool(2, lane=lane)
    pool.build("small_models:mlp", {}, chunks=4)
    pool.step(x, y, LOSS)
    start = time.monotonic()
    pool.close()
    assert time.monotonic() - start < 8, f"closing took {time.monotonic() - start:.1f} s"
    assert not os.path.exists(pool._meeting.folder), "the pool's Store goes with it"


@pytest.mark.timeout(120)
def test_a_killed_stage_process_is_reported_and_the_pool_leaves_nothing(batch):
    x, y = batch
    pool = ProcessPool(2)
    pids = pool.pids
    pool.build("small_models:mlp", {}, chunks=4)
    pool.step(x, y, LOSS)
    pool.kill(1)
    start = time.monotonic()
    with pytest.raises(StageProcessError, match=r"stage 1's process died \(exit codes \{1: -9\}\)"):
        pool.step(x, y, LOSS)
    assert time.monotonic() - start < 15
    assert not pool.alive and not [pid for pid in pids if running(pid)]
    assert shm_left(pool._shm_prefix) == [], "nothing of the pool stays in /dev/shm"
    with pytest.raises(StageProcessError, match="make a new ProcessPool"):
        pool.step(x, y, LOSS)


@pytest.mark.timeout(120)
def test_stage_processes_die_with_their_parent(tmp_path):
    script = ("import sys, time; sys.path[:0] = [%r, %r]\n"
              "from lab.processes.pool import ProcessPool\n"
              "pool = ProcessPool(2)\n"
              "print(*pool.pids, flush=True)\n"
              "time.sleep(60)\n") % (str(ROOT), str(ROOT / "tests" / "helpers"))
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        stages = [int(p) for p in parent.stdout.readline().split()]
        pids = descendants(parent.pid)  # the stage processes, and the forker they came from (lab/processes/forker.py)
        assert len(stages) == 2 and set(stages) <= set(pids) and all(running(p) for p in pids)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if running(p)]


def test_bad_use_of_group_is_a_clear_error(batch):
    with pytest.raises(ValueError, match="needs torch.distributed initialized first"):
        GPipe(mlp(), 2, group=object())
    with pytest.raises(ValueError, match="recipe='nothing': expected 'package.module:function'"):
        from lab.processes.children import resolve
        resolve("nothing")


def local_function():
    return mlp()


def test_a_recipe_from_main_or_a_notebook_is_refused_with_a_hint(pools):
    pool = pools(2)
    local_function.__module__ = "__main__"
    with pytest.raises(ValueError, match="stage processes cannot import it"):
        pool.build(local_function)


TWO_GPUS_OF_THEIR_OWN = [pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
                         pytest.mark.skipif(exclusive_gpus(), reason="EXCLUSIVE_PROCESS GPUs: each rank's threads "
                                            "reference spans both GPUs")]


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=TWO_GPUS_OF_THEIR_OWN)])
@pytest.mark.timeout(180)
def test_torchrun_stages_match_threads_on_cpus_and_on_two_gpus_over_nccl(tmp_path, kind):
    """tests/helpers/distributed_cuda.py: the same body on CPU cores (shared memory) in CI, on 2 GPUs over NCCL
    where there are: a mistake in its own code fails here first."""
    result, reports = run_torchrun(["--standalone", "--nproc-per-node", "2",
                                    str(ROOT / "tests" / "helpers" / "distributed_cuda.py"), kind], 170, tmp_path)
    from lab.checkup.comparisons import GPU_TOLERANCE
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(reports) == 2 and all(r["apart"] <= GPU_TOLERANCE for r in reports), reports
    assert all(r["lane"] == ("gloo+nccl" if kind == "cuda" else "shared memory") for r in reports), reports


@pytest.mark.timeout(120)
def test_one_rank_with_several_chunks_hands_activations_to_itself(batch):
    x, y = batch
    with ProcessPool(1) as pool:
        pool.build("small_models:mlp", {}, chunks=2, schedule="interleaved", virtual_stages=3)
        loss = pool.step(x, y, LOSS)
        assert {e.chunk for e in pool.trace.events} == {0, 1, 2} and not pool.trace.messages
    reference = mlp()
    assert loss.item() == pytest.approx(LOSS(reference(x), y).item(), rel=1e-6)


@pytest.mark.timeout(240)
def test_rebuilding_a_pipe_fifty_times_leaks_no_group_thread_or_file_descriptor(pools, batch):
    pool = pools(2)
    x, y = batch

    def build_and_step():
        pool.build("small_models:mlp", {}, chunks=2)
        pool.step(x, y, LOSS)

    for _ in range(2):
        build_and_step()
    after_two = pool.resources()
    for _ in range(48):
        build_and_step()
    after_fifty = pool.resources()
    for rank, (two, fifty) in enumerate(zip(after_two, after_fifty)):
        for what in ("process groups", "threads", "file descriptors"):
            assert fifty[what] <= two[what], f"stage {rank}: {what} grew from {two[what]} to {fifty[what]}"


def test_the_thread_engine_never_imports_the_process_path():
    code = ("import sys, torch; from torch import nn; from engine import GPipe, balance_by_time\n"
            "model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))\n"
            "pipe = GPipe(model, balance_by_time(2, model, torch.randn(3, 4)), chunks=2)\n"
            "pipe.step(torch.randn(6, 4), torch.randint(0, 2, (6,)), nn.functional.cross_entropy)\n"
            "print(sorted(m for m in sys.modules if m.startswith('engine.distributed')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


@pytest.mark.timeout(120)
def test_larger_values_and_more_messages_than_slots_travel_through_shared_memory(pools, batch):
    pool = pools(2)
    pool.built_with = None
    x, y = batch
    reference = mlp()
    for chunks, size in ((4, 8), (4, 24), (4, 5), (16, 24)):  # a larger payload, then 12 messages a kind in a call
        if chunks != pool.built_with:
            pool.build("small_models:mlp", {}, chunks=chunks)
            pool.built_with = chunks
        loss = pool.step(x[:size], y[:size], LOSS)
        assert pool.trace.lane == "shared memory"
        assert loss.item() == pytest.approx(LOSS(reference(x[:size]), y[:size]).item(), rel=1e-6), (chunks, size)
        grads = pool.gradients()
        reference.zero_grad()
        LOSS(reference(x[:size]), y[:size]).backward()
        assert all(torch.allclose(g, p.grad, rtol=1e-5, atol=1e-7) for g, p in zip(grads, reference.parameters()))


def test_a_waiting_stage_spins_only_where_every_stage_has_a_core(monkeypatch):
    """Spin, then sleep: on 2 cores two one-thread stage processes poll before they sleep; three,
    or two of two threads each, would take a core another stage needs, so they sleep at once.
    GPIPE_SPIN_SECONDS (what ProcessPool(spin=) sets) overrides the rule; a bad value is named."""
    from engine.distributed import shm_lane
    monkeypatch.delenv("GPIPE_SPIN_SECONDS", raising=False)
    monkeypatch.setattr(shm_lane, "cpu_cores", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert shm_lane.spin_for(2) == shm_lane.SPIN_SECONDS > 0
    assert shm_lane.spin_for(3) == 0
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert shm_lane.spin_for(2) == 0
    for asked, seconds in (("0", 0.0), ("0.01", 0.01)):
        monkeypatch.setenv("GPIPE_SPIN_SECONDS", asked)
        assert shm_lane.spin_for(5) == seconds
    for bad in ("soon", "-1", "2"):
        monkeypatch.setenv("GPIPE_SPIN_SECONDS", bad)
        with pytest.raises(ValueError, match=f"GPIPE_SPIN_SECONDS={bad!r}"):
            shm_lane.spin_for(2)
    with pytest.raises(ValueError, match="spin=-0.5"):
        ProcessPool(2, spin=-0.5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("spin", [0.0, 0.05])
def test_stages_that_sleep_at_once_or_spin_long_train_bitwise_like_threads(batch, spin):
    x, y = batch
    with ProcessPool(2, spin=spin) as pool:
        pool.build("small_models:mlp", {}, balance=2, chunks=4, optimizer=("torch.optim.SGD", {"lr": 0.1}))
        losses = [pool.step(x, y, LOSS) for _ in range(2)]
        model, expected = threads_run(mlp(), batch, 2, balance=2, chunks=4)
        assert [loss.item() for loss in losses] == [loss.item() for loss in expected]
        assert all(torch.equal(a, b) for a, b in zip(pool.parameters(), model.parameters()))


def test_a_new_pool_sweeps_the_files_of_pools_whose_process_is_gone():
    from lab.processes.pool import sweep_orphans
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, mine = f"gpipe-pool{int(gone.stdout)}-0-test", f"gpipe-pool{os.getpid()}-999-test"
    for name in (dead, mine):
        Path("/dev/shm", name).write_bytes(b"x")
    try:
        assert dead in sweep_orphans() and not Path("/dev/shm", dead).exists()
        assert Path("/dev/shm", mine).exists(), "a live process's pool files stay"
    finally:
        for name in (dead, mine):
            Path("/dev/shm", name).unlink(missing_ok=True)


def test_a_new_meeting_sweeps_the_store_folders_of_processes_that_are_gone(tmp_path):
    from lab.machine.loopback import sweep_orphan_folders
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, mine, other = (tmp_path / name for name in (f"gpipe-store-{int(gone.stdout)}-test",
                                                      f"gpipe-store-{os.getpid()}-test", "gpipe-store-unnamed"))
    for folder in (dead, mine, other):
        folder.mkdir()
        (folder / "store").write_bytes(b"x")
    assert sweep_orphan_folders(str(tmp_path)) == [dead.name]
    assert not dead.exists() and mine.exists() and other.exists(), "a live process's folder and others stay"


@pytest.mark.timeout(600)
def test_pools_killed_with_their_process_groups_leave_nothing_once_a_new_pool_starts(tmp_path):
    """20 times, a parent stepping a pool is killed together with its stage processes (SIGKILL to
    the process group, in the middle of a step, as a supervisor or the OOM killer would): then a new
    pool starts, and nothing of the killed ones is left in /dev/shm or the temporary folder (their
    Stores), nor any of their processes."""
    import json
    import random
    import signal

    from lab.processes.children import ChildFailed, Children
    killed, rng = [], random.Random(0)
    for wave in range(5):  # four parents at a time
        ready = [tmp_path / f"ready-{wave}-{i}.json" for i in range(4)]
        parents = Children("pool_to_kill:PoolToKill", [(str(path),) for path in ready], name="parent")
        try:
            for index, path in enumerate(ready):
                deadline = time.monotonic() + 120
                while not path.exists():
                    assert index not in parents.dead() and time.monotonic() < deadline, \
                        "the pool did not start stepping"
                    time.sleep(0.05)
                time.sleep(rng.uniform(0, 0.1))  # in one of the first steps, of a few milliseconds each
                os.killpg(parents.pids[index], signal.SIGKILL)
                killed.append(json.loads(path.read_text()))
            with pytest.raises(ChildFailed, match=r"died \(exit codes \{\d: -9"):
                parents.ask([None] * 4, timeout=30)
        finally:
            parents.close()
    assert len(killed) == 20
    left = [name for k in killed for name in os.listdir("/dev/shm") if name.startswith(k["parent"] + "-")]
    print(f"{len(left)} file(s) of the last killed pools in /dev/shm before a new pool started")
    with ProcessPool(2) as pool:
        pool.build("small_models:mlp", {}, chunks=2)
        assert [name for k in killed for name in os.listdir("/dev/shm") if name.startswith(k["parent"] + "-")] == []
        assert [k["store"] for k in killed if os.path.exists(k["store"])] == []
    survivors = [pid for k in killed for pid in k["stages"] if running(pid)]
    assert survivors == [], "no stage process of a killed pool is left"
