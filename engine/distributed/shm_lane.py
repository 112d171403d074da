"""The lane between stage processes on one host: payloads in shared memory, headers through a FIFO.

Between processes on one machine a message need not cross a socket. Per pair of neighbouring ranks
and direction there is one FIFO (a named pipe in /dev/shm) that carries each message's header
(engine/distributed/wire.py), and per kind of message a segment of slots in /dev/shm that the
sender copies payloads into: one slot per message of a call, each as large as the first payload
of its kind. A larger payload, or more messages in a call than slots, makes the sender map a new,
larger segment; its generation travels in the header. The receiving stage thread waits on its
FIFOs itself (poll, with a timeout so that it still looks at the Store every POLL_SECONDS), copies
the payload out of its slot and files it: no listener thread, no hand-over of the interpreter
lock. A slot is written again only in a later call, and a call's end waves guarantee that every
message of it has been read by then.

Spin, then sleep (as NCCL and MPI wait): when every stage process of the host has cores of its
own, a waiting stage polls without sleeping for up to SPIN_SECONDS before it sleeps in poll. A
stage that sleeps must be woken, and on a virtual machine that is slow: one way, a message took
130 to 180 us to a sleeping stage and 40 to 70 us to a spinning one on a 2-core host (`python -m
lab.bench`, its ping-pong row). Where stages share cores, a spinning stage would take the core
that the stage it waits for needs, so the lane sleeps at once (`spin_for`).

Nothing stays in /dev/shm: a FIFO's name is removed once both ends are open, a segment's once its
receiver has mapped it (the memory lives on until both processes let go of it or die). A sender
that dies closes its end of the FIFO, so its receiver reads end-of-file at once and reports the
rank lost. Whatever a failure left behind (a segment made but not yet mapped) is removed, by the
pipe's name prefix, when the survivors close their lanes.
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

SHM = "/dev/shm"
RECORD = struct.Struct("<IIQ")  # bytes of the record, segment generation, payload offset; then the header
MIN_SLOTS = 4
SPIN_SECONDS = 0.002  # how long a waiting stage polls before it sleeps, when it has a core of its own


def spin_for(processes: int) -> float:
    """How long a waiting stage spins: GPIPE_SPIN_SECONDS if set (0 never spins; benchmarks set
    both), else SPIN_SECONDS if `processes` ranks on this host, each with this process's intra-op
    threads, leave every one a core of its own, else 0 (spinning would take a core another needs)."""
    asked = os.environ.get("GPIPE_SPIN_SECONDS")
    if asked is not None:
        try:
            seconds = float(asked)
        except ValueError:
            seconds = -1.0
        return checked_spin(seconds, f"GPIPE_SPIN_SECONDS={asked!r}")
    return SPIN_SECONDS if processes * torch.get_num_threads() <= cpu_cores() else 0.0


def checked_spin(seconds: float, said: str) -> float:
    """`seconds` if it is a spin the lane takes (0 up to under a second), else a ValueError that
    quotes `said`, how the value was given."""
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
        """The neighbour's segment of `kind` and `generation`, mapped the first time it is named
        (OSError if it cannot be: its sender or a failure's clean-up removed it first)."""
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
    """This rank's shared-memory connections to its neighbouring stages (see the module docstring).
    `store` is the pipe's Store, `prefix` names its files in /dev/shm (every rank of the pipe is
    given the same), `on_stall` raises a failure of the call that another rank reported (it is
    called while a full FIFO keeps a sender waiting, and before a message that cannot be read is
    reported as malformed), `spin` is how many seconds a wait polls before it sleeps (0: sleep at once)."""

    name = "shared memory"
    error = None  # no waits on works here: a lost peer shows in `receive` itself

    @staticmethod
    def abandon() -> None:
        """A call failed: nothing to abort (no transfer here waits for a peer outside `receive`)."""

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
        for peer in peers:  # open the FIFOs this rank writes, once the neighbour reads them
            store.get(f"shm/{peer}/reading")
            self._outboxes[peer] = os.open(f"{prefix}{rank}to{peer}.fifo", os.O_WRONLY | os.O_NONBLOCK)
        self._slots: dict[tuple[int, str], _Outbox] = {}
        store.set(f"shm/{rank}/writing", "1")
        for peer in peers:  # both ends are open: the names can go
            store.get(f"shm/{peer}/writing")
            os.unlink(f"{prefix}{peer}to{rank}.fifo")

    def begin(self) -> None:
        """A new call: nothing to do (slots are reused call by call)."""

    def post(self, destination: int, step: int, kind: str, micro: int, chunk: int, decision, value) -> None:
        """Copy the payload into a slot, then send the header through the FIFO."""
        header, tensors = wire.encode(step, kind, micro, chunk, decision, value, inline=False)
        generation = offset = 0
        if tensors:
            outbox = self._slots.get((destination, kind))
            if outbox is None:
                outbox = self._slots[(destination, kind)] = _Outbox(f"{self.prefix}{self.rank}to{destination}-{kind}-")
            generation, offset = outbox.place(step, wire.payload_bytes(tensors))
            wire.write_tensors(outbox.segment.view, offset, tensors)
        record = header.numpy().tobytes()
        self._write(destination, RECORD.pack(RECORD.size + len(record), generation, offset) + record)

    def _write(self, destination: int, record: bytes) -> None:
        fd = self._outboxes[destination]
        while True:
            try:
                os.write(fd, record)  # at most PIPE_BUF bytes: written whole or not at all
                return
            except BlockingIOError:  # the neighbour has not read for a while: wait, and look for failures
                select.select([], [fd], [], 0.05)
                self.on_stall()
            except BrokenPipeError as error:
                raise Lost(destination, error) from None

    def receive(self, timeout: float) -> list[Arrival]:
        """The messages that arrived, read and copied out on the calling (stage) thread; [] after
        `timeout` seconds without one. Raises Lost if a neighbour closed its end without a goodbye."""
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
        """The FIFOs with something to read: polled without sleeping for `self.spin` seconds, then
        waited for, asleep, for up to `timeout` seconds."""
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
        """A message from `peer` that cannot be read. While a call is failing that is expected (the
        failure's clean-up removes segments that a neighbour has not mapped yet), and `on_stall`
        raises the failure that started it; else the message is malformed, and said so."""
        self.on_stall()
        reason = f"its payload's segment cannot be opened ({error.strerror})" if isinstance(error, OSError) else error
        return wire.Malformed(f"a message from rank {peer} through shared memory cannot be read: {reason}")

    def close(self, step: int) -> None:
        """Say goodbye to every neighbour, close and unmap everything, remove what is left of the
        pipe's files (after a failure, segments that no receiver mapped)."""
        header, _ = wire.encode(step, "bye", 0, 0, wire.NO_DECISION, None)
        record = header.numpy().tobytes()
        for peer, fd in self._outboxes.items():
            try:
                os.write(fd, RECORD.pack(RECORD.size + len(record), 0, 0) + record)
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
