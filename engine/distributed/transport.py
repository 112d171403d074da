"""Stages as processes: how rank i of a torch.distributed group exchanges activations and gradients
with the ranks of the neighbouring stages.

`ProcessTransport` offers a stage's task loop the same `receive` / `send` / `check` calls as the
thread transport,
over point-to-point messages in the format of engine/wire.py. It uses process groups of its own
(made once, from the group's ranks), so its traffic never mixes with the user's and an idle pipe
never times out.

How a message travels. Each rank keeps a few receives posted per neighbouring stage; small
messages land in them whole (header and payload in one frame). A listener thread per neighbour
waits for those receives in order and only signals "frame arrived" (one hand-over of the
interpreter lock per message); the stage's own thread reads the header, copies the payload out,
posts the receive again and files the value under its key, so any schedule's order works on gloo
and NCCL alike. Measured on a 2-core host, a listener that decoded frames itself slowed the stage
thread's own work by up to 60% (the two threads traded the interpreter lock at every tensor op).
A sender thread waits for each send to complete and releases its buffers, so no stage thread ever
blocks on a neighbour.

Failures never leave a rank waiting. An exception in a rank's stage is written to the group's
Store, a side channel every rank reaches, and a rank that waits for a message looks there every
POLL_SECONDS. A rank that dies closes its connections: its neighbours' listeners see that at once
and tell the Store, from which every other rank learns it.
"""
from __future__ import annotations

import collections
import datetime
import itertools
import os
import queue
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from . import wire
from ..call import Decision
from ..microbatch import Value
from ..schedule import owner
from ..transport import StageFailed

HEADER_TAG, DATA_TAG, CLOCK_TAG = 1, 2, 3
PREPOSTED = 8                                  # receives kept posted per neighbour
REAP_AFTER = 16                                # sends in flight before the sender thread releases some
NEVER = datetime.timedelta(days=365)           # the transport's own groups never time out while idle
POLL_SECONDS = 0.05                            # how often a waiting rank looks for failures elsewhere
CLOCK_ROUNDS = 8
_serials = itertools.count()                   # pipes made in this process: the same order on every rank


@dataclass(frozen=True)
class Ranks:
    """Where this process sits: its rank in the pipeline's group (which is its stage) and the size."""

    rank: int
    size: int
    backend: str

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1


def check_group(group, stages: int) -> Ranks:
    """Check that `group` is an initialized process group with one rank per stage, this one among them."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group= needs torch.distributed initialized first: call "
                         "torch.distributed.init_process_group('gloo') (under torchrun) before building the pipe")
    size = dist.get_world_size(group)
    if size != stages:
        raise ValueError(f"the group has {size} ranks but the pipeline has {stages} stages; expected one rank "
                         f"per stage (rank i runs stage i): pass balance={size} or a group of {stages} ranks")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the group passed as group=")
    return Ranks(rank, size, dist.get_backend(group))


def _clock_id() -> str:
    """Names this machine's clock: perf_counter (CLOCK_MONOTONIC) is shared by its processes."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{f.read().strip()}@{socket.gethostname()}"
    except OSError:
        return f"process {os.getpid()}@{socket.gethostname()}"  # unknown: measure the offset


@dataclass(frozen=True)
class Logged:
    """One message of a call as this rank saw it; times are perf_counter readings."""

    step: int
    peer: int
    direction: str   # what the stage thread spent on it: "send" encodes and hands over, "receive" reads
    kind: str        # "act" or "grad"
    micro: int
    nbytes: int
    start: float
    end: float


class _Link:
    """The receives this rank keeps posted for one neighbour, used in order, slot after slot."""

    def __init__(self, peer: int, group):
        self.peer, self.group = peer, group
        self.frames = [torch.empty(wire.FRAME_BYTES, dtype=torch.uint8) for _ in range(PREPOSTED)]
        self.views = [frame.numpy() for frame in self.frames]
        self.works = [group.recv([frame], peer, HEADER_TAG) for frame in self.frames]
        self.posted = threading.Semaphore(PREPOSTED)  # posted receives the listener has not waited for yet

    def repost(self, slot: int) -> None:
        self.works[slot] = self.group.recv([self.frames[slot]], self.peer, HEADER_TAG)
        self.posted.release()


class ProcessTransport:
    """This rank's connections to its neighbouring stages (see the module docstring)."""

    def __init__(self, ranks: Ranks, group, device: torch.device, upstream: Optional[int], downstream: Optional[int]):
        self.ranks, self.device, self.upstream = ranks, device, upstream
        members = dist.get_process_group_ranks(group)
        self.wire = dist.new_group(members, backend="gloo", timeout=NEVER, use_local_synchronization=False)
        # NCCL matches messages per peer in posting order, with equal counts on both sides: one
        # communicator per direction keeps activations and gradients apart; headers go on gloo
        self.nccl = device.type == "cuda" and ranks.backend == "nccl"
        self.tensor_groups = {kind: dist.new_group(members, backend="nccl", use_local_synchronization=False)
                              for kind in ("act", "grad")} if self.nccl else {}
        self.store = dist.PrefixStore(f"gpipe-lab/{next(_serials)}/{'-'.join(map(str, members))}/",
                                      dist.distributed_c10d._get_default_store())
        self.clock_offset = self._measure_clock_offset()
        self.step = -1
        self.decision: Optional[Decision] = None
        self._arrived: dict = {}                      # (step, kind, micro, chunk) -> (value, ready event)
        self._decided = -1                            # the last call whose decision arrived
        self._failure: Optional[StageFailed] = None   # a lost connection: every later wait raises it
        self._events: queue.SimpleQueue = queue.SimpleQueue()  # (link, slot) or (None, error, peer)
        self._log: list[tuple] = []                   # Logged fields, as tuples
        self._in_flight: collections.deque = collections.deque()  # (works, buffers, peer) of sends not yet reaped
        self._reap = threading.Condition()           # wakes the sender thread: reap what is in flight
        self._wakes = 0
        self._closed = False
        peers = sorted({p for p in (upstream, downstream) if p is not None and p != ranks.rank})
        self._links = [_Link(peer, self.wire) for peer in peers]
        self._threads = [threading.Thread(target=self._listen, args=(link,), daemon=True,
                                          name=f"gpipe-listen-{ranks.rank}-from-{link.peer}") for link in self._links]
        self._threads.append(threading.Thread(target=self._complete_sends, daemon=True, name=f"gpipe-send-{ranks.rank}"))
        for thread in self._threads:
            thread.start()

    # --- one call ---------------------------------------------------------------------------

    def begin(self, step: int) -> None:
        """Start call `step`."""
        self.step, self.decision = step, None
        self._arrived = {key: value for key, value in self._arrived.items() if key[0] >= step}
        self._log = [entry for entry in self._log if entry[0] >= step]
        self._wake_sender()  # the last call's sends are complete by now: release their buffers

    def agree(self, decision: Optional[Decision]) -> Decision:
        """The current call's decision: the first stage's own (it travels with its activations), or,
        on the other stages, the one that came with the previous stage's first message."""
        self.decision = decision if decision is not None else self._get((self.step, "decision", 0, 0))
        return self.decision

    def receive(self, stage: int, key):
        """What a neighbour sent for the current call under `key`: (value, ready event or None)."""
        return self._get((self.step, *key))

    def send(self, source: int, destination: int, key, value: Value) -> None:
        """Send `value`, for the current call, to the rank that holds chunk `destination`, under `key`
        (to this very rank, with one stage of several chunks, it is filed directly)."""
        kind, micro, chunk = key
        rank = owner(destination, self.ranks.size)
        if rank == self.ranks.rank:
            self._arrived[(self.step, kind, micro, chunk)] = (value, None)
            return
        self._post(rank, kind, micro, chunk, value)

    def send_control(self, destination: int, kind: str, value=None) -> None:
        """Send the current call's "end" (upstream) or "done" (downstream) message."""
        self._post(destination, kind, 0, 0, value)

    def receive_control(self, kind: str):
        """The value of the current call's "end" or "done" message."""
        return self._get((self.step, kind, 0, 0))[0]

    def check(self) -> None:
        """Raise StageFailed if a connection was lost (failures elsewhere are seen while waiting)."""
        if self._failure is not None:
            raise self._failure

    def messages(self) -> list[Logged]:
        """The current call's activation and gradient messages, as this rank sent and received them."""
        return [Logged(*entry) for entry in list(self._log) if entry[0] == self.step]

    # --- failures ------------------------------------------------------------------------------

    def report_failure(self, description: str) -> None:
        """Tell every rank that this rank's part of the current call failed (the first report stays)."""
        try:
            self.store.compare_set(f"failed/{self.step}", "", description)
        except Exception:  # the store is gone too: every rank will notice that by itself
            pass

    def check_failures(self) -> None:
        """Raise StageFailed if a rank reported a failure of the current call, or a rank was lost."""
        try:
            for key in ("broken", f"failed/{self.step}"):
                if self.store.check([key]):
                    raise StageFailed(self.store.get(key).decode())
        except StageFailed:
            raise
        except Exception as error:
            raise StageFailed(f"rank {self.ranks.rank} lost the pipeline's store, the side channel every rank "
                              f"shares (it lives with the launcher or the process that made it): {error}") from None

    def _lost(self, peer: int, error: BaseException) -> StageFailed:
        """The connection to `peer` broke: this rank gives up, and tells the others through the store."""
        description = (f"[rank {peer}, stage {peer}] unreachable: rank {self.ranks.rank} lost its connection to "
                       f"it ({str(error).splitlines()[0][:200]}); its process has probably died")
        try:
            self.store.set("broken", description)
        except Exception:
            pass
        return StageFailed(description)

    # --- the stage thread's side ---------------------------------------------------------------

    def _get(self, key):
        """Read arriving frames, in order, until the one filed under `key` is there."""
        while key not in self._arrived:
            if self._failure is not None:
                raise self._failure
            try:
                link, slot, *peer = self._events.get(timeout=POLL_SECONDS)
            except queue.Empty:
                self.check_failures()
                continue
            if link is None:  # a listener or the sender lost its connection: `slot` is the error
                self._failure = self._lost(peer[0], slot)
                raise self._failure
            self._read(link, slot)
        return self._arrived.pop(key)

    def _read(self, link: _Link, slot: int) -> None:
        start = time.perf_counter()
        header = wire.decode_header(link.views[slot])
        tensors = wire.inline_tensors(link.views[slot], header) if header.inline else None
        link.repost(slot)
        data = header.kind in ("act", "grad")  # control frames ("end", "done") stay on the host
        if tensors is None:
            tensors = self._payload(link.peer, header, data)
        elif data and self.device.type == "cuda":
            tensors = [None if t is None else t.to(self.device) for t in tensors]
        ready = None
        if self.nccl and header.kind in self.tensor_groups:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        if header.kind == "act" and link.peer == self.upstream and header.step > self._decided:
            self._decided = header.step  # the first activation of a call brings its decision
            self._arrived[(header.step, "decision", 0, 0)] = header.decision
        if data:
            self._log.append((header.step, link.peer, "receive", header.kind, header.micro, header.payload_bytes,
                              start, time.perf_counter()))
        self._arrived[(header.step, header.kind, header.micro, header.chunk)] = \
            (wire.rebuild_value(header.form, tensors), ready)

    def _payload(self, peer: int, header: wire.Header, data: bool) -> list:
        """Tensors that follow their frame, received straight into tensors of the announced shapes
        (activations and gradients then moved to this stage's device)."""
        group = self.tensor_groups.get(header.kind)
        device = self.device if group is not None else torch.device("cpu")
        group, tag = (group, 0) if group is not None else (self.wire, DATA_TAG)
        tensors = wire.empty_tensors(header, device)
        try:
            for t in tensors:
                if t is not None:
                    group.recv([t], peer, tag).wait()
        except Exception as error:
            self._failure = self._lost(peer, error)
            raise self._failure from None
        if data and device != self.device:
            tensors = [None if t is None else t.to(self.device) for t in tensors]
        return wire.marked(tensors, header)

    def _post(self, destination: int, kind: str, micro: int, chunk: int, value) -> None:
        start = time.perf_counter()
        decision = self.decision or wire.NO_DECISION
        group = self.tensor_groups.get(kind)
        if group is None:
            frame, tensors = wire.encode(self.step, kind, micro, chunk, decision, _on_cpu(value))
            group, tag = self.wire, DATA_TAG
        else:
            frame, tensors = wire.encode(self.step, kind, micro, chunk, decision, value, inline=False)
            tag = 0
        works = [self.wire.send([frame], destination, HEADER_TAG)] + [group.send([t], destination, tag) for t in tensors]
        self._in_flight.append((works, (frame, tensors), destination))
        if len(self._in_flight) > REAP_AFTER:
            self._wake_sender()
        if kind in ("act", "grad"):
            nbytes = sum(t.numel() * t.element_size() for t in wire.describe(value)[1] if t is not None)
            self._log.append((self.step, destination, "send", kind, micro, nbytes, start, time.perf_counter()))

    # --- threads -------------------------------------------------------------------------------

    def _listen(self, link: _Link) -> None:
        """Listener thread: wait for the posted receives of one neighbour in order and signal each."""
        goodbyes = 0
        for slot in itertools.cycle(range(PREPOSTED)):
            link.posted.acquire()
            try:
                link.works[slot].wait()
            except Exception as error:
                if not self._closed:
                    self._events.put((None, error, link.peer))
                return
            if struct.unpack_from("<q", link.views[slot], 16)[0] == wire.KINDS.index("bye"):
                goodbyes += 1
                if goodbyes == PREPOSTED:  # the neighbour closed: every posted receive is answered
                    return
                continue
            if self._closed:  # nobody reads any more: keep the slot posted for the goodbyes
                link.repost(slot)
                continue
            self._events.put((link, slot))

    def _wake_sender(self) -> None:
        with self._reap:
            self._wakes += 1
            self._reap.notify()

    def _complete_sends(self) -> None:
        """Sender thread: when woken, wait for the sends in flight, in order, and release their
        buffers. Woken once per call and every REAP_AFTER sends, not once per message: each
        hand-over between threads costs tens of microseconds here."""
        seen = 0
        while True:
            with self._reap:
                self._reap.wait_for(lambda: self._wakes > seen)
                seen = self._wakes
            while self._in_flight:
                works, _buffers, destination = self._in_flight[0]
                try:
                    for work in works:
                        work.wait()
                except Exception as error:
                    if not self._closed:
                        self._events.put((None, error, destination))
                    return
                self._in_flight.popleft()
                del works, _buffers
            if self._closed:
                return

    def _measure_clock_offset(self) -> float:
        """Seconds to subtract from this rank's perf_counter to read rank 0's: 0 on rank 0's machine,
        else the midpoint estimate of the fastest of a few round trips with rank 0."""
        me = self.ranks.rank
        self.store.set(f"clock/{me}", _clock_id())
        clocks = [self.store.get(f"clock/{r}").decode() for r in range(self.ranks.size)]
        remote = [r for r in range(1, self.ranks.size) if clocks[r] != clocks[0]]
        stamp = torch.zeros(1, dtype=torch.float64)
        if me == 0:
            for peer in remote:
                for _ in range(CLOCK_ROUNDS):
                    self.wire.recv([stamp], peer, CLOCK_TAG).wait()
                    self.wire.send([torch.tensor([time.perf_counter()], dtype=torch.float64)], peer, CLOCK_TAG).wait()
            return 0.0
        if me not in remote:
            return 0.0
        best, offset = float("inf"), 0.0
        for _ in range(CLOCK_ROUNDS):
            sent = time.perf_counter()
            self.wire.send([torch.tensor([sent], dtype=torch.float64)], 0, CLOCK_TAG).wait()
            self.wire.recv([stamp], 0, CLOCK_TAG).wait()
            back = time.perf_counter()
            if back - sent < best:
                best, offset = back - sent, (sent + back) / 2 - stamp.item()
        return offset

    def close(self, timeout: float = 5.0) -> None:
        """Stop this rank's threads. Goodbyes answer every receive a neighbour keeps posted here;
        this rank's own listeners end when the neighbours' goodbyes come (a neighbour that never
        closes leaves them waiting, as daemon threads, until the process exits)."""
        if self._closed:
            return
        self._closed = True
        frame, _ = wire.encode(self.step, "bye", 0, 0, wire.NO_DECISION, None)
        for link in self._links:
            try:
                for _ in range(PREPOSTED):
                    self._in_flight.append(([self.wire.send([frame], link.peer, HEADER_TAG)], frame, link.peer))
            except Exception:
                pass  # that neighbour is gone: nothing waits on the connection any more
        while True:  # frames still unread: give their slots back to the listeners
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
            if event[0] is not None:
                event[0].repost(event[1])
        self._wake_sender()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        for group in [self.wire, *self.tensor_groups.values()]:
            try:
                dist.destroy_process_group(group)
            except Exception:  # the default group is already gone (the process is shutting down)
                pass


def _on_cpu(value):
    """gloo moves host memory: CUDA tensors are copied to the host first."""
    form, tensors = wire.describe(value)
    if not any(t is not None and t.is_cuda for t in tensors):
        return value
    return wire.rebuild_value(form, [None if t is None else t.cpu() for t in tensors])
