"""The lane over torch.distributed: gloo point-to-point, NCCL for payloads between GPUs; for ranks
on several hosts and for stages on GPUs.

Each rank keeps a few receives posted per neighbour, and a small message lands in one whole (header
and payload in one frame). A listener thread per neighbour reads only a frame's first words and
signals "frame arrived"; the stage thread decodes it (a listener that decoded traded the interpreter
lock with the stage at every tensor op). A sender thread completes sends and frees their buffers, so
a stage never blocks on a neighbour. The lane's groups are its own, so its traffic never mixes with
the user's; each wait on them passes its own timeout, so an idle pipe never times out.

Between GPUs, payloads travel on one two-rank NCCL group per neighbour, both ways, posted in the
call's one order (turns.py) from a stream per neighbour; on gloo the receives reach the stage in
that order too, so the CPU runs the same turns. A failed call aborts the NCCL groups (a send to a
neighbour that stopped reading would never match); a later call then raises StageFailed. Making
the lane and every transfer have bounds (works.py).
"""
from __future__ import annotations

import collections
import contextlib
import datetime
import functools
import queue
import struct
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

from ..transport import StageFailed
from . import wire
from .turns import Turns
from .wire import Arrival, Lost
from .works import (
    finished_within,
    gloo_timeout,
    gloo_waited,
    progress_bound,
    setup_bound,
    transfer_bound,
    until_completed,
)

HEADER_TAG, DATA_TAG, CLOCK_TAG = 1, 2, 3
PREPOSTED = 8                                  # receives kept posted per neighbour
REAP_AFTER = 16                                # sends in flight before the sender thread releases some
NEVER = datetime.timedelta(days=365)           # a listener's wait for the next header: an idle pipe never times out
CLOCK_ROUNDS = 8
PAYLOAD_KINDS = ("act", "grad")                # messages posted in turns; their payloads go over NCCL between GPUs


class _Link:
    """The receives kept posted for one neighbour, waited for in posting order (gloo fills the first
    posted first), and the frames landed from it, handed on in landing order."""

    def __init__(self, peer: int, group):
        self.peer, self.group = peer, group
        self.frames = [torch.empty(wire.FRAME_BYTES, dtype=torch.uint8) for _ in range(PREPOSTED)]
        self.views = [frame.numpy() for frame in self.frames]
        self.works = [group.recv([frame], peer, HEADER_TAG) for frame in self.frames]
        self.order = collections.deque(range(PREPOSTED))  # slots posted, in the order gloo fills them
        self.landed: collections.deque = collections.deque()  # [slot, its turn came], in landing order
        self.lock = threading.Lock()
        self.posted = threading.Semaphore(PREPOSTED)  # posted receives the listener has not waited for yet

    def repost(self, slot: int) -> None:
        with self.lock:
            self.works[slot] = self.group.recv([self.frames[slot]], self.peer, HEADER_TAG)
            self.order.append(slot)
        self.posted.release()


class GlooLane:
    """This rank's gloo (and NCCL) connections to its neighbouring stages."""

    def __init__(self, rank: int, pipelines: list, members: list[int], peers: list[int], device: torch.device,
                 nccl: bool, placement: tuple = (), check=lambda: None):
        self.rank, self.device = rank, device
        self.name = "gloo+nccl" if nccl else "gloo"  # headers always on gloo; payloads between GPUs on NCCL
        self.wire = wire_group(pipelines, members, rank)
        # a two-rank NCCL group per neighbour, both ways: the turns keep its sends and receives from crossing
        self.tensor_groups = edge_groups(pipelines, members, len(members), placement) if nccl else {}
        self.turns = Turns(rank)
        self._events: queue.SimpleQueue = queue.SimpleQueue()  # (link, slot) or (None, error, peer)
        self._in_flight: collections.deque = collections.deque()  # sends: (gloo works, NCCL works, buffers, peer)
        self._reap = threading.Condition()           # wakes the sender thread: reap what is in flight
        self._wakes = 0
        self._closed = False
        self.error: Optional[tuple[int, BaseException]] = None  # (peer, error) a listener or the sender met
        self._abandoned = False                      # a call failed: NCCL's groups are aborted
        self._streams: dict = {}                     # neighbour -> the stream its NCCL transfers are posted from
        self._links = [_Link(peer, self.wire) for peer in peers]
        self._threads = [threading.Thread(target=self._listen, args=(link,), daemon=True,
                                          name=f"gpipe-listen-{rank}-from-{link.peer}") for link in self._links]
        self._threads.append(threading.Thread(target=self._complete_sends, daemon=True, name=f"gpipe-send-{rank}"))
        for thread in self._threads:
            thread.start()
        try:  # with the listeners up: a neighbour that dies now is seen on its gloo connection
            connect(self.tensor_groups, rank, device, lambda: (check(), self._raise_if_lost()), self._raise_if_lost)
        except BaseException:
            self._abandoned = True  # connect aborted the NCCL groups
            self.close(-1, timeout=1.0)
            raise

    def _raise_if_lost(self) -> None:
        """Raise StageFailed if a listener lost its neighbour (while the pipe is built)."""
        if self.error is not None:
            peer, error = self.error
            raise StageFailed(f"rank {self.rank} lost rank {peer} while the pipe was built: "
                              f"{str(error).splitlines()[0][:200]}")

    def begin(self) -> None:
        """A new call: free the last call's send buffers (refused after a call that aborted NCCL)."""
        if self._abandoned:
            raise StageFailed(f"rank {self.rank}: an earlier call failed and its NCCL transfers were aborted, "
                              f"so this pipe cannot run another call; close it and make a new one")
        self._wake_sender()

    def expect(self, step: int, order) -> None:
        """Call `step` posts its activations and gradients in `order` (turns.transfer_order; None: as they come)."""
        self.turns.expect(step, order)

    def held(self, step: int) -> dict[int, int]:
        """Messages of call `step` that landed and wait for their turn, per sending rank."""
        return self.turns.held(step)

    def abandon(self, also: list = ()) -> None:
        """The call failed somewhere: abort NCCL's groups, the edges' and `also` (this rank's other NCCL
        groups) in one call, so nothing waits for transfers a failed peer will never match (gloo's
        waits end when a peer's connection closes)."""
        groups = [group for group, _ in self.tensor_groups.values()] + list(also)
        if self._abandoned or not groups:
            return
        self._abandoned = True
        abort_groups(groups)
        self._wake_sender()

    def post(self, destination: int, step: int, kind: str, micro: int, chunk: int, decision, value) -> None:
        """Send one message: its header at once, an NCCL payload in its turn; buffers are held until
        the sends complete, on the sender thread."""
        edge = self.tensor_groups.get(destination) if kind in PAYLOAD_KINDS else None
        if edge is None:  # over gloo, header and payload at once (gloo's sends never wait for a receive)
            frame, tensors = wire.encode(step, kind, micro, chunk, decision, _on_cpu(value))
            sends = [self.wire.send([frame], destination, HEADER_TAG)]
            sends += [self.wire.send([t], destination, DATA_TAG) for t in tensors]
            self._hold(sends, [], [frame, *tensors], destination)
            if kind in PAYLOAD_KINDS:
                self.turns.offer(step, (kind, micro, chunk), "send", _nothing)
            return
        # NCCL moves GPU memory: a host tensor in a GPU stage's value goes to its GPU first
        frame, tensors = wire.encode(step, kind, micro, chunk, decision, _on_gpu(value, self.device), inline=False)
        self._hold([self.wire.send([frame], destination, HEADER_TAG)], [], [frame], destination)
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(self.device))
        self.turns.offer(step, (kind, micro, chunk), "send",
                         functools.partial(self._send_payload, edge, destination, tensors, produced))

    def _send_payload(self, edge: tuple, destination: int, tensors: list, produced) -> None:
        """In its turn: post a message's NCCL sends from the neighbour's stream, after `produced`."""
        group, peer = edge
        try:
            stream = self._stream(destination)
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                stream.wait_event(produced)
                works = [group.send([as_bytes(t)], peer, 0) for t in tensors]
        except Exception as error:  # an aborted group: the stage thread raises it
            self._fail(destination, error)
            return
        self._hold([], works, tensors, destination)

    def _hold(self, gloo: list, nccl: list, buffers: list, destination: int) -> None:
        """Keep a send's buffers until its works complete (the sender thread reaps them)."""
        self._in_flight.append((gloo, nccl, buffers, destination))
        if len(self._in_flight) > REAP_AFTER:
            self._wake_sender()

    def _stream(self, peer: int):
        """The stream this rank posts its NCCL transfers with `peer` from (made on first use)."""
        stream = self._streams.get(peer)
        if stream is None:
            stream = self._streams[peer] = torch.cuda.Stream(self.device)
        return stream

    def receive(self, timeout: float) -> list[Arrival]:
        """The next message, read on the stage thread; [] after `timeout` seconds. Lost if a connection
        broke, Malformed (naming the sender) for a frame `wire.encode` did not write."""
        try:
            link, slot, posted = self._events.get(timeout=timeout)
        except queue.Empty:
            return []
        if link is None:  # a listener or the sender lost its connection: `slot` is the error, `posted` the peer
            raise Lost(posted, slot)
        if isinstance(posted, Exception) and not isinstance(posted, wire.Malformed):
            link.repost(slot)  # posting its NCCL receives failed (the groups were aborted)
            raise Lost(link.peer, posted)
        start = time.perf_counter()
        try:
            if isinstance(posted, Exception):
                raise posted
            header = wire.decode_header(link.views[slot])
            tensors = wire.tensors_in(link.views[slot], header.size, header) if header.inline else None
        except wire.Malformed as error:
            raise wire.Malformed(f"a message from rank {link.peer} over gloo cannot be read: {error}") from None
        finally:
            link.repost(slot)
        home = lands_on(header.kind, self.device)
        ready = None
        if posted is not None:  # its NCCL receives, posted by the listener when the header landed
            tensors, ready = posted
        elif tensors is None:
            tensors, ready = self._payload(link.peer, header, home)
        elif home.type == "cuda":
            tensors, ready = to_gpu(tensors, home)
        return [Arrival(link.peer, header, tensors, ready, start, time.perf_counter())]

    def _receive_payload(self, link: _Link, slot: int) -> Optional[tuple[list, list]]:
        """In its turn: if a message's payload follows over NCCL, post its receives (tensors of the
        announced shapes, and the works) from the neighbour's stream, which waits for nothing the
        stage queued; else None (the stage reads it from the frame, or over gloo). An error (a
        malformed header, an aborted group) is returned for the stage thread to raise."""
        edge = self.tensor_groups.get(link.peer)
        if edge is None:
            return None
        try:
            header = wire.decode_header(link.views[slot])
            if header.inline or header.kind not in PAYLOAD_KINDS:  # a large control message's payload: over gloo
                return None
            group, local_peer = edge
            # on the stage's GPU (a new thread's current device is cuda:0, where a stream would open a context)
            with torch.cuda.device(self.device), torch.cuda.stream(self._stream(link.peer)):
                tensors = wire.empty_tensors(header, self.device)
                works = [group.recv([as_bytes(t)], local_peer, 0) for t in tensors if t is not None]
        except Exception as error:
            return error
        return wire.marked(tensors, header), works

    def _in_turn(self, link: _Link, entry: list) -> None:
        """A landed activation's or gradient's turn came (on whichever thread took it)."""
        entry[1] = True
        self._release(link)

    def _release(self, link: _Link) -> None:
        """Hand the stage `link`'s landed frames whose turn came, in landing order (gloo pairs a
        neighbour's payloads with receives in order: none may overtake); NCCL receives post here."""
        with link.lock:
            while link.landed and link.landed[0][1]:
                slot = link.landed.popleft()[0]
                self._events.put((link, slot, self._receive_payload(link, slot)))

    def _payload(self, peer: int, header: wire.Header, home: torch.device) -> tuple[list, Optional[list]]:
        """Tensors that follow their frame over gloo, received into tensors of the announced shapes
        (copied to the stage's GPU, with the event to wait for, where it has one)."""
        tensors = wire.empty_tensors(header, torch.device("cpu"))
        what = (f"the payload of its {header.kind!r} message {header.micro} from stage {peer} "
                f"({header.payload_bytes} bytes over gloo)")
        try:  # the sender posts its payload with its header: it is on its way, or the sender is gone
            for t in tensors:
                if t is not None:
                    gloo_waited(self.wire.recv([t], peer, DATA_TAG), transfer_bound(header.payload_bytes), what)
        except Exception as error:  # Stalled past the bound, else the connection's own error
            raise Lost(peer, error) from None
        if home.type == "cuda":
            tensors, ready = to_gpu(tensors, home)
            return wire.marked(tensors, header), ready
        return wire.marked(tensors, header), None

    def clock_offset(self, remote: list[int]) -> float:
        """Seconds to subtract from this rank's perf_counter to read rank 0's (0 on rank 0's machine):
        the midpoint of the fastest of a few round trips with rank 0."""
        stamp = torch.zeros(1, dtype=torch.float64)
        if self.rank == 0:
            for peer in remote:
                for _ in range(CLOCK_ROUNDS):
                    self.wire.recv([stamp], peer, CLOCK_TAG).wait(gloo_timeout(setup_bound()))
                    self.wire.send([torch.tensor([time.perf_counter()], dtype=torch.float64)], peer,
                                   CLOCK_TAG).wait(gloo_timeout(setup_bound()))
            return 0.0
        if self.rank not in remote:
            return 0.0
        best, offset = float("inf"), 0.0
        for _ in range(CLOCK_ROUNDS):
            sent = time.perf_counter()
            self.wire.send([torch.tensor([sent], dtype=torch.float64)], 0, CLOCK_TAG).wait(gloo_timeout(setup_bound()))
            self.wire.recv([stamp], 0, CLOCK_TAG).wait(gloo_timeout(setup_bound()))
            back = time.perf_counter()
            if back - sent < best:
                best, offset = back - sent, (sent + back) / 2 - stamp.item()
        return offset

    # --- threads -------------------------------------------------------------------------------

    def _listen(self, link: _Link) -> None:
        """Listener thread: wait for the posted receives of one neighbour in order and signal each."""
        goodbyes = 0
        while True:
            link.posted.acquire()
            slot = link.order.popleft()
            try:
                link.works[slot].wait(NEVER)  # an idle pipe waits here: the lane's close or a lost peer ends it
            except Exception as error:
                self._fail(link.peer, error)
                return
            if struct.unpack_from("<q", link.views[slot], 16)[0] == wire.KINDS.index("bye"):
                goodbyes += 1
                if goodbyes == PREPOSTED:  # the neighbour closed: every posted receive is answered
                    return
                continue
            if self._closed:  # nobody reads any more: keep the slot posted for the goodbyes
                link.repost(slot)
                continue
            step, kind, micro, chunk = struct.unpack_from("<4q", link.views[slot], 8)  # the header's first words
            payload = 0 <= kind < len(wire.KINDS) and wire.KINDS[kind] in PAYLOAD_KINDS
            entry = [slot, not payload]  # control messages, and what cannot be read (the stage says so): no turn
            with link.lock:
                link.landed.append(entry)
            if payload:
                self.turns.offer(step, (wire.KINDS[kind], micro, chunk), "receive",
                                 functools.partial(self._in_turn, link, entry), link.peer)
            else:
                self._release(link)

    def _fail(self, peer: int, error: BaseException) -> None:
        """A listener or the sender lost `peer`: tell the stage thread (an event; `error` for NCCL polls)."""
        if not self._closed and not self._abandoned:
            self.error = (peer, error)
            self._events.put((None, error, peer))

    def _raise_if_abandoned(self) -> None:
        if self._abandoned:
            raise _Abandoned

    def _wake_sender(self) -> None:
        with self._reap:
            self._wakes += 1
            self._reap.notify()

    def _complete_sends(self) -> None:
        """Sender thread: when woken (once a call and every REAP_AFTER sends: a hand-over between
        threads costs tens of microseconds), complete the sends in flight and free their buffers."""
        seen = 0
        while True:
            with self._reap:
                self._reap.wait_for(lambda: self._wakes > seen)
                seen = self._wakes
            while self._in_flight:
                gloo, nccl, buffers, destination = self._in_flight[0]
                # the receiver may not have reached this call yet, as a header waits for it: a progress bound
                bound = progress_bound(wire.tensor_bytes(buffers))
                try:
                    for work in gloo:  # returns once gloo has sent the buffer (is_completed() would never say so)
                        gloo_waited(work, bound, f"a send to stage {destination} to be taken")
                    # NCCL's wait() returns at once, before the send is done; after a failure its
                    # sends may never complete: the groups are aborted and the buffers let go
                    until_completed(nccl, self._raise_if_abandoned, every=0.01, pause_cap=1e-3, within=bound,
                                    what=f"an NCCL send to stage {destination} to complete")
                    with torch.cuda.device(self.device) if nccl else contextlib.nullcontext():  # not cuda:0's stream
                        for work in nccl:
                            work.wait()
                except _Abandoned:
                    self._in_flight.clear()
                    return
                except Exception as error:
                    self._fail(destination, error)
                    return
                self._in_flight.popleft()
                del gloo, nccl, buffers
            if self._closed:
                return

    def close(self, step: int, timeout: float = 5.0) -> None:
        """Stop this rank's threads and destroy the lane's groups. Goodbyes answer the receives each
        neighbour keeps posted; this rank's listeners end with the neighbours' goodbyes."""
        self._closed = True
        frame, _ = wire.encode(step, "bye", 0, 0, wire.NO_DECISION, None)
        for link in self._links:
            try:
                for _ in range(PREPOSTED):
                    self._in_flight.append(([self.wire.send([frame], link.peer, HEADER_TAG)], [], [frame], link.peer))
            except Exception:
                pass  # that neighbour is gone: nothing waits on the connection any more
        while True:  # frames still unread: give their slots back to the listeners
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
            if event[0] is not None:
                event[0].repost(event[1])
        for link in self._links:  # and those waiting for a turn that will not come
            with link.lock:
                held = [slot for slot, _ in link.landed]
                link.landed.clear()
            for slot in held:
                link.repost(slot)
        self._wake_sender()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        for group in [self.wire, *([] if self._abandoned else [group for group, _ in self.tensor_groups.values()])]:
            try:
                dist.destroy_process_group(group)
            except Exception:  # the default group is already gone (the process is shutting down)
                pass


class _Abandoned(Exception):
    """The lane gave up its NCCL transfers (a call failed): the sender thread stops waiting."""


ABORT_SECONDS = 10.0  # the most a failed call waits for its NCCL groups' aborts


def abort_groups(groups: list, seconds: float = ABORT_SECONDS) -> None:
    """Abort process groups' pending work now (NCCL's abort ends kernels waiting for a peer), each
    group from a thread of its own, all at once: torch runs a communicator's abort on a thread of
    its own and waits for it up to the group's timeout, one abort may wait for the GPU where another
    communicator's kernel still waits for a peer (pytorch#119797), and NCCL's group calls, which
    torch uses against that, hold per thread. Returns within `seconds`; an abort still blocked then
    is left to its daemon thread, and the lane is given up either way."""
    threads = [threading.Thread(target=_abort, args=(group,), daemon=True, name="gpipe-abort") for group in groups]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + seconds
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))


def _abort(group) -> None:
    try:
        dist.distributed_c10d._abort_process_group(group)
    except Exception:
        try:
            group.abort()
            dist.destroy_process_group(group)
        except Exception:  # already gone
            pass


def wire_group(pipelines: list, members: list[int], rank: int):
    """This pipeline's gloo group (`own_group`), made with the set-up bound as its timeout: making it
    waits in the Store for every rank, holding this process's connection to the Store, so only the
    group's own timeout can end that wait. Every wait on its works passes a timeout of its own."""
    bound, since = setup_bound(), time.monotonic()
    try:
        return own_group(pipelines, members, backend="gloo", timeout=gloo_timeout(bound))
    except Exception as error:
        if time.monotonic() - since < bound:
            raise
        raise StageFailed(f"rank {rank}: making the gloo lane's groups did not finish within {bound:g} s; has a rank "
                          f"died or stopped? ({str(error).splitlines()[0][:200]})") from None


def own_group(pipelines: list, members: list[int], **options):
    """This pipeline's group; every rank makes every pipeline's, in one order, as torch.distributed requires."""
    mine = None
    for ranks in pipelines:
        group = dist.new_group(list(ranks), use_local_synchronization=False, **options)
        if list(ranks) == list(members):
            mine = group
    return mine


def lands_on(kind: str, device: torch.device) -> torch.device:
    """Where a message's tensors belong: activations and gradients on the stage's device, the rest on the host."""
    return device if kind in ("act", "grad") else torch.device("cpu")


def connect(edges: dict, rank: int, device: torch.device, check=lambda: None, lost=lambda: None,
            within: Optional[float] = None) -> None:
    """Connect every NCCL group with a neighbour (`edges`, as edge_groups gives them) now, one element
    each way, in one order for all ranks (by pair, the lower rank's send first): NCCL connects on first
    use, where a dead peer would block a stage out of an abort's reach. The probes are posted on a
    thread given up on (a group's first use makes its communicator, blocking, maybe holding this
    process's Store connection: only `lost`, which reads no Store, is called then); the host polls
    them, calling `check`. Probes not done within `within` seconds (the set-up bound), or a failed
    one, raise StageFailed naming the edges; however it ends early, the groups are aborted first."""
    if not edges:  # no NCCL on this lane
        return
    within = setup_bound() if within is None else within
    try:
        _connect(edges, rank, device, check, lost, within)
    except BaseException:  # whatever ended it (a failed probe, a peer's failure, the Store, NCCL, Ctrl-C)
        abort_groups([group for group, _ in edges.values()])
        raise


def _connect(edges: dict, rank: int, device: torch.device, check, lost, within: float) -> None:
    deadline = time.monotonic() + within
    ways = [(sender, receiver) for neighbour in sorted(edges, key=lambda n: (min(rank, n), max(rank, n)))
            for sender, receiver in ((min(rank, neighbour), max(rank, neighbour)),
                                     (max(rank, neighbour), min(rank, neighbour)))]

    def post() -> list:
        probes = []
        with torch.cuda.device(device):
            for sender, receiver in ways:
                group, local = edges[receiver if sender == rank else sender]
                way = group.send if sender == rank else group.recv
                probes.append(((sender, receiver), way([torch.zeros(1, device=device)], local, 0)))
        return probes
    probes = finished_within(within, f"rank {rank}: making the NCCL communicators with stages {sorted(edges)}",
                             post, lost)

    def give_up(why: str) -> StageFailed:
        return StageFailed(f"rank {rank}: NCCL edge(s) {why} while the pipe was built; "
                           f"has a peer died or stopped? (edges named (sending stage, receiving stage))")

    def late() -> None:
        check()
        if time.monotonic() > deadline:
            raise give_up(f"{[edge for edge, work in probes if not work.is_completed()]} not connected "
                          f"within {within:g} s")

    until_completed([work for _, work in probes], late, every=0.05, pause_cap=1e-2)
    failed = [(edge, work.exception()) for edge, work in probes if work.exception() is not None]
    if failed:
        raise give_up(f"{[edge for edge, _ in failed]} failed ({str(failed[0][1]).splitlines()[0][:200]})")


def neighbour_pairs(size: int, placement: tuple = ()) -> list[tuple[int, int]]:
    """The pairs of ranks (lower, higher) a pipe's payloads travel between, in one order for every rank:
    ranks holding consecutive chunks (`placement`: each chunk's rank; none given, one chunk each),
    with a loop placement's last -> first (interleaved) and a V's way back (ZB-V) among them."""
    hops = zip(placement, placement[1:]) if placement else ((r, r + 1) for r in range(size - 1))
    return list(dict.fromkeys((min(a, b), max(a, b)) for a, b in hops if a != b))


def edge_groups(pipelines: list, members: list[int], size: int, placement: tuple = ()) -> dict:
    """This rank's two-rank NCCL group with each neighbour it exchanges payloads with, {neighbour's rank
    in the pipeline: (group, its rank in the group)}; every rank makes every pipeline's, in one order."""
    me = dist.get_rank()
    mine = {}
    for ranks in pipelines:
        for a, b in neighbour_pairs(size, placement):
            pair = [ranks[a], ranks[b]]
            group = dist.new_group(pair, backend="nccl", timeout=NEVER, use_local_synchronization=False)
            if me in pair and list(ranks) == list(members):
                peer = pair[1] if pair[0] == me else pair[0]
                mine[b if pair[0] == me else a] = (group, sorted(pair).index(peer))
    return mine


def _nothing() -> None:
    """A gloo send's turn: it left with its header."""


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as bytes, the same storage: what an NCCL edge carries, whatever
    the dtype (NCCL has no int16, complex or bool type; a send or receive moves bytes unchanged)."""
    return tensor.reshape(-1).view(torch.uint8)


def to_gpu(tensors: list, home: torch.device) -> tuple[list, "torch.cuda.Event"]:
    """Host tensors copied to GPU `home` on its current stream, and the event to wait on before use."""
    moved = [None if t is None else t.to(home, non_blocking=True) for t in tensors]
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(home))
    return moved, ready


def _on_gpu(value, device: torch.device):
    """NCCL moves GPU memory: host tensors of a value are copied to `device` first (the receiving stage
    would move them to its own device anyway, as stage threads do)."""
    form, tensors = wire.describe(value)
    if all(t is None or t.is_cuda for t in tensors):
        return value
    return wire.rebuild_value(form, [t if t is None or t.is_cuda else t.to(device) for t in tensors])


def _on_cpu(value):
    """gloo moves host memory: CUDA tensors are copied to the host first."""
    form, tensors = wire.describe(value)
    if not any(t is not None and t.is_cuda for t in tensors):
        return value
    return wire.rebuild_value(form, [None if t is None else t.cpu() for t in tensors])
