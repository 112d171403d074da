"""Stages as processes: how rank i of a group exchanges activations and gradients with its neighbours.

`ProcessTransport` offers the task loop the thread transport's `receive` / `send` / `check`, over a
`Lane`: shared memory (shm_lane.py) when every rank is on this host and on a CPU, else gloo with
NCCL for payloads between GPUs (gloo_lane.py; `GPIPE_LANE=gloo` asks for it on one host). The
stage thread files whatever arrives under its key, so any schedule's order works.

Failures never leave a rank waiting: a failing rank writes a note to the group's Store, which a
waiting rank reads every POLL_SECONDS; a rank that dies closes its connections, and the neighbour
that sees it tells the Store. Every wait has a bound (works.py; docs/processes.md lists them): a
transfer's payload that never lands is reported, with what every rank waits for, and the call ends.
"""
from __future__ import annotations

import collections
import itertools
import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import NamedTuple, Optional, Protocol

import torch
import torch.distributed as dist

from ..call import Decision
from ..microbatch import Value
from ..transport import StageFailed
from . import shm_lane, wire
from .gloo_lane import GlooLane
from .turns import transfer_order
from .wire import Lost
from .works import (
    Stalled,
    finished_within,
    in_seconds,
    keys_within,
    progress_bound,
    setup_bound,
    until_completed,
    wait_bound,
)

POLL_SECONDS = 0.05                            # how often a waiting rank looks for failures elsewhere
STUCK_SECONDS = 2.0                            # a wait this long is posted; when every rank's is, a deadlock
_ABSENT = "-"                                  # what a non-blocking read of the Store gives for a missing key
NOTE_CHARS = 2000                              # the longest failure note a rank posts or reads (text only)
NOTE_SECONDS = 5.0                             # the most a rank whose pipe could not be made spends posting why
LANES = ("auto", "shm", "gloo")
_serials = itertools.count()                   # pipes made in this process: the same order on every rank


class Lane(Protocol):
    """How messages move between this rank and its neighbouring stages (shm_lane.ShmLane, gloo_lane.GlooLane)."""

    name: str                                   # what the trace says: "shared memory", "gloo" or "gloo+nccl"
    error: Optional[tuple]                      # (peer, error) a background thread met, else None

    def begin(self) -> None: ...                # a new call starts
    def expect(self, step: int, order) -> None: ...  # call `step` posts its transfers in `order` (turns.py; None:
                                                # as they come)
    def held(self, step: int) -> dict: ...      # {peer: messages of call `step` that landed, waiting for a turn}
    def post(self, destination: int, step: int, kind: str, micro: int, chunk: int, decision, value) -> None: ...
    def receive(self, timeout: float) -> list: ...  # what arrived (wire.Arrival), [] after `timeout` seconds
    def abandon(self, also: list) -> None: ...  # the call failed: let go of transfers a failed peer will not
                                                # match (abort its NCCL groups, with `also`, in one call)
    def close(self, step: int) -> None: ...     # end threads, files and groups (every rank calls it)
    # clock_offset(remote ranks) -> seconds: only lanes that may reach other hosts (gloo)


class Ranks(NamedTuple):
    """Where this process sits: its rank in the pipeline's group (which is its stage) and the size."""

    rank: int
    size: int

    is_first = property(lambda self: self.rank == 0)
    is_last = property(lambda self: self.rank == self.size - 1)


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
    return Ranks(rank, size)


def _clock_id() -> str:
    """Names this machine's clock: perf_counter (CLOCK_MONOTONIC) is shared by its processes."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{f.read().strip()}@{socket.gethostname()}"
    except OSError:
        return f"process {os.getpid()}@{socket.gethostname()}"  # unknown: measure the offset


@dataclass(frozen=True)
class World:
    """What every rank told the others when its pipe was made (the n-th pipe of every rank meets
    here: torch.distributed makes groups in one order on all ranks)."""

    store: object                   # the Store under this pipe's prefix, shared by the whole world
    pipelines: list[list[int]]      # the ranks of each pipeline, in one order for every rank
    clocks: dict[int, str]          # global rank -> its machine's clock
    device_types: list[str]
    gpus: list[str]                 # per global rank: its GPU's identity, "" on a CPU
    nccl: list[bool]                # per global rank: its group has NCCL for CUDA tensors

    @property
    def one_host(self) -> bool:
        return len(set(self.clocks.values())) == 1

    @classmethod
    def gather(cls, members: list[int], device: torch.device, group) -> "World":
        store = dist.PrefixStore(f"gpipe-lab/{next(_serials)}/", dist.distributed_c10d._get_default_store())
        store.set(f"rank/{dist.get_rank()}",
                  json.dumps([members, _clock_id(), device.type, gpu_identity(device), nccl_in(group)]))
        keys = [f"rank/{r}" for r in range(dist.get_world_size())]
        keys_within(store, keys, setup_bound(), f"rank {dist.get_rank()}: the ranks' meeting to make a pipe",
                    lambda: told(store, "broken"))
        said = [json.loads(store.get(key)) for key in keys]
        return cls(store, sorted({tuple(t[0]) for t in said}), {r: t[1] for r, t in enumerate(said)},
                   [t[2] for t in said], [t[3] for t in said], [t[4] for t in said])


def told(store, *keys: str) -> None:
    """Raise StageFailed with the note a rank left in `store` under any of `keys`."""
    for key in keys:
        if store.check([key]):
            raise StageFailed(store.get(key)[:4 * NOTE_CHARS].decode(errors="replace")[:NOTE_CHARS])


def use_nccl(device_types: list[str], nccl: list[bool], gpus: list[str]) -> bool:
    """Whether payloads go over NCCL: every rank on a GPU, NCCL in every group, no GPU shared."""
    return set(device_types) == {"cuda"} and all(nccl) and one_gpu_each(gpus)


def one_gpu_each(gpus: list[str]) -> bool:
    """Whether no two ranks share a physical GPU (by `gpu_identity`): NCCL refuses that."""
    return len(set(gpus)) == len(gpus)


def nccl_in(group) -> bool:
    """Whether `group` moves CUDA tensors over NCCL: its backend is "nccl", or its configuration
    ("cpu:gloo,cuda:nccl"; init_process_group() without a backend says "undefined") names it."""
    backend = str(dist.get_backend(group)).lower()
    if backend == "nccl":
        return True
    try:
        config = str(dist.get_backend_config(group)).lower()
    except (AttributeError, RuntimeError, ValueError):
        return False
    return config == "nccl" or "cuda:nccl" in config.replace(" ", "").split(",")


def gpu_identity(device: torch.device) -> str:
    """Which physical GPU `device` is, whatever CUDA_VISIBLE_DEVICES numbers it ("" for a CPU): its
    UUID, else this machine and the GPU's PCI location."""
    if device.type != "cuda":
        return ""
    properties = torch.cuda.get_device_properties(device)
    uuid_ = getattr(properties, "uuid", None)
    if uuid_ is not None:
        return str(uuid_)
    return f"{_clock_id()}/{getattr(properties, 'pci_domain_id', 0)}:{getattr(properties, 'pci_bus_id', 0)}:" \
           f"{getattr(properties, 'pci_device_id', device.index)}"


class ProcessTransport:
    """This rank's connections to its neighbouring stages (see the module docstring)."""

    lane: Optional[Lane] = None  # until the lane is made (a failure told meanwhile has nothing to let go of)

    def __init__(self, ranks: Ranks, group, device: torch.device, upstream: Optional[int], downstream: Optional[int],
                 placement: tuple = ()):
        self.ranks, self.device, self.upstream, self.placement = ranks, device, upstream, placement
        members = dist.get_process_group_ranks(group)
        world = World.gather(members, device, group)
        self.shared = world.store  # failures are told world-wide: replicas of a stage stop together
        self.step = -1             # no call yet: a failure told while the lane is made is read as the pipe's
        self.store = dist.PrefixStore(f"{'-'.join(map(str, members))}/", world.store)
        clocks = [world.clocks[member] for member in members]
        peers = sorted({p for p in (upstream, downstream) if p is not None and p != ranks.rank})
        try:
            self.lane = self._open_lane(world, members, peers)
        except BaseException as error:  # told, so that the other ranks building the pipe stop too
            note = str(error) if isinstance(error, StageFailed) \
                else f"rank {ranks.rank}: {type(error).__name__}: {error}"
            try:  # a set-up thread given up on may still hold this process's connection to the Store
                finished_within(NOTE_SECONDS, "posting the failure",
                                lambda: self.shared.set("broken", note[:NOTE_CHARS]))
            except Exception:  # the Store itself failed: the peers see that on their own
                pass
            raise
        remote = [r for r in range(1, ranks.size) if clocks[r] != clocks[0]]
        self.clock_offset = self.lane.clock_offset(remote) if remote else 0.0
        self.decision: Optional[Decision] = None
        self._arrived: dict = {}                     # (step, kind, micro, chunk) -> (value, NCCL works or None, sender)
        self._decided = -1                           # the last call whose decision arrived
        self._failure: Optional[StageFailed] = None  # a lost connection: every later wait raises it
        self._log: list[tuple] = []                  # (step, *fields of a trace.Message), perf_counter times
        self._traffic: collections.Counter = collections.Counter()  # (step, "sent" | "received", peer) -> messages
        self._closed = False
        self._order: tuple = (None, [])              # (a schedule, its transfer_order): plans repeat call after call
        self.also_abort: list = []  # this rank's other NCCL groups (its replicas' sums): aborted with the lane's

    def _open_lane(self, world: "World", members: list[int], peers: list[int]) -> Lane:
        """Shared memory for one host of CPUs (unless GPIPE_LANE says gloo), else gloo (and NCCL).
        Every rank decides alike from the Store: gloo's and NCCL's groups are made by all together."""
        asked = os.environ.get("GPIPE_LANE", "auto")
        if asked not in LANES:
            raise ValueError(f"GPIPE_LANE={asked!r}: expected one of {LANES}")
        on_cpus = set(world.device_types) == {"cpu"}
        if asked != "gloo" and world.one_host and on_cpus and shm_lane.available():
            if self.ranks.rank == 0:  # a ProcessPool names its children's files, to sweep what they leave
                self.store.set("shm/prefix", f"{os.environ.get('GPIPE_SHM_PREFIX', 'gpipe')}-{uuid.uuid4().hex[:12]}-")
            keys_within(self.store, ["shm/prefix"], setup_bound(), f"rank {self.ranks.rank}: the shared-memory "
                        "lane's name", lambda: self._told("broken"))
            prefix = self.store.get("shm/prefix").decode()
            return shm_lane.ShmLane(self.ranks.rank, peers, self.store, f"{shm_lane.SHM}/{prefix}",
                                    on_stall=self.check_failures, spin=shm_lane.spin_for(len(world.clocks)))
        if asked == "shm":
            raise ValueError("GPIPE_LANE=shm but the ranks are not all on this host, or the stages are on GPUs")
        return GlooLane(self.ranks.rank, world.pipelines, members, peers, self.device,
                        nccl=use_nccl(world.device_types, world.nccl, world.gpus), placement=self.placement,
                        check=lambda: self._told("broken"))

    # --- one call ---------------------------------------------------------------------------

    def begin(self, step: int) -> None:
        """Start call `step`."""
        self.step, self.decision = step, None
        self._arrived = {key: value for key, value in self._arrived.items() if key[0] >= step}
        self._log = [entry for entry in self._log if entry[0] >= step]
        self._traffic = collections.Counter({key: n for key, n in self._traffic.items() if key[0] >= step})
        self.lane.begin()

    def plan(self, schedule: Optional[list]) -> None:
        """The current call runs `schedule`: the lane posts its transfers in the call's one order
        (turns.py), computed once per schedule (None: a call of side traffic, posted as it comes)."""
        if schedule is not None and self._order[0] is not schedule:
            self._order = (schedule, transfer_order(schedule, self.placement))
        self.lane.expect(self.step, None if schedule is None else self._order[1])

    def agree(self, decision: Optional[Decision]) -> Decision:
        """The call's decision: the first stage's own, elsewhere what the previous stage sent ahead ("call":
        this one prepares while that one runs, 0.15 ms on the small model) or its first activation brought."""
        self.decision = decision if decision is not None else self._get((self.step, "decision", 0, 0))
        if self.ranks.rank + 1 < self.ranks.size:
            self._post(self.ranks.rank + 1, "call", 0, 0, None)
        return self.decision

    def receive(self, stage: int, key):
        """What a neighbour sent for the current call under `key`: (value, NCCL works or None), once
        NCCL delivered it (the host waits, looking for failures: a stream waiting on a lost peer could not)."""
        value, ready, sender = self._get((self.step, *key))  # NCCL works, or a host copy's CUDA event
        if isinstance(ready, list):                              # (the stage waits on the event)
            self._landed(ready, sender, (self.step, *key), value)
        return value, ready

    def send(self, source: int, destination: int, key, value: Value) -> None:
        """Send `value` under `key` to the rank that holds chunk `destination` (filed here if it is this one)."""
        kind, micro, chunk = key
        rank = self.placement[destination]
        if rank == self.ranks.rank:
            self._arrived[(self.step, kind, micro, chunk)] = (value, None, rank)
            return
        self._post(rank, kind, micro, chunk, value)

    def send_control(self, destination: int, kind: str, value=None, micro: int = 0) -> None:
        """Send rank `destination` the call's "end" or "done" (or, for a ping-pong, any kind numbered `micro`)."""
        self._post(destination, kind, micro, 0, value)

    def receive_control(self, kind: str, micro: int = 0):
        """The value of the current call's message of `kind` (numbered `micro`), once it has landed: an
        NCCL payload's transfer done, a host copy's event passed (a ping-pong times the whole trip)."""
        value, ready, sender = self._get((self.step, kind, micro, 0))
        if isinstance(ready, list):
            self._landed(ready, sender, (self.step, kind, micro, 0), value)
        elif ready is not None:
            ready.synchronize()
        return value

    def _landed(self, works: list, sender: int, key, value) -> None:
        """Return once the NCCL receives `works` of `value` (under `key`) from rank `sender` are done,
        looking for failures meanwhile; a wait past STUCK_SECONDS is posted as a payload pending, and
        past its transfer bound the call fails here. StageFailed naming the sender if one ended in an
        error (a completed work may have failed: wait() would not say so on the host)."""
        since, posted = time.monotonic(), None

        def waiting() -> None:
            nonlocal posted
            self._check_receiving()
            waited = time.monotonic() - since
            if waited > STUCK_SECONDS:
                posted = self._stuck(key, posted, pending=sender)
                nbytes = wire.tensor_bytes(wire.describe(value)[1])
                if waited > progress_bound(nbytes):  # its send is posted in the sender's turn
                    self._stalled(key, waited, f"the payload of {self._wanted(key)} ({nbytes} bytes on the edge "
                                               f"({key[1]!r}, {sender}, {self.ranks.rank}), bound "
                                               f"{in_seconds(progress_bound(nbytes))})")
        until_completed(works, waiting, every=POLL_SECONDS)
        if posted is not None:
            self.store.delete_key(f"waits/{self.step}/{self.ranks.rank}")
        for work in works:
            if work.exception() is not None:
                self._failure = self._lost(sender, work.exception())
                raise self._failure

    def _stalled(self, key, waited: float, what: str) -> None:
        """A wait for `key` (`what` it waits for, and its bound) outlasted its bound: fail the call on
        every rank, saying what waited here and what each other rank posted it waits for."""
        others = [self.store.compare_set(f"waits/{key[0]}/{rank}", _ABSENT, _ABSENT).decode()
                  for rank in range(self.ranks.size) if rank != self.ranks.rank]
        meanwhile = "; ".join(note.split("\n", 1)[1] for note in others if note != _ABSENT) or "nothing posted"
        note = f"stalled: stage {self.ranks.rank} waited {in_seconds(waited)} for {what}; the others wait: {meanwhile}"
        self.report_failure(note)
        self._failure = StageFailed(note)
        try:  # where another rank's wait ended the call first, its note is the call's, on every rank
            self._told(f"failed/{key[0]}")
        except StageFailed as first:
            self._failure = first
        raise self._failure

    def check(self) -> None:
        """Raise StageFailed if a connection was lost (failures elsewhere are seen while waiting)."""
        if self._failure is not None:
            raise self._failure

    def messages(self) -> list[tuple]:
        """The current call's activation and gradient messages as this rank sent and read them: the
        fields of a trace.Message, times as perf_counter readings."""
        return [entry[1:] for entry in list(self._log) if entry[0] == self.step]

    # --- failures ------------------------------------------------------------------------------

    def abandon(self) -> None:
        """The call failed: the lane lets go of its transfers, aborting its NCCL groups and the rank's
        others (`also_abort`) in one call (once: later calls do nothing)."""
        if self.lane is not None:
            self.lane.abandon(self.also_abort)

    def report_failure(self, description: str) -> None:
        """Tell every rank, in a note of plain text, that the current call failed here (the first note stays)."""
        self.abandon()
        try:
            self.shared.compare_set(f"failed/{self.step}", "", description[:NOTE_CHARS])
        except Exception:  # the store is gone too: every rank will notice that by itself
            pass

    def check_failures(self) -> None:
        """Raise StageFailed if a rank reported a failure of the current call, or a rank was lost."""
        try:
            self._told("broken", f"failed/{self.step}")
        except StageFailed:
            self.abandon()
            raise
        except Exception as error:
            self.abandon()
            raise StageFailed(f"rank {self.ranks.rank} lost the pipeline's store, the side channel every rank "
                              f"shares (it lives with the launcher or the process that made it): {error}") from None

    def _told(self, *keys: str) -> None:
        """Raise StageFailed with the note a rank left in the shared store under any of `keys`."""
        told(self.shared, *keys)

    def _check_receiving(self) -> None:
        """While the host waits for an NCCL receive: a connection the lane lost, or a failure told in the store."""
        if self.lane.error is not None:
            self._failure = self._lost(*self.lane.error)
            raise self._failure
        self.check_failures()

    def _lost(self, peer: int, error: BaseException) -> StageFailed:
        """The connection to `peer` broke: give up and tell the store, unless a reported failure explains it."""
        self.abandon()
        try:
            self.check_failures()
        except StageFailed as reported:
            return reported
        description = f"stalled: stage {self.ranks.rank} {error}" if isinstance(error, Stalled) else \
            (f"[rank {peer}, stage {peer}] unreachable: rank {self.ranks.rank} lost its connection to "
             f"it ({str(error).splitlines()[0][:200]}); its process has probably died")
        try:
            self.shared.set("broken", description)
        except Exception:
            pass
        return StageFailed(description)

    # --- the stage thread's side ---------------------------------------------------------------

    def _get(self, key):
        """Read what arrives, in order, until the value filed under `key` is there."""
        since, posted = time.monotonic(), None
        while key not in self._arrived:
            if self._failure is not None:
                raise self._failure
            try:
                arrivals = self.lane.receive(POLL_SECONDS)
            except Lost as lost:
                self._failure = self._lost(lost.peer, lost.error)
                raise self._failure from None
            if not arrivals:
                self.check_failures()
                waited = time.monotonic() - since
                if waited > STUCK_SECONDS:
                    posted = self._stuck(key, posted)
                    if waited > wait_bound():
                        self._stalled(key, waited, f"{self._wanted(key)} (bound {in_seconds(wait_bound())}, "
                                                   "GPIPE_WAIT_SECONDS)")
            for arrival in arrivals:
                self._file(arrival)
        if posted is not None:
            self.store.delete_key(f"waits/{self.step}/{self.ranks.rank}")
        return self._arrived.pop(key)

    def _wanted(self, key) -> str:
        """What the task waiting for `key` needs, in words: "F3 from stage 0", or "its 'end' message"."""
        step, kind, micro, chunk = key
        if kind not in ("act", "grad"):
            return f"its {kind!r} message"
        return f"{'FB'[kind == 'grad']}{micro} from stage {self.placement[chunk + (kind == 'grad') - (kind == 'act')]}"

    def _stuck(self, key, posted: Optional[str], pending: Optional[int] = None) -> str:
        """Post that this rank has waited STUCK_SECONDS for `key` (its header, or, with `pending` the
        sending rank, its payload still to land), with the messages it has sent to and read from each rank in this call
        (again whenever those change). When every rank waits for a header and every message sent was
        read (none is still on its way, as a large payload on a slow link can be for seconds), none
        can send what another waits for: a deadlock; fail the call, naming each rank's wait (a pending
        payload has its transfer bound instead). Returns what this rank posted."""
        step, held = key[0], self.lane.held(key[0])  # a message waiting for its turn here has been read
        peers = range(self.ranks.size)
        counts = [[self._traffic[(step, "sent", peer)] for peer in peers],
                  [self._traffic[(step, "received", peer)] + held.get(peer, 0) for peer in peers]]
        what = self._wanted(key) if pending is None else \
            f"the payload of {self._wanted(key)} on the edge ({key[1]!r}, {pending}, {self.ranks.rank})"
        note = f"{json.dumps([*counts, pending is not None])}\nstage {self.ranks.rank} waits for {what}"
        if note == posted:
            return note
        self.store.set(f"waits/{step}/{self.ranks.rank}", note)
        notes = [self.store.compare_set(f"waits/{step}/{rank}", _ABSENT, _ABSENT).decode() for rank in peers]
        if _ABSENT not in notes:  # every rank waits (a read that does not block: a wait may end meanwhile)
            said = [(json.loads(n.split("\n", 1)[0]), n.split("\n", 1)[1]) for n in notes]
            if not any(counts[2] for counts, _ in said) and \
                    all(said[a][0][0][b] == said[b][0][1][a] for a in peers for b in peers):
                self.report_failure("deadlock: " + "; ".join(wait for _, wait in said))
        return note

    def _file(self, arrival: wire.Arrival) -> None:
        header = arrival.header
        if header.kind in ("call", "act") and arrival.peer == self.upstream and header.step > self._decided:
            self._decided = header.step  # the call's decision, sent ahead or with its first activation
            self._arrived[(header.step, "decision", 0, 0)] = header.decision
        self._traffic[(header.step, "received", arrival.peer)] += 1
        if header.kind in ("act", "grad"):
            self._log.append((header.step, self.ranks.rank, arrival.peer, "receive", header.kind, header.micro,
                              header.payload_bytes, arrival.start, arrival.end))
        self._arrived[(header.step, header.kind, header.micro, header.chunk)] = \
            (wire.rebuild_value(header.form, arrival.tensors), arrival.ready, arrival.peer)

    def _post(self, destination: int, kind: str, micro: int, chunk: int, value) -> None:
        start = time.perf_counter()
        try:
            self.lane.post(destination, self.step, kind, micro, chunk, self.decision or wire.NO_DECISION, value)
        except Lost as lost:
            self._failure = self._lost(lost.peer, lost.error)
            raise self._failure from None
        self._traffic[(self.step, "sent", destination)] += 1
        if kind in ("act", "grad"):
            self._log.append((self.step, self.ranks.rank, destination, "send", kind, micro,
                              wire.tensor_bytes(wire.describe(value)[1]), start, time.perf_counter()))

    def close(self) -> None:
        """Close the lane: its threads, groups or shared memory (every rank calls it)."""
        if not self._closed:
            self._closed = True
            self.lane.close(self.step)
