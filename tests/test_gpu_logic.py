"""The GPU and NCCL paths' decisions, checked on a CPU host with fakes (tests/test_cuda.py runs
the real thing where there is a GPU)."""
import collections
import queue
import threading
import time

import pytest
import torch
import torch.distributed as dist

from engine.device import StageDevice, pinned
from engine.distributed.gloo_lane import GlooLane
from engine.distributed.transport import ProcessTransport, Ranks, nccl_in, use_nccl
from engine.distributed.works import until_completed
from engine.transport import StageFailed


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
    two_gpus = [("host-a", "GPU-1"), ("host-a", "GPU-2")]
    assert use_nccl(["cuda", "cuda"], [True, True], two_gpus)
    assert not use_nccl(["cuda", "cpu"], [True, True], [("host-a", "GPU-1"), ("host-a", "")])
    assert not use_nccl(["cuda", "cuda"], [True, False], two_gpus)            # one group without NCCL
    # two ranks of one machine on one GPU: NCCL would refuse them, the host path works
    assert not use_nccl(["cuda", "cuda"], [True, True], [("host-a", "GPU-1"), ("host-a", "GPU-1")])
    # the same identity on two machines is two GPUs
    assert use_nccl(["cuda", "cuda"], [True, True], [("host-a", "GPU-1"), ("host-b", "GPU-1")])


class _NeverCompletes:
    """An NCCL send or receive whose peer never posts the other side."""

    def is_completed(self):
        return False

    def wait(self):
        raise AssertionError("waited on a transfer that never completes")


class _NcclGroup:
    aborted = False

    def abort(self):
        self.aborted = True


def _lane_with_nccl_sends_in_flight():
    """A GlooLane's NCCL state as after posting a send that its failed neighbour will never match."""
    lane = GlooLane.__new__(GlooLane)
    lane.rank, lane.tensor_groups = 0, {("act", 0, 1): (_NcclGroup(), 1)}
    lane._reap, lane._wakes, lane._closed, lane._abandoned, lane.error = threading.Condition(), 0, False, False, None
    lane._events = queue.SimpleQueue()
    lane._in_flight = collections.deque([([], [_NeverCompletes()], None, 1)])
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


def test_a_lost_neighbour_ends_the_wait_for_an_nccl_receive():
    transport = ProcessTransport.__new__(ProcessTransport)
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_host_batches_are_pinned_on_a_gpu_host():
    assert pinned(torch.randn(4, 3), ["cuda"]).is_pinned()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_a_copy_into_a_gpu_waits_for_nothing_else_queued_there():
    """A stage's activation reaches the next GPU while that GPU's default stream is still busy (it
    used to wait for it, and so for every earlier copy into that GPU)."""
    sender = StageDevice(torch.device("cuda", 0), 1)
    sender.start(time.perf_counter(), None)
    with torch.cuda.device(1):
        torch.cuda._sleep(int(3e9))                # seconds of work on cuda:1's default stream
    with sender.enter():
        value = torch.arange(4.0, device="cuda:0")
        moved, ready = sender.send(value, torch.device("cuda", 1))
    start = time.perf_counter()
    ready.synchronize()
    assert time.perf_counter() - start < 0.5 and moved.device == torch.device("cuda", 1)
    torch.cuda.synchronize(1)
    assert torch.equal(moved.cpu(), torch.arange(4.0))


def test_balance_by_time_profiles_on_the_stages_device(monkeypatch):
    """balance="time" times the layers where the stages will run them, not on the host's CPU."""
    from lab import experiments
    from lab.config import RunConfig
    seen = []
    monkeypatch.setattr(experiments, "devices_for", lambda config: ["meta"] * config.stages)
    monkeypatch.setattr(experiments, "balance_by_time", lambda k, model, sample: seen.append(sample.device) or [1] * k)
    monkeypatch.setattr(experiments, "layer_times", lambda model, sample: seen.append(sample.device) or [])
    config = RunConfig(model="mlp", blocks=4, width=8, batch=8, stages=2, micro_batches=2, balance="time")
    model, (inputs, _), _ = experiments.build(config)
    experiments.choose_balance(config, model, inputs)
    experiments.layer_costs(config)
    assert seen == [torch.device("meta")] * 2
