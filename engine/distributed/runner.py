"""One rank's share of a pipelined call when stages are processes (GPipe(..., group=...)).

The first stage's rank decides the call (engine/call.py) and its decision travels with its
activations, so every rank plans the same call and runs its own task list in the threads' task
loop. The call ends in two waves: "end" goes upstream with the loss and each stage's trace, "done"
comes back, so a call returns only once every stage finished it, and a failure anywhere is raised
everywhere. Ranks send tensors and typed tables (wire.py), never pickle.
"""
from __future__ import annotations

import os
import struct
import time
from contextlib import contextmanager
from dataclasses import fields as fields_of
from typing import Optional

import torch
import torch.distributed as dist

from ..call import Call, Decision
from ..device import check_device, one_per_stage, resolve_devices
from ..runner import EventCallback, call_shape, events_of, live, name_place, run_tasks
from ..stages import LocalStages
from ..trace import Event, Message, Reduction, StageMemory, Trace
from .replicas import Replicas
from .transport import ProcessTransport, Ranks, StageFailed, check_group, nccl_in
from .wire import Malformed, pack_table, unpack_table


def rank_and_device(group, stages: int, devices, module) -> tuple[int, torch.device]:
    """This process's stage (its rank in `group`) and device (device.resolve_devices), where "cuda"
    means cuda:LOCAL_RANK (else the world rank) mod the GPUs, so replicas do not share the first's GPUs.
    A GPU becomes this process's current device: NCCL and the caller's own CUDA calls use it, not cuda:0."""
    ranks = check_group(group, stages)
    if str(devices) == "cuda" and torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank())) % torch.cuda.device_count()
        device = check_device(torch.device("cuda", local), ranks.rank)
    elif isinstance(devices, (list, tuple)):  # this rank's entry only: a rank may see only its own GPU
        device = check_device(one_per_stage(devices, stages)[ranks.rank], ranks.rank)
    else:
        device = resolve_devices(devices, stages, module)[ranks.rank]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return ranks.rank, device


class RankRunner:
    """Runs this rank's stage (its chunk, or chunks) for each call and exchanges what a call ends with."""

    def __init__(self, local: LocalStages, group, stages: int, placement: tuple, data_parallel=None):
        self.local = local
        self.ranks: Ranks = check_group(group, stages)
        rank = self.ranks.rank
        self.calls = 0
        self.origin = 0.0  # the current call's time origin, a perf_counter reading on rank 0's clock
        self.prefix = f"rank {rank}, "
        wraps = any(a == stages - 1 and b == 0 for a, b in zip(placement, placement[1:]))  # loop placement, v > 1
        self.relays = placement[-1] != stages - 1  # the loss is not on the last rank (a V): "done" brings it
        self.transport = ProcessTransport(
            self.ranks, group, next(iter(local.devices.values())).device,
            upstream=(rank - 1) % stages if rank > 0 or wraps else None,
            downstream=(rank + 1) % stages if rank < stages - 1 or wraps else None, placement=placement)
        try:
            self.replicas = None if data_parallel is None else Replicas(data_parallel, rank, self.transport.shared)
        except ValueError:
            self.transport.close()
            raise
        if self.replicas is not None:  # name the pipeline in failures: "replica 1, rank 3, stage 1"
            self.prefix = f"replica {self.replicas.index}, rank {dist.get_rank()}, "
            if nccl_in(data_parallel):
                self.transport.also_abort.append(data_parallel)

    @contextmanager
    def calling(self):
        """One call on this rank: a failure here is named and told to every rank; state is dropped after."""
        if self.replicas is not None:
            self.replicas.require_whole()
        self.transport.begin(self.calls)
        self.calls += 1
        try:
            yield
        except BaseException as error:
            if self.replicas is not None:  # its sums in flight will never match now
                self.replicas.abandon()
                self.transport.abandon()
            if not isinstance(error, StageFailed):
                if not str(error.args[0] if error.args else "").startswith(f"[{self.prefix}"):
                    name_place(error, self.ranks.rank, None, prefix=self.prefix)
                self.transport.report_failure(f"{type(error).__name__}: {error.args[0] if error.args else error}")
            raise
        finally:
            self.local.finish()

    def agree(self, decision: Optional[Decision]) -> Decision:
        """The first stage's decision, on every rank (it travels with the first activation)."""
        return self.transport.agree(decision)

    def run(self, call: Call, on_event: EventCallback = None, serial: bool = False):
        """Run this rank's tasks; return (the loss on every rank for a step, or the output on the last
        rank for a forward) and the trace of every stage on rank 0."""
        rank = self.ranks.rank
        t0 = self.local.start(call)  # after the decision arrived: waiting for it is not part of the call
        self.transport.plan(call.schedule)
        self.origin = t0 - self.transport.clock_offset
        marks = run_tasks(self.local, [(rank, task) for task in call.schedule[rank]], self.transport,
                          live(self.local, on_event), prefix=self.prefix)
        self.local.settle()  # the stage's gradients are written before the replicas sum them
        events = events_of(self.local, marks, on_event)
        total = call.decision.batch  # this pipeline's shard of the global batch, until the replicas sum it
        reducing = self.replicas is not None and call.training
        pending = self.replicas.start(self.local.parameters(), total) if reducing else None  # overlaps the drain
        result = self.local.conclude(call)
        if reducing and self.local.runs_last:
            result, total = self.replicas.global_loss(result, total, self.transport.check_failures)
        if reducing:
            self.replicas.finish(pending, self.transport.check_failures)
        memory, messages = self.local.memory(rank), self.transport.messages()  # now: both change with the next call
        reductions = [] if pending is None else [(rank, pending.start - t0, pending.end - t0, pending.nbytes)]
        piece = lambda: self._piece(events(), t0, memory, messages, reductions)
        sent = None if self.ranks.is_first else piece()  # the first stage's is made only if its trace is read
        loss, total, later = self._end_waves(result if call.training else None, total, sent)
        if reducing:
            self.replicas.assign(pending, total)
        wall, shape = time.perf_counter() - t0, call_shape(call)  # not the call: it holds the inputs

        def trace() -> Trace:  # built when read: a step nobody looks at does not pay for it
            return self._trace([sent or piece()] + self._later_pieces(later), shape, wall)
        if call.training:
            return loss.to(self.local.devices[rank].device), trace
        return result, trace

    def side_call(self) -> ProcessTransport:
        """The transport, in a call of its own for traffic outside the steps (the benchmark's ping-pong)."""
        self.transport.begin(self.calls)
        self.transport.plan(None)
        self.calls += 1
        return self.transport

    def close(self) -> None:
        """End the transport's threads and groups (every rank calls it)."""
        self.transport.close()

    def _piece(self, events: list[Event], t0: float, memory: StageMemory, messages: list[tuple],
               reductions: list[tuple]) -> tuple:
        """This stage's part of the trace in plain tuples, times from its start (given on rank 0's clock)."""
        messages = [(*m[:6], m[6] - t0, m[7] - t0) for m in messages]
        rows = [tuple(vars(record).values()) for record in (*events, memory)]  # astuple deep-copies: 10 us a record
        return (t0 - self.transport.clock_offset, rows[:-1], messages, rows[-1], reductions)

    def _end_waves(self, loss: Optional[torch.Tensor], total: int,
                   piece: Optional[tuple]) -> tuple[Optional[torch.Tensor], int, bytes]:
        """"end" upstream with the loss, the global batch's size and the trace pieces (this stage's
        `piece`, none from the first), then "done" back; returns the later stages' pieces as they came."""
        ranks, transport = self.ranks, self.transport
        later = b""
        if not ranks.is_last:  # the loss comes up from the last chunk's rank (ZB-V's V puts it on rank 0)
            theirs, their_total, later = self._read_end(transport.receive_control("end"), ranks.rank + 1)
            loss, total = (theirs, their_total) if loss is None else (loss, total)
        if not ranks.is_first:  # the later stages' pieces travel on as they came
            transport.send_control(ranks.rank - 1, "end",
                                   _bytes(encode_end(loss, total) + encode_pieces([piece]) + later))
            done = transport.receive_control("done")
            loss, total = self._read_end(done, ranks.rank - 1)[:2] if self.relays else (loss, total)
        if not ranks.is_last:
            transport.send_control(ranks.rank + 1, "done", _bytes(encode_end(loss, total)) if self.relays else None)
            if self.relays:  # a second "end": the next rank read what "done" carried, so this one may close its lane
                transport.receive_control("end", micro=1)
        if self.relays and not ranks.is_first:
            transport.send_control(ranks.rank - 1, "end", micro=1)
        return loss, total, later

    def _read_end(self, value, peer: int) -> tuple[Optional[torch.Tensor], int, bytes]:
        """The next stage's "end" (or the previous one's "done"): loss (None in a forward), global batch
        size and the trace pieces' bytes (read with the trace); Malformed, naming the sender, if the
        rest is anything else."""
        kind = "end" if peer > self.ranks.rank else "done"
        try:
            if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
                raise Malformed(f"expected (loss, batch size, trace) as bytes, got {_shape_of(value)}")
            data = value.numpy().tobytes()
            loss, size, offset = decode_end(data)
            return loss, size, data[offset:]
        except Malformed as error:
            raise Malformed(f"the {kind!r} message from stage {peer} is malformed: {error}") from None

    def _later_pieces(self, data: bytes) -> list:
        """The later stages' trace pieces, decoded when the trace is read (a step whose trace nobody
        reads does not pay for them; what the call returned was checked in it); Malformed, naming
        the stage that sent them, if they are anything else."""
        peer = self.ranks.rank + 1
        try:
            return decode_pieces(data, self.ranks.size - peer)
        except Malformed as error:
            raise Malformed(f"the trace pieces from stage {peer} are malformed: {error}") from None

    def _trace(self, pieces: list, shape: dict, wall: float) -> Trace:
        """One trace of the stages this rank heard from (all of them on rank 0), on its time base."""
        origin = pieces[0][0]
        events, messages, memory, reductions = [], [], [], []
        for start, stage_events, stage_messages, stage_memory, stage_reductions in pieces:
            shift = start - origin
            events += [Event(s, m, op, a + shift, b + shift, *rest) for s, m, op, a, b, *rest in stage_events]
            messages += [Message(*fields[:6], fields[6] + shift, fields[7] + shift) for fields in stage_messages]
            memory.append(StageMemory(*stage_memory))
            reductions += [Reduction(s, a + shift, b + shift, n) for s, a, b, n in stage_reductions]
        events.sort(key=lambda e: (e.start, e.stage))
        return Trace(stages=self.ranks.size, **shape, events=events,
                     memory=sorted(memory, key=lambda m: m.stage), wall=wall,
                     messages=sorted(messages, key=lambda m: m.start), transport="processes",
                     lane=self.transport.lane.name, reductions=sorted(reductions, key=lambda r: r.stage),
                     replicas=1 if self.replicas is None else self.replicas.size)


def _shape_of(value) -> str:
    """What a received value is, in a few words (a tensor and its dtype and shape, a tuple, or None)."""
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}"
    return "a tuple" if isinstance(value, tuple) else "None"


def _bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _schema(cls) -> str:
    """The fields of one of the trace's records as a table's schema (wire.pack_table)."""
    return "".join({"int": "i", "float": "f", "str": "s", "Optional[int]": "n"}[f.type] for f in fields_of(cls))


PIECE = ("f", _schema(Event), _schema(Message), _schema(StageMemory), _schema(Reduction))  # start; tables
END = struct.Struct("<qdqq")  # whether a loss came, its value, its dtype (in LOSS_DTYPES), the global batch's size
LOSS_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)  # each exact as a float64


def encode_end(loss: Optional[torch.Tensor], total: int) -> bytes:
    """What an "end" or "done" message says before its trace pieces, as one fixed row (END, cheap to read on
    the call's critical path): the loss (exactly, as a float64) and the global batch's size."""
    if loss is not None and loss.dtype not in LOSS_DTYPES:
        raise TypeError(f"the loss is a {loss.dtype} tensor; stages as processes pass on a loss of "
                        f"{', '.join(map(str, LOSS_DTYPES))}")
    return END.pack(0, 0.0, 0, total) if loss is None \
        else END.pack(1, loss.item(), LOSS_DTYPES.index(loss.dtype), total)


def decode_end(data: bytes) -> tuple[Optional[torch.Tensor], int, int]:
    """(loss or None, batch size, offset of the trace pieces) of an "end" or "done" message; Malformed if
    it says anything else."""
    if len(data) < END.size:
        raise Malformed(f"{len(data)} bytes where the loss and batch size take {END.size}")
    has_loss, value, dtype, size = END.unpack_from(data)
    if has_loss not in (0, 1) or not 0 <= dtype < len(LOSS_DTYPES) or size < 0:
        raise Malformed(f"a row that says loss {has_loss}, dtype {dtype}, batch {size}; expected 0 or 1, "
                        f"0 to {len(LOSS_DTYPES) - 1}, and a batch of 0 or more")
    return (torch.tensor(value, dtype=LOSS_DTYPES[dtype]) if has_loss else None), size, END.size


def encode_pieces(pieces: list) -> bytes:
    """Trace pieces (RankRunner._piece) as the wire's typed tables, one after another."""
    return b"".join(pack_table(schema, rows) for start, events, messages, memory, reductions in pieces
                    for schema, rows in zip(PIECE, ([(start,)], events, messages, [memory], reductions)))


def decode_pieces(data: bytes, count: int) -> list:
    """The `count` trace pieces `encode_pieces` laid out in `data`; Malformed if it holds anything else."""
    pieces, offset = [], 0
    for _ in range(count):
        tables = []
        for schema in PIECE:
            rows, offset = unpack_table(schema, data, offset)
            tables.append(rows)
        start, events, messages, memory, reductions = tables
        if len(start) != 1 or len(memory) != 1:
            raise Malformed(f"a trace piece with {len(start)} starts and {len(memory)} memory records")
        pieces.append((start[0][0], events, messages, memory[0], reductions))
    if offset != len(data):
        raise Malformed(f"{len(data) - offset} bytes after {count} trace pieces")
    return pieces
