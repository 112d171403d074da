"""The lane between stage processes on one host: payloads in shared memory, headers through a FIFO.

Per neighbour and direction, one FIFO in /dev/shm carries each message's header (wire.py); per kind
of message, a segment of slots carries payloads, one slot per message of a call. A larger payload,
or more messages than slots, makes the sender map a new segment, whose generation travels in the
header. The receiving stage thread polls its FIFOs itself (no listener thread, no hand-over of the
interpreter lock) and copies the payload out. A slot is reused only in a later call, once the
call's end waves say every message of it was read.

Spin, then sleep, as NCCL and MPI wait: where every stage process has cores of its own, a waiting
stage polls for up to SPIN_SECONDS before it sleeps, since waking a sleeper is slow on a virtual
machine (`python -m lab.bench`, its ping-pong row); where stages share cores it sleeps at once.

Nothing stays in /dev/shm: a FIFO's name goes once both ends are open, a segment's once its
receiver mapped it. A sender that dies closes its FIFO, so its receiver reads end-of-file at once.
What a failure leaves (a segment not yet mapped) is swept by the pipe's prefix when lanes close.
"""
from __future__ import annotations

import errno
import glob
import mmap
import os
import select
import struct
import time
from typing import Callable

import numpy as np
import torch

from ..device import cpu_cores
from . import wire
from .wire import Arrival, Lost
from .works import Stalled, in_seconds, keys_within, progress_bound, setup_bound

SHM = "/dev/shm"
RECORD = struct.Struct("<IIQ")  # bytes of the record, segment generation, payload offset; then the header
MIN_SLOTS = 4
SPIN_SECONDS = 0.002  # how long a waiting stage polls before it sleeps, when it has a core of its own


def spin_for(processes: int) -> float:
    """How long a waiting stage spins: GPIPE_SPIN_SECONDS if set, else SPIN_SECONDS if `processes`
    ranks with this process's intra-op threads leave each a core of its own, else 0."""
    asked = os.environ.get("GPIPE_SPIN_SECONDS")
    if asked is not None:
        try:
            seconds = float(asked)
        except ValueError:
            seconds = -1.0
        return checked_spin(seconds, f"GPIPE_SPIN_SECONDS={asked!r}")
    return SPIN_SECONDS if processes * torch.get_num_threads() <= cpu_cores() else 0.0


def checked_spin(seconds: float, said: str) -> float:
    """`seconds` if it is a spin from 0 to under a second, else a ValueError quoting `said`."""
    if not 0 <= seconds < 1:
        raise ValueError(f"{said}: expected seconds from 0 to under 1")
    return seconds


def available() -> bool:
    """Whether this host offers POSIX shared memory and FIFOs where this lane puts them."""
    return os.path.isdir(SHM) and os.access(SHM, os.W_OK) and hasattr(os, "mkfifo")


class _Segment:
    """One mapped segment of slots."""

    def __init__(self, path: str, size: int = 0):
        if size:  # the sender makes it
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, size)
        else:     # the receiver maps it, then removes its name: nobody else needs it
            fd = os.open(path, os.O_RDWR)
            size = os.fstat(fd).st_size
            os.unlink(path)
        try:
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.view = np.frombuffer(self.map, dtype=np.uint8)

    def close(self) -> None:
        del self.view
        try:
            self.map.close()
        except BufferError:  # a tensor still refers to it: the mapping goes with that tensor
            pass


class _Outbox:
    """This rank's slots for one kind of message to one neighbour."""

    def __init__(self, prefix: str):
        self.prefix, self.generation, self.segment = prefix, -1, None
        self.slots = self.slot_bytes = 0
        self.step, self.used = -1, 0

    def place(self, step: int, nbytes: int) -> tuple[int, int]:
        """(generation, offset) of a free slot of at least `nbytes` for a message of call `step`."""
        if step != self.step:
            self.step, self.used = step, 0
        if self.used >= self.slots or nbytes > self.slot_bytes:
            self._grow(max(MIN_SLOTS, 2 * self.slots, self.used + 1), max(nbytes, self.slot_bytes, 16))
        self.used += 1
        return self.generation, (self.used - 1) * self.slot_bytes

    def _grow(self, slots: int, slot_bytes: int) -> None:
        if self.segment is not None:
            self.segment.close()  # its name stays until the receiver maps it for the messages it holds
        self.generation += 1
        self.slots, self.slot_bytes = slots, slot_bytes
        self.segment = _Segment(f"{self.prefix}{self.generation}", slots * slot_bytes)

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close()
        for generation in range(self.generation + 1):
            try:
                os.unlink(f"{self.prefix}{generation}")
            except FileNotFoundError:
                pass  # mapped by the receiver, which removed the name


class _Inbox:
    """What one neighbour sends this rank: the read end of its FIFO and its segments, by kind."""

    def __init__(self, peer: int, fd: int, prefix: str):
        self.peer, self.fd, self.prefix = peer, fd, prefix
        self.pending = b""
        self.segments: dict[str, tuple[int, _Segment]] = {}
        self.said_bye = False

    def segment(self, kind: str, generation: int) -> _Segment:
        """The neighbour's segment of `kind` and `generation`, mapped when first named (OSError if gone)."""
        known = self.segments.get(kind)
        if known is None or known[0] != generation:
            if known is not None:
                del self.segments[kind]
                known[1].close()
            known = (generation, _Segment(f"{self.prefix}{kind}-{generation}"))
            self.segments[kind] = known
        return known[1]

    def close(self) -> None:
        os.close(self.fd)
        for _, segment in self.segments.values():
            segment.close()


class ShmLane:
    """This rank's shared-memory connections to its neighbours. `prefix` names the pipe's files in
    /dev/shm; `on_stall` raises a failure another rank reported (called while a full FIFO holds a
    sender, and before calling a message malformed); `spin`: seconds a wait polls before it sleeps."""

    name = "shared memory"
    error = None  # no waits on works here: a lost peer shows in `receive` itself

    @staticmethod
    def abandon(also: list = ()) -> None:
        """A call failed: nothing to abort (no transfer here waits for a peer outside `receive`; stages
        on CPUs have no NCCL group, `also`, to abort)."""

    def __init__(self, rank: int, peers: list[int], store, prefix: str, on_stall: Callable[[], None],
                 spin: float = 0.0):
        self.rank, self.prefix, self.on_stall, self.spin = rank, prefix, on_stall, spin
        self._poller = select.poll()
        self._inboxes: dict[int, _Inbox] = {}
        for peer in peers:  # make and open the FIFOs this rank reads, then say so
            path = f"{prefix}{peer}to{rank}.fifo"
            os.mkfifo(path, 0o600)
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            self._inboxes[fd] = _Inbox(peer, fd, f"{prefix}{peer}to{rank}-")
            self._poller.register(fd, select.POLLIN)
        store.set(f"shm/{rank}/reading", "1")
        self._outboxes: dict[int, int] = {}
        meeting = f"rank {rank}: opening the shared-memory lane"
        keys_within(store, [f"shm/{peer}/reading" for peer in peers], setup_bound(), meeting, on_stall)
        for peer in peers:  # open the FIFOs this rank writes, once the neighbour reads them
            self._outboxes[peer] = os.open(f"{prefix}{rank}to{peer}.fifo", os.O_WRONLY | os.O_NONBLOCK)
        self._slots: dict[tuple[int, str], _Outbox] = {}
        store.set(f"shm/{rank}/writing", "1")
        keys_within(store, [f"shm/{peer}/writing" for peer in peers], setup_bound(), meeting, on_stall)
        for peer in peers:  # both ends are open: the names can go
            os.unlink(f"{prefix}{peer}to{rank}.fifo")

    def begin(self) -> None:
        """A new call: nothing to do (slots are reused call by call)."""

    def expect(self, step: int, order) -> None:
        """Nothing to order: a write to a FIFO or a slot never waits for the reader's receive."""

    @staticmethod
    def held(step: int) -> dict[int, int]:
        """Nothing waits for a turn here."""
        return {}

    def post(self, destination: int, step: int, kind: str, micro: int, chunk: int, decision, value) -> None:
        """Copy the payload into a slot, then send the header through the FIFO."""
        header, tensors = wire.encode_header(step, kind, micro, chunk, decision, value)
        generation = offset = 0
        if tensors:
            outbox = self._slots.get((destination, kind))
            if outbox is None:
                outbox = self._slots[(destination, kind)] = _Outbox(f"{self.prefix}{self.rank}to{destination}-{kind}-")
            generation, offset = outbox.place(step, wire.payload_bytes(tensors))
            wire.write_tensors(outbox.segment.view, offset, tensors)
        self._write(destination, RECORD.pack(RECORD.size + len(header), generation, offset) + header)

    def _write(self, destination: int, record: bytes) -> None:
        """Write one record into the neighbour's FIFO; while the FIFO is full, wait and look for
        failures, up to a transfer's bound (Stalled: the neighbour read nothing for that long)."""
        fd, since = self._outboxes[destination], None
        while True:
            try:
                os.write(fd, record)  # at most PIPE_BUF bytes: written whole or not at all
                return
            except BlockingIOError:  # the neighbour has not read for a while: wait, and look for failures
                since = time.monotonic() if since is None else since
                select.select([], [fd], [], 0.05)
                self.on_stall()
                if time.monotonic() - since > progress_bound(len(record)):  # it may be busy, or between calls
                    raise Lost(destination, Stalled(f"waited {in_seconds(time.monotonic() - since)} for stage "
                                                    f"{destination} to read its full FIFO, its bound")) from None
            except BrokenPipeError as error:
                raise Lost(destination, error) from None

    def receive(self, timeout: float) -> list[Arrival]:
        """The messages that arrived, copied out on the stage thread; [] after `timeout` seconds. Lost
        if a neighbour closed its end without a goodbye."""
        arrivals = []
        for fd, _ in self._ready(timeout):
            inbox = self._inboxes[fd]
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                if inbox.said_bye:
                    self._poller.unregister(fd)
                    continue
                raise Lost(inbox.peer, EOFError("its end of the shared-memory lane closed"))
            inbox.pending += chunk
            arrivals += self._records(inbox)
        return arrivals

    def _ready(self, timeout: float) -> list[tuple[int, int]]:
        """The FIFOs with something to read: polled for `self.spin` s, then slept on for up to `timeout` s."""
        if self.spin:
            until = time.perf_counter() + self.spin
            while time.perf_counter() < until:
                ready = self._poller.poll(0)
                if ready:
                    return ready
        return self._poller.poll(timeout * 1e3)

    def _records(self, inbox: _Inbox) -> list[Arrival]:
        """The whole records read so far from one neighbour's FIFO, their payloads copied out."""
        arrivals = []
        while len(inbox.pending) >= RECORD.size:
            length, generation, offset = RECORD.unpack_from(inbox.pending)
            if len(inbox.pending) < length and length <= select.PIPE_BUF:
                break
            start = time.perf_counter()
            try:
                if not RECORD.size < length <= select.PIPE_BUF:
                    raise wire.Malformed(f"a record of {length} bytes")
                header = wire.decode_header(np.frombuffer(inbox.pending, dtype=np.uint8, count=length - RECORD.size,
                                                          offset=RECORD.size))
                inbox.pending = inbox.pending[length:]
                if header.kind == "bye":
                    inbox.said_bye = True
                    continue
                tensors = wire.tensors_in(inbox.segment(header.kind, generation).view, offset, header) \
                    if header.entries else []
            except (wire.Malformed, OSError) as error:
                raise self._unreadable(inbox.peer, error) from None
            arrivals.append(Arrival(inbox.peer, header, tensors, None, start, time.perf_counter()))
        return arrivals

    def _unreadable(self, peer: int, error: BaseException) -> wire.Malformed:
        """A message from `peer` that cannot be read: the failure in progress, if one is (its clean-up
        removes unmapped segments, and `on_stall` raises it), else Malformed."""
        self.on_stall()
        reason = f"its payload's segment cannot be opened ({error.strerror})" if isinstance(error, OSError) else error
        return wire.Malformed(f"a message from rank {peer} through shared memory cannot be read: {reason}")

    def close(self, step: int) -> None:
        """Say goodbye to every neighbour, close and unmap everything, sweep the pipe's files."""
        header, _ = wire.encode_header(step, "bye", 0, 0, wire.NO_DECISION, None)
        for fd in self._outboxes.values():
            try:
                os.write(fd, RECORD.pack(RECORD.size + len(header), 0, 0) + header)
            except OSError as error:
                if error.errno not in (errno.EPIPE, errno.EAGAIN):
                    raise
            os.close(fd)
        for outbox in self._slots.values():
            outbox.close()
        for inbox in self._inboxes.values():
            inbox.close()
        sweep(self.prefix)


def sweep(prefix: str) -> None:
    """Remove every file in /dev/shm whose name starts with `prefix` (a pipe's, or a pool's)."""
    for path in glob.glob(glob.escape(prefix) + "*"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
