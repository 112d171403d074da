"""Every wait of stage processes has a bound, and what ends it says what waited: checked with fakes of
works, groups and peers (tests/engine/distributed/test_processes.py runs them under torchrun)."""
import collections
import contextlib
import queue
import re
import threading
import time

import pytest
import torch
import torch.distributed as dist

from engine.distributed import gloo_lane, wire, works
from engine.distributed.gloo_lane import GlooLane
from engine.distributed.transport import ProcessTransport, Ranks
from engine.distributed.wire import Lost
from engine.transport import StageFailed


class NeverCompletes:
    """A transfer whose other side never comes."""

    def is_completed(self):
        return False

    def exception(self):
        return None


class FakeLane:
    error = None
    abandoned = 0

    def abandon(self, also):
        self.abandoned += 1

    @staticmethod
    def held(step):
        return {}


def transport(rank: int, size: int, store, step: int = 4) -> ProcessTransport:
    """A ProcessTransport of rank `rank` in a call `step`, over `store`, with no lane or group behind it."""
    made = ProcessTransport.__new__(ProcessTransport)
    made.ranks, made.step, made.placement, made.also_abort = Ranks(rank, size), step, tuple(range(size)), []
    made.shared, made.store, made.lane, made._failure = store, dist.PrefixStore("0-1-2/", store), FakeLane(), None
    made._traffic = collections.Counter()
    return made


@pytest.fixture
def quick_bounds(monkeypatch):  # a payload or a send: 0.3 s waiting for the peer's progress, 0.2 s to move
    monkeypatch.setenv("GPIPE_WAIT_SECONDS", "0.3")
    monkeypatch.setenv("GPIPE_TRANSFER_SECONDS", "0.2")
    monkeypatch.setattr("engine.distributed.transport.STUCK_SECONDS", 0.1)


def test_a_payload_that_never_lands_fails_the_call_at_its_bound_saying_who_waits_for_what(quick_bounds):
    store = dist.HashStore()
    waiting = transport(1, 3, store)
    transport(2, 3, store)._stuck((4, "act", 1, 2), None)  # stage 2 posts that it waits for F1's header
    value = torch.zeros(256)                                # 1 KiB
    start = time.monotonic()
    with pytest.raises(StageFailed) as raised:
        waiting._landed([NeverCompletes()], 0, (4, "act", 1, 1), value)
    assert 0.5 <= time.monotonic() - start < 3
    note = str(raised.value)
    assert re.fullmatch(r"stalled: stage 1 waited 0\.\d s for the payload of F1 from stage 0 \(1024 bytes on "
                        r"the edge \('act', 0, 1\), bound 0\.5 s\); the others wait: stage 2 waits for F1 from "
                        r"stage 1", note)
    assert store.get("failed/4").decode() == note, "every rank reads the same note"
    assert waiting.lane.abandoned == 1, "the lane gave up its transfers (aborts NCCL's groups)"
    with pytest.raises(StageFailed, match="^stalled"):
        waiting.check()                                     # later waits of the call raise it too


def test_a_wait_for_a_payload_in_flight_is_posted_but_never_taken_for_a_deadlock():
    """Every rank waiting with every message read is a deadlock only while none waits for a payload
    NCCL is still moving (it may land: only its transfer bound ends that wait)."""
    def everyone_waits(pending: bool) -> bool:
        store = dist.HashStore()
        first, second = transport(0, 2, store), transport(1, 2, store)
        first._traffic.update({(4, "sent", 1): 1})
        second._traffic.update({(4, "received", 0): 1})
        first._stuck((4, "grad", 0, 0), None)
        second._stuck((4, "act", 1, 1), None, pending=0 if pending else None)
        return store.check(["failed/4"])
    assert everyone_waits(pending=False)
    assert not everyone_waits(pending=True)


def lane_sending(works_in_flight: list) -> GlooLane:
    """A GlooLane's sender side with `works_in_flight` as one NCCL send to stage 1."""
    lane = GlooLane.__new__(GlooLane)
    lane.rank, lane.tensor_groups = 0, {}
    lane._reap, lane._wakes, lane._closed, lane._abandoned, lane.error = threading.Condition(), 0, False, False, None
    lane._events = queue.SimpleQueue()
    lane._in_flight = collections.deque([([], works_in_flight, [torch.empty(64, dtype=torch.uint8)], 1)])
    return lane


def test_an_nccl_send_that_never_completes_is_reported_stalled_to_the_stage(quick_bounds):
    lane = lane_sending([NeverCompletes()])
    threading.Thread(target=lane._complete_sends, daemon=True).start()
    lane._wake_sender()
    with pytest.raises(Lost) as lost:
        for _ in range(60):
            lane.receive(0.05)
    assert lost.value.peer == 1 and isinstance(lost.value.error, works.Stalled)
    waiting = transport(0, 2, dist.HashStore())
    said = waiting._lost(lost.value.peer, lost.value.error)
    assert str(said) == "stalled: stage 0 waited 0.5 s for an NCCL send to stage 1 to complete, its bound", \
        "the bound, as the sender thread said it"


def test_a_set_up_that_blocks_is_given_up_at_its_bound():
    blocked = threading.Event()
    start = time.monotonic()
    with pytest.raises(StageFailed, match=r"^rank 3: making it did not finish within 0.3 s; has a rank died or "):
        works.finished_within(0.3, "rank 3: making it", blocked.wait)
    assert time.monotonic() - start < 2
    blocked.set()
    assert works.finished_within(1, "adding", lambda: 1 + 1) == 2
    with pytest.raises(KeyError, match="its own error"):
        works.finished_within(1, "failing", lambda: {}["its own error"])

    def told():
        raise StageFailed("rank 0 failed first")
    with pytest.raises(StageFailed, match="rank 0 failed first"):
        works.finished_within(5, "waiting", threading.Event().wait, told)


def test_store_keys_not_written_in_time_are_named():
    store = dist.HashStore()
    store.set("rank/0", "here")
    with pytest.raises(StageFailed, match=r"^the meeting: \['rank/1'\] not in the Store within 0.2 s"):
        works.keys_within(store, ["rank/0", "rank/1"], 0.2, "the meeting")
    store.set("rank/1", "here")
    works.keys_within(store, ["rank/0", "rank/1"], 0.2, "the meeting")


@pytest.mark.parametrize("asked", ["0", "-3", "soon"])
def test_a_bound_from_the_environment_is_a_positive_number(monkeypatch, asked):
    monkeypatch.setenv("GPIPE_SETUP_SECONDS", asked)
    with pytest.raises(ValueError, match=f"GPIPE_SETUP_SECONDS='{asked}': expected a number of seconds above 0"):
        works.setup_bound()


def test_the_bound_of_a_transfer_grows_with_its_bytes_over_the_slowest_link(monkeypatch):
    monkeypatch.delenv("GPIPE_TRANSFER_SECONDS", raising=False)
    assert works.transfer_bound(0) == works.TRANSFER_FLOOR
    assert works.transfer_bound(10 ** 9) == works.TRANSFER_FLOOR + 10 ** 9 / works.SLOWEST_LINK


class BlockingEdge:
    """An NCCL edge whose first use blocks, as making its communicator does while a peer is missing."""

    aborted = False

    def __init__(self, gate: threading.Event):
        self.gate = gate

    def send(self, tensors, peer, tag):
        self.gate.wait()
        return NeverCompletes()

    recv = send

    def abort(self):
        self.aborted = True


def test_making_an_nccl_communicator_that_blocks_ends_connect_at_its_bound(monkeypatch):
    """connect() posts its probes on a thread it can give up on, consulting only `lost` (no Store)
    meanwhile: the first use of a group blocks while it makes the communicator."""
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch, "zeros", lambda *shape, device=None: torch.empty(0))
    monkeypatch.setattr(gloo_lane, "abort_groups", lambda groups: [group.abort() for group in groups])
    gate, consulted = threading.Event(), []
    edges = {1: (BlockingEdge(gate), 1)}

    def store_check():
        raise AssertionError("the Store was read while a set-up thread may hold its connection")
    start = time.monotonic()
    with pytest.raises(StageFailed, match=r"making the NCCL communicators with stages \[1\] did not finish within "
                                          r"0.3 s"):
        gloo_lane.connect(edges, 0, torch.device("cuda", 0), store_check, lambda: consulted.append(1), within=0.3)
    gate.set()
    assert time.monotonic() - start < 2 and consulted
    assert all(group.aborted for group, _ in edges.values())


class SilentLane(FakeLane):
    """A lane on which nothing ever arrives."""

    def receive(self, timeout):
        time.sleep(timeout)
        return []


def test_a_message_no_rank_sends_fails_the_call_at_the_wait_bound(monkeypatch):
    monkeypatch.setenv("GPIPE_WAIT_SECONDS", "0.5")
    monkeypatch.setattr("engine.distributed.transport.STUCK_SECONDS", 0.1)
    waiting = transport(0, 2, dist.HashStore())
    waiting.lane, waiting._arrived = SilentLane(), {}
    with pytest.raises(StageFailed, match=r"^stalled: stage 0 waited 0\.\d s for B2 from stage 1 \(bound 0\.5 s, "
                                          r"GPIPE_WAIT_SECONDS\); the others wait: nothing posted$"):
        waiting._get((4, "grad", 2, 0))


def test_an_all_reduce_with_replicas_that_never_completes_is_stalled_at_its_bound(quick_bounds):
    from engine.distributed import replicas
    with pytest.raises(works.Stalled, match=r"^waited 0\.5 s for the all-reduce of 4096 bytes with the other replicas"):
        replicas.wait([NeverCompletes()], lambda: None, 4096)


def test_a_neighbour_that_never_reads_its_full_fifo_is_stalled_at_the_bound(quick_bounds):
    from engine.distributed import shm_lane
    store, prefix = dist.HashStore(), f"{shm_lane.SHM}/gpipe-test-{time.monotonic_ns()}-"
    lanes = {}
    makers = [threading.Thread(target=lambda r=r: lanes.__setitem__(r, shm_lane.ShmLane(r, [1 - r], store, prefix,
                                                                                         lambda: None)))
              for r in (0, 1)]
    for maker in makers:
        maker.start()
    for maker in makers:
        maker.join(10)
    try:
        with pytest.raises(Lost) as lost:
            for micro in range(10 ** 5):  # header-only messages, never read, until the FIFO is full
                lanes[0].post(1, 0, "call", micro, 0, wire.NO_DECISION, None)
        assert lost.value.peer == 1 and isinstance(lost.value.error, works.Stalled)
        assert re.match(r"waited 0\.\d s for stage 1 to read its full FIFO, its bound", str(lost.value.error))
    finally:
        for lane in lanes.values():
            lane.close(0)
