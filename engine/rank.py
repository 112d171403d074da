"""One rank's share of a pipelined call when stages are processes (GPipe(..., group=...)).

Every rank calls `step` (or the forward pass) with the same arguments' shapes; the first stage's rank
reads the inputs, cuts the micro-batches and decides the call's plan (micro-batch count, batch size,
base seed), which travels in the header of its activations; the last stage's rank reads the targets.
Each rank runs its stage's task list with the same worker code as the threads. Then the call ends
in two waves: "end" goes upstream from the last stage, carrying the mini-batch loss and each stage's
part of the trace, and "done" comes back downstream, so a call returns on a rank only once every
stage has finished it, and a failure anywhere is raised everywhere.
"""
from __future__ import annotations

import pickle
import time
from dataclasses import astuple
from typing import Callable, Optional

import torch

from . import wire
from .distributed import ProcessTransport, Ranks, StageFailed
from .microbatch import check_inputs, check_targets, gather, scatter
from .schedule import checkpointed, splits_backward
from .stage import Stage, StepPlan
from .trace import Event, Message, StageMemory, Trace
from .worker import name_place, run_stage


class RankRunner:
    """Runs this rank's stage (its chunk, or chunks) for each call and exchanges what a call ends with."""

    def __init__(self, ranks: Ranks, chunks: dict[int, Stage], transport: ProcessTransport):
        self.ranks, self.chunks, self.transport = ranks, chunks, transport
        self.calls = 0

    def call(self, kind: str, inputs, targets, loss_fn: Optional[Callable], chunks: int, checkpoint: str,
             task_lists: Callable[[int], list], base_seed: Callable[[], int], record_memory: bool,
             start: Callable, memory_of: Callable, on_event=None) -> tuple[object, Trace]:
        """Run one call ("step" or "forward") on this rank. Returns (the loss on every rank for a
        step; the output on the last stage's rank for a forward, None elsewhere) and the trace.
        `task_lists(M)` gives every stage's tasks; `start(plan, t0)` prepares this rank's chunks."""
        ranks, transport = self.ranks, self.transport
        stage = self.chunks[ranks.rank]
        training = kind == "step"
        transport.begin(self.calls, None)
        self.calls += 1
        t0 = time.perf_counter()
        try:
            if training and not callable(loss_fn):
                raise TypeError(f"loss_fn must be callable, got {loss_fn!r}")
            if training and ranks.is_last and targets is None:
                raise ValueError(f"targets are missing on rank {ranks.rank}, which runs the last stage: pass the "
                                 f"mini-batch's targets there (other ranks may pass None)")
            micro_inputs = None
            if ranks.is_first:
                if inputs is None:
                    raise ValueError(f"inputs are missing on rank {ranks.rank}, which runs the first stage: pass "
                                     f"the mini-batch's inputs there (other ranks may pass None)")
                batch = check_inputs(inputs)
                micro_inputs = scatter(inputs, chunks)
                transport.plan = wire.Plan(len(micro_inputs), batch, base_seed())
            plan = transport.plan if ranks.is_first else transport.wait_plan()
            micro_targets, weights = None, []
            if training and ranks.is_last:
                check_targets(targets, plan.batch)
                micro_targets = scatter(targets, chunks)
                weights = [t.shape[0] / plan.batch for t in micro_targets]
            schedule = task_lists(plan.count)
            step_plan = StepPlan(inputs=micro_inputs, targets=micro_targets, loss_fn=loss_fn, weights=weights,
                                 checkpointed=[training and checkpointed(m, plan.count, checkpoint)
                                               for m in range(plan.count)],
                                 base_seed=plan.seed, training=training, record_memory=training and record_memory,
                                 split_backward=splits_backward(schedule))
            start(step_plan, t0)
            events = run_stage(self.chunks, ranks.rank, schedule[ranks.rank], transport, on_event,
                               prefix=f"rank {ranks.rank}, ")
            result = None
            if ranks.is_last:
                state = self.chunks[max(self.chunks)].state  # the model's last chunk
                result = sum(state.losses[m] * weights[m] for m in range(plan.count)) if training else \
                    gather([state.outputs[m] for m in range(plan.count)])
            for chunk in self.chunks.values():
                if chunk.batch_norm is not None:
                    chunk.batch_norm.finish_step()
            piece = self._piece(events, t0, memory_of(ranks.rank))
            loss, pieces = self._end_waves(result if training else None, piece)
        except BaseException as error:
            if not isinstance(error, StageFailed):
                if not str(error.args[0] if error.args else "").startswith(f"[rank {ranks.rank}, "):
                    name_place(error, stage.index, None, prefix=f"rank {ranks.rank}, ")
                transport.report_failure(f"{type(error).__name__}: {error.args[0] if error.args else error}")
            raise
        finally:
            for chunk in self.chunks.values():
                chunk.finish()
        wall = time.perf_counter() - t0
        trace = self._trace(pieces, kind, plan, checkpoint, wall)
        if training:
            return loss.to(stage.device.device), trace
        return result, trace

    def _piece(self, events: list[Event], t0: float, memory: StageMemory) -> tuple:
        """This stage's part of the trace, in plain tuples, its times relative to its own start,
        which is given on rank 0's clock."""
        messages = [(self.ranks.rank, m.peer, m.direction, m.kind, m.micro, m.nbytes, m.start - t0, m.end - t0)
                    for m in self.transport.messages()]
        return (t0 - self.transport.clock_offset, [astuple(e) for e in events], messages, astuple(memory))

    def _end_waves(self, loss: Optional[torch.Tensor], piece: tuple) -> tuple[Optional[torch.Tensor], list]:
        """"end" upstream with the loss and the trace pieces of this stage and those after it, then
        "done" downstream: when it arrives every stage has finished the call."""
        ranks, transport = self.ranks, self.transport
        pieces = [piece]
        if not ranks.is_last:
            loss, later = transport.receive_control("end")
            pieces += pickle.loads(later.numpy().tobytes())
        if not ranks.is_first:
            blob = torch.frombuffer(bytearray(pickle.dumps(pieces)), dtype=torch.uint8)
            transport.send_control(ranks.rank - 1, "end", (loss, blob))
            transport.receive_control("done")
        if not ranks.is_last:
            transport.send_control(ranks.rank + 1, "done")
        return loss, pieces

    def _trace(self, pieces: list, kind: str, plan: wire.Plan, checkpoint: str, wall: float) -> Trace:
        """One trace of the stages this rank heard from (all of them on rank 0), on its time base."""
        origin = pieces[0][0]
        events, messages, memory = [], [], []
        for start, stage_events, stage_messages, stage_memory in pieces:
            shift = start - origin
            events += [Event(s, m, op, a + shift, b + shift, d, c) for s, m, op, a, b, d, c in stage_events]
            messages += [Message(*fields[:6], fields[6] + shift, fields[7] + shift) for fields in stage_messages]
            memory.append(StageMemory(*stage_memory))
        events.sort(key=lambda e: (e.start, e.stage))
        return Trace(stages=self.ranks.size, micro_batches=plan.count, batch_size=plan.batch, checkpoint=checkpoint,
                     kind=kind, events=events, memory=sorted(memory, key=lambda m: m.stage), wall=wall,
                     messages=sorted(messages, key=lambda m: m.start), transport="processes")
