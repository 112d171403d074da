"""The GPU and NCCL paths' decisions, checked on a CPU host with fakes (tests/engine/test_cuda.py runs
the real thing where there is a GPU)."""
import collections
import contextlib
import dataclasses
import os
import queue
import threading
import time

import pytest
import torch
import torch.distributed as dist

from engine.device import pinned
from engine.distributed import gloo_lane
from engine.distributed.gloo_lane import GlooLane
from engine.distributed.transport import ProcessTransport, Ranks, nccl_in, use_nccl
from engine.distributed.works import until_completed
from engine.transport import StageFailed
from lab.studies import gpu_sizing


@pytest.mark.parametrize("backend,config,expected", [
    ("nccl", "nccl", True),
    ("undefined", "cpu:gloo,cuda:nccl", True),          # init_process_group() or init_device_mesh("cuda")
    ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl", True),  # a backend per device type
    ("undefined", "cpu:gloo", False),                    # no backend given, on a host without NCCL
    ("gloo", "gloo", False),
    ("undefined", "cuda:gloo,cpu:gloo", False),
])
def test_nccl_is_found_however_the_group_was_made(monkeypatch, backend, config, expected):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    assert nccl_in(object()) is expected


def test_nccl_only_when_every_rank_has_a_gpu_of_its_own():
    two_gpus = ["GPU-1", "GPU-2"]   # UUIDs: one per physical GPU, whatever index a rank sees it under
    assert use_nccl(["cuda", "cuda"], [True, True], two_gpus)
    assert not use_nccl(["cuda", "cpu"], [True, True], ["GPU-1", ""])
    assert not use_nccl(["cuda", "cuda"], [True, False], two_gpus)            # one group without NCCL
    # two ranks on one GPU (two containers included): NCCL would refuse them, the host path works
    assert not use_nccl(["cuda", "cuda"], [True, True], ["GPU-1", "GPU-1"])


class _NeverCompletes:
    """An NCCL send or receive whose peer never posts the other side."""

    def is_completed(self):
        return False

    def exception(self):
        return None

    def wait(self):
        raise AssertionError("waited on a transfer that never completes")


class _NcclGroup:
    aborted = False

    def abort(self):
        self.aborted = True


def _lane_with_nccl_sends_in_flight():
    """A GlooLane's NCCL state as after posting a send that its failed neighbour will never match."""
    lane = GlooLane.__new__(GlooLane)
    lane.rank, lane.tensor_groups = 0, {1: (_NcclGroup(), 1)}
    lane._reap, lane._wakes, lane._closed, lane._abandoned, lane.error = threading.Condition(), 0, False, False, None
    lane._events = queue.SimpleQueue()
    lane._in_flight = collections.deque([([], [_NeverCompletes()], [torch.empty(64, dtype=torch.uint8)], 1)])
    return lane


def test_a_failed_call_aborts_nccl_and_frees_the_sender_thread():
    lane = _lane_with_nccl_sends_in_flight()
    sender = threading.Thread(target=lane._complete_sends, daemon=True)
    sender.start()
    lane.begin()                                   # wakes the sender: it polls the send that never completes
    time.sleep(0.2)
    assert sender.is_alive()
    lane.abandon()                                 # what the transport does on any failure of the call
    sender.join(timeout=2)
    assert not sender.is_alive() and not lane._in_flight
    assert all(group.aborted for group, _ in lane.tensor_groups.values())
    with pytest.raises(StageFailed, match="make a new one"):
        lane.begin()                               # a retried step says why it cannot run, instead of hanging


class _EdgeGroup(_NcclGroup):
    """An NCCL edge's group whose peer never posts its side of the probe."""

    def send(self, tensors, peer, tag):
        return _NeverCompletes()

    recv = send


def _unmatched_edges(monkeypatch) -> dict:
    """Two NCCL edges whose peer never posts its side of the probe, on a faked GPU, their aborts recorded."""
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch, "zeros", lambda *shape, device=None: torch.empty(0))
    monkeypatch.setattr(gloo_lane, "abort_groups", lambda groups: [group.abort() for group in groups])
    return {1: (_EdgeGroup(), 1)}


@pytest.mark.parametrize("told", [False, True], ids=["peer silent", "failure told in the store"])
def test_a_peer_dying_while_the_pipe_is_built_ends_connect_with_the_edges_named(monkeypatch, told):
    """connect() polls its probes instead of synchronizing the device: a peer that died while the pipe
    was built (its probe never matched) ends the wait at the deadline, or at once when a failure is
    told in the store, with every edge's group aborted."""
    edges = _unmatched_edges(monkeypatch)
    store = dist.HashStore()
    if told:
        store.set("broken", "[rank 1, stage 1] failed: CUDA out of memory")

    def check():
        if store.check(["broken"]):
            raise StageFailed(store.get("broken").decode())

    start = time.monotonic()
    with pytest.raises(StageFailed, match="out of memory" if told else
                       r"\[\(0, 1\), \(1, 0\)\] not connected within 0.3 s.*has a peer died"):
        gloo_lane.connect(edges, 0, torch.device("cuda", 0), check, within=0.3)
    assert time.monotonic() - start < 5
    assert all(group.aborted for group, _ in edges.values())


def test_connect_aborts_its_edges_however_it_ends(monkeypatch):
    """Not only a peer's failure: the Store failing, NCCL refusing a probe or Ctrl-C while the pipe
    is built leave no edge holding a posted probe (the lane's close then skips NCCL's groups)."""
    edges = _unmatched_edges(monkeypatch)

    def store_gone():
        raise RuntimeError("Connection reset by peer (the Store)")
    with pytest.raises(RuntimeError, match="the Store"):
        gloo_lane.connect(edges, 0, torch.device("cuda", 0), store_gone, within=5)
    assert all(group.aborted for group, _ in edges.values())


def test_a_lost_neighbour_ends_the_wait_for_an_nccl_receive():
    transport = ProcessTransport.__new__(ProcessTransport)
    transport.also_abort = []
    transport.ranks, transport.step, transport._failure = Ranks(0, 2), 3, None
    transport.lane = _lane_with_nccl_sends_in_flight()
    transport.shared = dist.HashStore()
    transport.lane.error = (1, ConnectionResetError("Connection reset by peer"))  # what a listener saw
    start = time.monotonic()
    with pytest.raises(StageFailed, match=r"\[rank 1, stage 1\] unreachable.*reset by peer"):
        until_completed([_NeverCompletes()], transport._check_receiving, every=0.01)
    assert time.monotonic() - start < 1
    assert transport.lane._abandoned


def test_host_batches_are_pinned_only_for_gpus(monkeypatch):
    x, y = torch.randn(4, 3), torch.randn(4)
    assert pinned(x, [torch.device("cpu")]) is x                       # a CPU pipe copies nothing
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self.clone().add_(1))  # a CPU host cannot pin
    moved = pinned((x, y), ["cpu", "cuda:0"])
    assert torch.equal(moved[0], x + 1) and torch.equal(moved[1], y + 1)


def test_expanded_and_strided_host_batches_are_pinned_as_dense_copies(monkeypatch):
    """torch's pin_memory keeps a tensor's strides, so an expanded batch (stride 0) cannot be written
    into page-locked memory: pinned() pins a dense copy. The real pin needs a GPU (test_cuda.py);
    here a stand-in refuses overlapping memory as it does."""
    def pin(tensor):
        if torch._debug_has_internal_overlap(tensor) == 1:
            raise RuntimeError("more than one element of the written-to tensor refers to a single memory location")
        return tensor.clone()
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    for batch in (torch.randn(4, 3), torch.randn(3)[None].expand(4, 3), torch.randn(3, 4).t()):
        assert torch.equal(pinned((batch,), ["cuda:0"])[0], batch)
    assert pinned(batch, ["cpu"]) is batch


@pytest.mark.parametrize("quick", [True, False])
def test_the_gpu_tables_transformer_cut_for_8_stages_puts_a_block_on_every_stage(quick):
    """Equal block counts on every stage, the embedding with the first and the head with the last (a
    cut by layer counts once left the head alone on the last stage, or beside fewer blocks, whose GPU
    time per task then set the table's ratio)."""
    from lab.runs.experiments import build, choose_balance
    config = gpu_sizing.gpu_start(quick).but(device="cpu", width=16, context=8, batch=32, stages=8, micro_batches=32)
    model, (inputs, _), _ = build(config)
    balance, names = choose_balance(config, model, inputs), [type(layer).__name__ for layer in model]
    stages = [names[sum(balance[:k]):sum(balance[:k + 1])] for k in range(8)]
    assert [stage.count("Block") for stage in stages] == [config.blocks // 8] * 8, stages
    assert stages[0][0] == "Embedding" and stages[-1][-1] == "Head"


def test_balance_by_time_profiles_on_the_stages_device(monkeypatch):
    """balance="time" times the layers where the stages will run them, not on the host's CPU."""
    from lab.config import RunConfig
    from lab.runs import experiments
    seen = []
    monkeypatch.setattr(experiments, "devices_for", lambda config: ["meta"] * config.stages)
    monkeypatch.setattr(experiments, "balance_by_time", lambda k, model, sample: seen.append(sample.device) or [1] * k)
    monkeypatch.setattr(experiments, "layer_times", lambda model, sample: seen.append(sample.device) or [])
    config = RunConfig(model="mlp", blocks=4, width=8, batch=8, stages=2, micro_batches=2, balance="time")
    model, (inputs, _), _ = experiments.build(config)
    experiments.choose_balance(config, model, inputs)
    experiments.layer_costs(config)
    assert seen == [torch.device("meta")] * 2


def test_gpu_over_host_time_per_stage():
    from lab.studies.speedup import stage_ratios
    events = [dict(stage=0, start=0.0, end=0.010, host=0.001), dict(stage=0, start=0.010, end=0.030, host=0.001),
              dict(stage=1, start=0.0, end=0.002, host=0.001), dict(stage=1, start=0.1, end=0.101, host=0.0)]
    assert stage_ratios(events, 2) == pytest.approx([15.0, 1.5])   # host 0 (not recorded): the task's own time


def test_a_launch_bound_gpu_cell_is_not_called_measured():
    from lab.config import RunConfig
    from lab.runs import experiments
    from lab.studies import speedup
    record = experiments.run(RunConfig(model="mlp", blocks=2, width=8, batch=8, stages=1, micro_batches=2),
                             replay="always")
    gpu = dict(record.config, device="cuda")
    bound = [dict(e, host=(e["end"] - e["start"]) / 2) for e in record.solo_events]   # GPU 2x the host
    busy = [dict(e, host=(e["end"] - e["start"]) / 20) for e in record.solo_events]   # GPU 20x the host
    launch_bound = dataclasses.replace(record, config=gpu, solo_events=bound)
    assert speedup.cell_ratio(launch_bound) == pytest.approx(2.0)
    assert speedup.throughput(launch_bound)[1] == "launch-bound"
    assert speedup.throughput(dataclasses.replace(record, config=gpu, solo_events=busy))[1] != "launch-bound"
    cell = speedup.Cell(2, 32, 1.0, 1.0, 1.0, "launch-bound", 0.1, gpu_ratio=2.0)
    assert cell.label.startswith("not measured: launch-bound (GPU busy 2.0x")
    assert speedup.cell_ratio(record) is None                                   # a CPU record has none
    [note] = speedup.launch_bound_notes(launch_bound)   # said wherever the record is shown: the app, the bubble curve
    assert note.startswith("Launch-bound: each task's GPU work took 2.0x the host's time") and "under 3x" in note
    assert speedup.launch_bound_notes(dataclasses.replace(record, config=gpu, solo_events=busy)) == []
    assert speedup.launch_bound_notes(record) == []
    assert speedup.bubble_point(launch_bound)[2] == "launch-bound (GPU 2.0x the host's time per task), replayed"


def test_a_run_on_gpus_times_its_tasks_alone_for_the_ratio(monkeypatch):
    from lab.config import RunConfig
    from lab.runs import experiments
    solo = []
    monkeypatch.setattr(experiments, "solo_run", lambda config, balance: solo.append(config.device) or [])
    monkeypatch.setattr(experiments, "parallel_devices", lambda config: 8)   # K=2 fits: no replay for sharing
    config = RunConfig(model="mlp", blocks=2, width=8, batch=8, stages=2, micro_batches=2)
    experiments.run(config, replay=True)
    assert solo == []                                           # on CPU cores of their own: no serial run
    import lab.config
    monkeypatch.setattr(lab.config, "_cuda_available", lambda: True)
    monkeypatch.setattr(experiments, "devices_for", lambda config: ["cpu"] * config.stages)
    monkeypatch.setattr(experiments.host, "free_gpu_memory", lambda: None)
    experiments.run(config.but(device="cuda"), replay=True)      # stages "on GPUs" (placed on the CPU here)
    assert solo == ["cuda"]


def test_the_gpu_table_says_how_it_was_sized_and_which_cells_are_launch_bound(tmp_path, monkeypatch, capsys):
    """`lab.reproduce speedup --device cuda` as a GPU host prints it, with the GPU faked: the
    sizing in the header, each cell's GPU/host ratio, and no launch-bound cell called measured."""
    from lab import reproduce
    from lab.studies import speedup
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "a faked GPU")
    start = speedup.gpu_start(quick=True)
    sizing = gpu_sizing.Sizing(start, (12.5, 11.0), True, 256, 6.6e9, (30.0, 29.0), ("checked",))
    monkeypatch.setattr(speedup, "gpu_sizing", lambda *args: sizing)
    monkeypatch.setattr(speedup, "measure_table", lambda *args, **kwargs: iter([
        speedup.Cell(1, 1, 10.0, 1.0, 1.0, "measured", 0.0, gpu_ratio=12.5, tflops=(31.5,)),
        speedup.Cell(2, 1, 12.0, 1.2, 1.2, "launch-bound", 0.3, gpu_ratio=2.2)]))
    assert reproduce.main(["speedup", "--device", "cuda", "--quick", "--stages", "1", "2", "--micro-batches", "1",
                           "--out", str(tmp_path)]) == 0
    table = (tmp_path / "speedup.md").read_text()
    assert "sized for the GPU by arithmetic on measured rates: width 1024, context 128" in table
    assert "12.5, 11.0" in table
    assert "| GPU/host time per task | TFLOP/s per stage | how |" in table
    assert "| 31.5 |" in [line for line in table.splitlines() if line.startswith("| 1 |")][0]
    rows = [line for line in table.splitlines() if line.startswith("| 2 |")]
    assert "not measured: launch-bound (GPU busy 2.2x" in rows[0] and "measured (" not in rows[0]


def test_the_gpu_table_runs_a_process_per_gpu_where_there_are_two(monkeypatch):
    from argparse import Namespace

    from lab import reproduce
    for gpus, expected in ((0, "threads"), (1, "threads"), (2, "processes"), (8, "processes")):
        monkeypatch.setattr(torch.cuda, "device_count", lambda gpus=gpus: gpus)
        assert reproduce.speedup_transport(Namespace(device="cuda", transport=None)) == expected
    assert reproduce.speedup_transport(Namespace(device="cuda", transport="threads")) == "threads"
    assert reproduce.speedup_transport(Namespace(device="cpu", transport=None)) == "threads"
    monkeypatch.setattr(reproduce.host, "exclusive_gpus", lambda: True)   # this process measures on them too
    assert reproduce.speedup_transport(Namespace(device="cuda", transport=None)) == "threads"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="--transport processes: the GPUs are in EXCLUSIVE_PROCESS"):
        reproduce.check(reproduce.parser().parse_args(["speedup", "--device", "cuda", "--transport", "processes"]))


def test_a_failed_nccl_receive_is_raised_naming_its_sender():
    """NCCL marks a failed receive completed; its error is read and raised, naming the rank it came
    from, instead of the stage computing on garbage: an activation or gradient, and a call's "end"."""
    class Failed(_NeverCompletes):
        def is_completed(self):
            return True

        def exception(self):
            return RuntimeError("NCCL error: remote process exited")
    transport = ProcessTransport.__new__(ProcessTransport)
    transport.also_abort = []
    transport.ranks, transport.step, transport._failure = Ranks(1, 3), 0, None
    transport.lane, transport.shared = _lane_with_nccl_sends_in_flight(), dist.HashStore()
    transport._arrived = {(0, "grad", 4, 1): ("value", [Failed()], 2)}
    with pytest.raises(StageFailed, match=r"\[rank 2, stage 2\] unreachable.*remote process exited"):
        transport.receive(1, ("grad", 4, 1))
    transport._failure, transport.shared = None, dist.HashStore()
    transport._arrived = {(0, "end", 0, 0): ("their total", [Failed()], 2)}
    with pytest.raises(StageFailed, match=r"\[rank 2, stage 2\] unreachable.*remote process exited"):
        transport.receive_control("end")


def test_a_payload_copied_to_a_gpu_from_the_host_lane_is_handed_over_with_its_event():
    """A GPU stage without NCCL (two ranks on one GPU, the V's second leg) gets its payload over gloo,
    copied to the GPU with a CUDA event to wait on: that event goes to the stage, never polled as works."""
    class Event:   # what to_gpu returns beside the tensors: neither a list nor iterable
        pass
    transport = ProcessTransport.__new__(ProcessTransport)
    transport.also_abort = []
    transport.ranks, transport.step, transport._failure = Ranks(1, 2), 0, None
    transport.lane, transport.shared = _lane_with_nccl_sends_in_flight(), dist.HashStore()
    ready = Event()
    transport._arrived = {(0, "act", 2, 1): ("value", ready, 0)}
    assert transport.receive(1, ("act", 2, 1)) == ("value", ready)


def test_a_gpu_cell_is_launch_bound_under_k_for_threads():
    from lab.config import RunConfig
    from lab.studies import speedup
    assert speedup.gpu_floor(RunConfig(stages=8, transport="threads")) == 8
    assert speedup.gpu_floor(RunConfig(stages=8, transport="processes")) == speedup.GPU_FLOOR
    assert speedup.gpu_floor(RunConfig(stages=2, transport="threads")) == speedup.GPU_FLOOR


def test_the_gpu_pages_expected_figures_follow_from_the_cut_the_tables_make():
    """docs/gpu.md's table: the unit-cost model on the paper's scale, for the GPU table's Transformer
    as its balance cuts it (equal block counts), which is the equal-stage model's."""
    from pathlib import Path

    from lab import theory
    from lab.studies import speedup
    page = (Path(__file__).resolve().parents[3] / "docs" / "gpu.md").read_text()
    for m in (32, 4, 1):
        cut = [theory.on_paper_scale(k, m, shares=speedup.block_shares(speedup.gpu_start().but(stages=k,
                                                                                               micro_batches=m)))
               for k in (2, 4, 8)]
        assert cut == pytest.approx([theory.on_paper_scale(k, m) for k in (2, 4, 8)])
        assert f"| {m} | " + " | ".join(f"{v:.2f}" for v in cut) + " |" in page, cut


def test_a_call_starts_once_its_stages_streams_are_idle_not_the_whole_gpu(monkeypatch):
    """A call's time origin waits for the stages' own streams and the current one, never for the whole
    GPU: an NCCL receive posted for this call (its header came first) is pending on a stream of its
    own, and a device-wide synchronize would wait for it, forever if its sender died."""
    from engine.stages import LocalStages
    synchronized = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def synchronize(self):
            synchronized.append(self.name)

    class Device:  # a StageDevice on cuda:0, as far as LocalStages.start uses one
        is_cuda, device = True, torch.device("cuda", 0)

        def __init__(self, stage):
            self.stream = Stream(f"stage {stage}")

        def settle(self):
            self.stream.synchronize()

        def start(self, t0, origin):
            assert origin is not None

        def on_stream(self):
            return contextlib.nullcontext()

    def device_wide(device=None):
        raise AssertionError("a device-wide synchronize waits for every stream, NCCL's receives included")

    monkeypatch.setattr(torch.cuda, "synchronize", device_wide)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: Stream("current"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: None)
    monkeypatch.setattr(torch.cuda, "Event",
                        lambda enable_timing: type("Event", (), {"record": lambda self, s: None})())
    LocalStages({}, {0: Device(0), 1: Device(1)}, 2).start(call=None)
    assert sorted(synchronized) == ["current", "stage 0", "stage 1"]


def test_the_doctors_sizing_row_judges_the_sizing_not_the_gpus_speed():
    """The doctor's "Table 2 sized for the GPU" row, judged on sizings as a GPU would return them: a
    sizing that met the target, or one that says it could not, passes and says which; a stage without
    its ratio fails."""
    from lab import doctor
    config = gpu_sizing.gpu_start(quick=True).but(width=4096, context=256)
    met = gpu_sizing.Sizing(config, (12.0,) * 8, True, 256, 1e11, (40.0,) * 8, ("checked",))
    assert "width 4096, context 256" in doctor.climbed(met) and "target 10x: met" in doctor.climbed(met)
    missed = dataclasses.replace(met, ratios=(8.0,) * 8, met=False)
    assert "NOT met: the best that fits" in doctor.climbed(missed)
    with pytest.raises(AssertionError, match="no usable stage"):
        doctor.climbed(dataclasses.replace(met, ratios=(1.0,) * 7 + (float("nan"),)))


def test_a_ping_pong_reads_a_reply_once_its_nccl_transfer_is_done():
    """On NCCL edges a message's header arrives before its payload: a ping-pong (pool.ping) that read
    the reply at its header timed the header's trip, not the transfer's."""
    transport = ProcessTransport.__new__(ProcessTransport)
    transport.also_abort = []
    transport.step, transport._check_receiving = 0, lambda: None

    class Transfer:
        polls = 0

        def is_completed(self):
            self.polls += 1
            return self.polls > 3

        def exception(self):
            return None

    transfer = Transfer()
    transport._get = lambda key: ("payload", [transfer], 1)
    assert transport.receive_control("grad", micro=1) == "payload" and transfer.polls == 4


def test_stage_processes_on_exclusive_gpus_are_refused_with_the_reason_and_the_way_out(monkeypatch):
    """EXCLUSIVE_PROCESS GPUs serve one process each: two stage processes on one GPU, or a stage
    process beside its parent's CUDA context, are refused before any process starts, saying why and
    what to do; in the Default mode, or with a GPU each and no context here, they start."""
    from lab.machine import host
    from lab.processes import pool
    assert host.exclusive_gpus(["Default", "Exclusive_Process"]) and not host.exclusive_gpus(["Default"])
    assert not host.exclusive_gpus([])   # no nvidia-smi: a CPU host
    assert host.stage_processes_refused(2, 1, False, exclusive=False) is None
    assert host.stage_processes_refused(2, 2, False, exclusive=True) is None
    assert "2 stage processes on 1 GPU(s) would share one" in host.stage_processes_refused(2, 1, False, True)
    said = host.stage_processes_refused(2, 2, True, True)
    assert "this process's own CUDA context" in said and "threads" in said and "nvidia-smi -c DEFAULT" in said
    monkeypatch.setattr(host, "exclusive_gpus", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    with pytest.raises(ValueError, match=r"ProcessPool\(2, device='cuda'\): the GPUs are in EXCLUSIVE_PROCESS"):
        pool.ProcessPool(2, device="cuda")


def test_a_sizing_is_found_once_per_doctor_run_and_read_by_the_next_process(tmp_path, monkeypatch):
    """The doctor's sizing row sizes the GPU table's model; reproduce --quick, a process after it in
    the same doctor run, reads that sizing from the file SIZING_FILE names instead of spending the
    report's minutes sizing again. Another start, other GPUs or no file: sized anew."""
    from lab import doctor
    start = gpu_sizing.gpu_start(quick=True, transport="processes")
    found = gpu_sizing.Sizing(start.but(width=2048, context=256), (11.5,) * 8, True, 256, 2.6e10, (33.0,) * 8,
                              ("width 2048, context 256, batch 32, 16 blocks: predicted 12.0x, measured 11.5x",))
    sized = []

    def size():
        sized.append(1)
        return found
    monkeypatch.setattr(gpu_sizing.host, "gpus", lambda: ["NVIDIA H200"])
    assert gpu_sizing.kept_sizing(start, True, size) is found and sized == [1]   # no file named: sized
    with doctor.sizing_kept():
        assert gpu_sizing.kept_sizing(start, True, size) == found and sized == [1, 1]   # the row
        assert gpu_sizing.kept_sizing(start, True, size) == found and sized == [1, 1]   # the next process
        assert gpu_sizing.kept_sizing(start.but(seed=1), True, size) == found and sized == [1, 1, 1]
        monkeypatch.setattr(gpu_sizing.host, "gpus", lambda: ["NVIDIA H100"])
        gpu_sizing.kept_sizing(start, True, size)
        assert sized == [1, 1, 1, 1], "other GPUs: sized anew"
    assert gpu_sizing.SIZING_FILE not in os.environ, "the file is the doctor run's only"


def test_host_tensors_of_a_gpu_stages_value_go_to_its_gpu_before_nccl(monkeypatch):
    """NCCL moves GPU memory only: a host tensor inside a GPU stage's tuple (a mask, a count) is
    copied to the stage's GPU before its send; CUDA tensors and None pass as they are."""
    from engine.distributed.gloo_lane import _on_gpu
    moved = []
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: t.dtype == torch.float64))   # stands for "on a GPU"
    monkeypatch.setattr(torch.Tensor, "to", lambda t, device: moved.append(device) or t.double())
    on_gpu, on_host = torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.bool)
    sent = _on_gpu((on_gpu, on_host, None), torch.device("cuda", 1))
    assert sent[0] is on_gpu and sent[1].dtype == torch.float64 and sent[2] is None
    assert moved == [torch.device("cuda", 1)]
    assert _on_gpu(on_gpu, torch.device("cuda", 1)) is on_gpu


def test_a_rank_checks_only_its_own_entry_of_a_device_list(monkeypatch):
    """torchrun with CUDA_VISIBLE_DEVICES set per rank: each rank sees one GPU, cuda:0. A device list
    such as ["cpu", "cuda:0"] or ["cuda:0", "cuda:0"] is checked for this rank's entry only, so
    another rank's entry naming a GPU this rank cannot see does not refuse the pipe."""
    from engine.distributed import runner
    checked, current = [], []
    monkeypatch.setattr(runner, "check_group", lambda group, stages: Ranks(1, 2))
    monkeypatch.setattr(runner, "check_device", lambda device, index: checked.append((device, index)) or
                        torch.device(device))
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    assert runner.rank_and_device(None, 2, ["cuda:1", "cpu"], None) == (1, torch.device("cpu"))
    assert checked == [("cpu", 1)] and current == []
    with pytest.raises(ValueError, match="1 entries but there are 2 stages"):
        runner.rank_and_device(None, 2, ["cpu"], None)


def test_a_cell_holds_one_model_at_a_time(monkeypatch):
    """A GPU table's model is sized so that one fits: the serial run behind a cell's replay builds
    its own model only once the measured one, its gradients and its pipe are gone."""
    import gc
    import weakref

    from lab.config import RunConfig
    from lab.runs import experiments
    built, alive = [], []
    build, solo_run = experiments.build, experiments.solo_run

    def tracked(config):
        made = build(config)
        built.append(weakref.ref(made[0]))
        return made

    def counted(config, balance):
        gc.collect()
        alive.append(sum(ref() is not None for ref in built))
        return solo_run(config, balance)
    monkeypatch.setattr(experiments, "build", tracked)
    monkeypatch.setattr(experiments, "solo_run", counted)
    experiments.run(RunConfig(model="mlp", blocks=2, width=16, batch=8, stages=2, micro_batches=2), replay="always")
    assert alive == [0]


def test_nccl_groups_are_aborted_all_at_once_and_a_blocked_abort_holds_no_one():
    """Each group is aborted from a thread of its own, all started together: one NCCL abort may wait
    for the GPU, where another communicator's kernel still waits for a peer (pytorch#119797), and
    torch waits for an abort up to the group's timeout (a year here). The caller returns within the
    bound whatever an abort does."""
    release, aborted = threading.Event(), []

    class Group:
        def __init__(self, name, blocks=False):
            self.name, self.blocks = name, blocks

        def abort(self):
            if self.blocks:
                release.wait(30)   # a communicator whose abort waits for the GPU
            aborted.append(self.name)
    start = time.monotonic()
    gloo_lane.abort_groups([Group("act edge", blocks=True), Group("grad edge"), Group("data parallel")], seconds=0.3)
    assert time.monotonic() - start < 3
    assert sorted(aborted) == ["data parallel", "grad edge"]   # not held behind the blocked one
    release.set()


class _Stream(str):
    """A fake CUDA stream, named by its device."""

    def wait_event(self, event):
        pass


def _record_cuda_contexts(monkeypatch) -> list:
    """Fake CUDA streams and record the device and stream contexts entered, in order."""
    entered = []

    def recording(kind):
        return lambda what: entered.append((kind, what)) or contextlib.nullcontext()
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: _Stream(f"stream on {device}"))
    monkeypatch.setattr(torch.cuda, "device", recording("device"))
    monkeypatch.setattr(torch.cuda, "stream", recording("stream"))
    return entered


def test_a_stage_stream_is_entered_with_its_gpu_current(monkeypatch):
    """Leaving a stream context restores the stream of the thread's current device: from a thread
    still on cuda:0 (every new thread is), that opens a context on cuda:0 in a rank whose GPU is
    another (and fails in EXCLUSIVE_PROCESS mode). So a stage's GPU is made current first."""
    from engine.device import StageDevice
    entered = _record_cuda_contexts(monkeypatch)
    with StageDevice(torch.device("cuda", 1), 1).on_stream():
        pass
    assert entered == [("device", torch.device("cuda", 1)), ("stream", "stream on cuda:1")]


def test_an_nccl_payload_is_received_in_its_turn_as_soon_as_its_header_lands(monkeypatch):
    """The listener posts a message's NCCL receives when its gloo header lands and its turn has come
    (turns.py), not when the stage next reads: the sender's NCCL send is matched at once. The stage
    then gets those receives; a receive whose turn has not come waits for the transfers before it."""
    from types import SimpleNamespace

    from engine.distributed import wire
    from engine.distributed.turns import Transfer, Turns
    posted = []

    class Edge(_NcclGroup):
        def recv(self, tensors, peer, tag):
            posted.append((tensors[0].numel(), peer))  # bytes
            return _NeverCompletes()

        send = recv
    entered = _record_cuda_contexts(monkeypatch)
    monkeypatch.setattr(torch.cuda, "Event", lambda: SimpleNamespace(record=lambda stream: None))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"stage stream on {device}")
    empty = wire.empty_tensors   # the tensors on the host: this one has no GPU
    monkeypatch.setattr(wire, "empty_tensors", lambda header, home: empty(header, torch.device("cpu")))
    monkeypatch.setattr(gloo_lane, "_on_gpu", lambda value, device: value)  # stands for tensors on a GPU
    lane = GlooLane.__new__(GlooLane)
    lane.rank, lane.device, lane._streams, lane.turns = 1, torch.device("cuda", 1), {}, Turns(1)
    lane.tensor_groups, lane._events, lane._in_flight = {0: (Edge(), 0)}, queue.SimpleQueue(), collections.deque()
    lane.wire = SimpleNamespace(send=lambda tensors, peer, tag: _NeverCompletes())
    lane.turns.expect(3, [Transfer(("grad", 4, 0), 1, 0), Transfer(("act", 5, 1), 0, 1)])
    frame, _ = wire.encode(3, "act", 5, 1, wire.NO_DECISION, torch.ones(4, 6), inline=False)
    reposted = []
    link = SimpleNamespace(peer=0, views=[frame.numpy()], repost=reposted.append,
                           landed=collections.deque([[0, False]]), lock=threading.Lock())  # landed, its turn to come
    lane.turns.offer(3, ("act", 5, 1), "receive", lambda: lane._in_turn(link, link.landed[0]))  # as the listener does
    assert posted == [] and lane._events.empty(), "its turn comes after stage 1's send of B4's gradient"
    lane.post(0, 3, "grad", 4, 0, wire.NO_DECISION, torch.ones(3))
    assert posted == [(3 * 4, 0), (4 * 6 * 4, 0)], "the send, then the receive, on the neighbour's group"
    # entered with its GPU current: a listener thread starts on cuda:0, where leaving the stream would open a context
    assert entered[-2:] == [("device", torch.device("cuda", 1)), ("stream", "stream on cuda:1")]
    [arrival] = lane.receive(0.1)
    assert len(posted) == 2 and reposted == [0], "the stage reads them; nothing posted twice"
    assert arrival.header.micro == 5 and arrival.tensors[0].shape == (4, 6) and len(arrival.ready) == 1
    inline, _ = wire.encode(3, "act", 6, 1, wire.NO_DECISION, torch.ones(2))
    assert lane._receive_payload(SimpleNamespace(peer=0, views=[inline.numpy()]), 0) is None  # in its frame
    assert lane._receive_payload(SimpleNamespace(peer=2, views=[frame.numpy()]), 0) is None   # no group with 2


@pytest.mark.parametrize("dtype", [torch.int16, torch.complex64, torch.bool, torch.bfloat16])
def test_an_nccl_edge_carries_any_dtype_as_bytes(monkeypatch, dtype):
    """NCCL has no int16, complex or bool type: an edge sends and receives a tensor's bytes, and the
    receiver's tensor of the announced dtype holds the sender's values."""
    from types import SimpleNamespace

    from engine.distributed import wire
    wires = []

    class Edge(_NcclGroup):
        def send(self, tensors, peer, tag):
            wires.append(tensors[0].clone())
            return _NeverCompletes()

        def recv(self, tensors, peer, tag):
            assert tensors[0].dtype == torch.uint8
            tensors[0].copy_(wires.pop())
            return _NeverCompletes()
    from engine.distributed.turns import Turns
    _record_cuda_contexts(monkeypatch)
    monkeypatch.setattr(torch.cuda, "Event", lambda: SimpleNamespace(record=lambda stream: None))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: "the stage's stream")
    monkeypatch.setattr(gloo_lane, "_on_gpu", lambda value, device: value)  # stands for tensors on a GPU
    edge, frames = Edge(), []
    sender = _lane_with_nccl_sends_in_flight()
    sender.device, sender.tensor_groups, sender._in_flight = torch.device("cpu"), {1: (edge, 1)}, collections.deque()
    sender._streams, sender.turns = {}, Turns(0)
    sender.turns.expect(3, None)
    sender.wire = SimpleNamespace(send=lambda tensors, peer, tag: frames.append(tensors[0]) or _NeverCompletes())
    sent = (torch.arange(-3, 3).reshape(2, 3) * 7).to(dtype)
    sender.post(1, 3, "act", 5, 1, wire.NO_DECISION, sent)
    assert [t.dtype for t in wires] == [torch.uint8]
    receiver = GlooLane.__new__(GlooLane)
    receiver.rank, receiver.device, receiver._streams = 1, torch.device("cpu"), {}
    receiver.tensor_groups = {0: (edge, 0)}
    [received], _ = receiver._receive_payload(SimpleNamespace(peer=0, views=[frames[0].numpy()]), 0)
    assert received.dtype == dtype and torch.equal(received, sent)


@pytest.mark.parametrize("on_gpu", [False, True])
def test_a_calls_events_are_read_at_once_on_a_gpu_and_when_asked_for_on_a_cpu(on_gpu):
    """engine.runner.events_of: on a GPU the events are read at the call's end (their times are measured
    against that call's origin) and the callback hears of each then, in start order; on a CPU nothing is
    made until the trace asks, and then once."""
    from engine.runner import events_of
    from engine.schedule import Task
    from engine.trace import Event
    made, heard = [], []

    class Chunk:
        def event(self, task, start, end, timed=False):
            made.append(task)
            return Event(0, task.micro, task.op, start, end, "cuda:0" if on_gpu else "cpu")

    local = type("Local", (), {"chunks": {0: Chunk()}, "devices": {0: type("Device", (), {"is_cuda": on_gpu})()}})()
    marks = [(Task("B", 0, 0), 2.0, 3.0), (Task("F", 0, 0), 0.0, 1.0)]
    events = events_of(local, marks, heard.append)
    assert len(made) == (2 if on_gpu else 0)
    assert heard == (events() if on_gpu else [])
    assert [f"{e.op}{e.micro}" for e in events()] == ["F0", "B0"] and events() is events()
    assert len(made) == 2


def test_the_gate_outlasts_the_hosts_issuing_and_counts_the_tasks_it_did_not():
    from engine.device import Gate
    spins, rates = [], []
    gate = Gate(spins.append, lambda: rates.append(1) or 1e9)   # a GPU counting 1e9 cycles a second
    gate.hold()
    gate.opened(before_issued=False, host_seconds=1e-4)          # issued within the 0.2 ms floor
    gate.hold()
    gate.opened(before_issued=True, host_seconds=1.5e-3)         # a slow task: its spin ended first
    gate.hold()
    gate.opened(before_issued=False, host_seconds=1e-3)
    gate.hold()
    assert spins == [200_000, 200_000, 400_000, 2_000_000]       # a miss doubles the spin; a held task's
    assert rates == [1] and gate.missed == 1                     # host time, twice; the rate asked once
    gate.opened(before_issued=False, host_seconds=10.0)
    assert gate.seconds == 0.1                                   # never a spin of seconds


def test_a_gated_serial_run_holds_each_task_behind_the_gate_and_other_runs_never(monkeypatch):
    from engine import GPipe
    from engine.device import StageDevice
    calls = []
    monkeypatch.setattr(StageDevice, "hold", lambda self: calls.append("hold"))
    monkeypatch.setattr(StageDevice, "settle", lambda self, start=None, end=None: calls.append(
        "settled" if start is None else ("task", end >= start)))
    torch.manual_seed(0)
    pipe = GPipe(torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)]), 2, chunks=2)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    pipe.step(x, y, torch.nn.functional.mse_loss, serial="gated")
    tasks = [c for c in calls if c != "settled"]
    assert tasks == ["hold", ("task", True)] * len(pipe.trace.events)   # a hold before each, its marks after
    for serial in (True, False):
        calls.clear()
        pipe.step(x, y, torch.nn.functional.mse_loss, serial=serial)
        assert calls and all(c == "settled" for c in calls)
    with pytest.raises(ValueError, match="serial='gate': expected False, True or 'gated'"):
        pipe.step(x, y, torch.nn.functional.mse_loss, serial="gate")


def test_the_gated_ratio_reads_below_one_where_the_host_sets_the_pace():
    from lab.studies.speedup import stage_ratios
    events = [dict(stage=0, start=0.0, end=0.0002, host=0.0015), dict(stage=0, start=0.01, end=0.0103, host=0.0015)]
    assert stage_ratios(events, 1) == pytest.approx([0.5 / 3])   # the GPU's 0.5 ms of work took the host 3 ms to issue
