"""What stage processes read from each other: typed tables and headers that refuse anything else,
and a shared-memory lane that names the failure behind a message it cannot read, never a path."""
import os
import pickle
import queue
import threading
import uuid

import numpy as np
import pytest
import torch
import torch.distributed as dist

from engine.distributed import shm_lane, wire
from engine.distributed.runner import END, LOSS_DTYPES, PIECE, decode_end, decode_pieces, encode_end, encode_pieces
from engine.trace import Event
from engine.transport import StageFailed

PIECE_ROWS = (0.25, [(1, 0, "F", 0.0, 0.5, "cpu", 0, 0.5), (1, 0, "B", 0.75, 1.5, "cpu", 0, 0.25)],
              [(1, 0, "send", "grad", 0, 4096, 1.5, 1.5)], (1, "cpu", 100, 100, 2000, None), [(1, 1.5, 1.75, 400)])


UNPICKLED = []


def unpickled() -> None:
    UNPICKLED.append("this ran")


class Unpickled:
    """Unpickling this calls `unpickled`."""

    def __reduce__(self):
        return unpickled, ()


def test_trace_pieces_travel_as_typed_tables_and_come_back_equal():
    assert PIECE[1] == "iisffsif" and len(PIECE[1]) == len(Event.__dataclass_fields__)
    data = encode_pieces([PIECE_ROWS, PIECE_ROWS])
    assert decode_pieces(data, 2) == [PIECE_ROWS, PIECE_ROWS]
    with pytest.raises(ValueError, match="at most 255 bytes"):
        wire.pack_table("s", [("x" * 256,)])


@pytest.mark.parametrize("data", [b"", b"\x07" * 40, pickle.dumps([Unpickled()]), pickle.dumps(PIECE_ROWS),
                                  encode_pieces([PIECE_ROWS])[:-3], encode_pieces([PIECE_ROWS]) + b"\x00"])
def test_anything_but_the_tables_is_malformed_and_nothing_is_unpickled(data):
    with pytest.raises(wire.Malformed):
        decode_pieces(data, 1)
    assert UNPICKLED == []


@pytest.mark.parametrize("loss", [None, torch.tensor(0.1), torch.tensor(0.1, dtype=torch.float64),
                                  torch.tensor(0.1, dtype=torch.bfloat16), torch.tensor(6e4, dtype=torch.float16)])
def test_an_end_says_the_loss_exactly_in_its_dtype_and_the_batch_size(loss):
    data = encode_end(loss, 24) + b"pieces"
    got, size, offset = decode_end(data)
    assert size == 24 and data[offset:] == b"pieces"
    assert got is None if loss is None else (got.dtype == loss.dtype and got.shape == () and torch.equal(got, loss))


def test_an_end_refuses_a_loss_it_cannot_pass_on_exactly():
    with pytest.raises(TypeError, match="the loss is a torch.int64 tensor"):
        encode_end(torch.tensor(3), 24)


@pytest.mark.parametrize("data", [b"\x07" * 40, pickle.dumps([Unpickled()]), encode_end(torch.tensor(1.0), 2)[:-1],
                                  END.pack(1, 0.5, len(LOSS_DTYPES), 2), END.pack(1, 0.5, -1, 2),
                                  END.pack(1, 0.5, 0, -2), END.pack(2, 0.5, 0, 2)])
def test_an_end_that_says_anything_else_is_malformed(data):
    with pytest.raises(wire.Malformed):
        decode_end(data)
    assert UNPICKLED == []


def test_a_header_that_encode_did_not_write_is_malformed():
    frame, _ = wire.encode(3, "end", 0, 0, wire.NO_DECISION, (torch.zeros(()), torch.tensor([24])))
    view = frame.numpy()
    assert wire.decode_header(view).kind == "end"
    for word, value in ((0, 10_000), (0, 2), (2, 99), (2, -1), (7, 5), (11, 99)):  # length, kind, form, dtype
        bad = view.copy()
        bad[8 * word:8 * word + 8] = np.array([value], dtype=np.int64).view(np.uint8)
        with pytest.raises(wire.Malformed):
            wire.decode_header(bad)
    with pytest.raises(wire.Malformed, match="payload"):
        wire.tensors_in(view[:40], 32, wire.decode_header(view))


@pytest.fixture
def two_lanes():
    """Ranks 1 and 2 of a pipe as two shared-memory lanes of this process; rank 1's `on_stall`
    raises what `reported` holds (a failure another rank told the store)."""
    store, prefix = dist.HashStore(), f"{shm_lane.SHM}/gpipe-test-{uuid.uuid4().hex[:8]}-"
    reported = []

    def on_stall():
        if reported:
            raise StageFailed(reported[0])
    lanes = {}
    makers = [threading.Thread(target=lambda r=r: lanes.__setitem__(r, shm_lane.ShmLane(r, [3 - r], store, prefix,
                                                                                         on_stall)))
              for r in (1, 2)]
    for maker in makers:
        maker.start()
    for maker in makers:
        maker.join(10)
    yield lanes[1], lanes[2], reported, prefix
    for lane in lanes.values():
        lane.close(0)


def receive_all(lane):
    arrivals = []
    for _ in range(20):
        arrivals += lane.receive(0.05)
        if arrivals:
            return arrivals
    return arrivals


def test_a_segment_removed_by_a_failures_clean_up_reports_that_failure(two_lanes):
    receiver, sender, reported, prefix = two_lanes
    sender.post(1, 0, "end", 0, 0, wire.NO_DECISION, (torch.zeros(()), torch.tensor([24])))
    os.unlink(f"{prefix}2to1-end-0")  # as rank 0's clean-up does while rank 1 has not read yet
    reported.append("KeyError: [rank 0, stage 0, micro-batch 3, backward (B3)] boom in backward")
    with pytest.raises(StageFailed, match=r"^KeyError: \[rank 0, stage 0, micro-batch 3, backward \(B3\)\]"):
        receive_all(receiver)


def test_a_segment_gone_without_a_failure_is_a_malformed_message_named_by_its_sender(two_lanes):
    receiver, sender, _, prefix = two_lanes
    sender.post(1, 0, "end", 0, 0, wire.NO_DECISION, (torch.zeros(()), torch.tensor([24])))
    os.unlink(f"{prefix}2to1-end-0")
    with pytest.raises(wire.Malformed, match="from rank 2 through shared memory cannot be read") as raised:
        receive_all(receiver)
    assert "/dev/shm" not in str(raised.value)
    sender.post(1, 0, "act", 0, 0, wire.NO_DECISION, torch.ones(2))  # the lane reads on
    [arrival] = receive_all(receiver)
    assert torch.equal(arrival.tensors[0], torch.ones(2))


def test_a_garbled_gloo_frame_names_its_sender_and_its_receive_is_posted_again():
    from types import SimpleNamespace

    from engine.distributed.gloo_lane import GlooLane
    lane = GlooLane.__new__(GlooLane)  # only its queue of arrived frames: no group needed to read one
    lane._events, reposted = queue.SimpleQueue(), []
    link = SimpleNamespace(peer=2, views=[np.full(64, 7, dtype=np.uint8)], repost=reposted.append)
    lane._events.put((link, 0, None))
    with pytest.raises(wire.Malformed, match="^a message from rank 2 over gloo cannot be read: a header of"):
        lane.receive(0.1)
    assert reposted == [0], "the next frame still has a receive posted for it"
