"""The stages one process runs: their chunks of layers and devices, prepared and concluded per call.

With threads a process runs every stage; with processes (engine/distributed) only its own. Either
way a runner starts the call here, runs the tasks, and concludes it here.
"""
from __future__ import annotations

import time

import torch

from .call import Call
from .chunk import Chunk
from .device import StageDevice
from .memory import ActivationLedger
from .microbatch import gather
from .trace import StageMemory


class LocalStages:
    """`chunks` by chunk index and `devices` by stage, for the stages this process runs."""

    def __init__(self, chunks: dict[int, Chunk], devices: dict[int, StageDevice], chunk_count: int):
        self.chunks, self.devices, self.chunk_count = chunks, devices, chunk_count

    @property
    def runs_first(self) -> bool:
        """Whether this process runs the model's first chunk (it reads the inputs)."""
        return 0 in self.chunks

    @property
    def runs_last(self) -> bool:
        """Whether this process runs the model's last chunk (it reads the targets, computes the loss)."""
        return self.chunk_count - 1 in self.chunks

    def start(self, call: Call) -> float:
        """Begin a call and return its time origin (a perf_counter reading), taken once these stages'
        streams are idle (not the whole GPU: a receive posted for the call may be pending), so host and
        GPU clocks start together: peak memory reset per device, one activation ledger per stage."""
        gpus = {d.device for d in self.devices.values() if d.is_cuda}
        self.settle()
        for gpu in gpus:
            torch.cuda.current_stream(gpu).synchronize()
            torch.cuda.reset_peak_memory_stats(gpu)
        t0 = time.perf_counter()
        origins = {gpu: torch.cuda.Event(enable_timing=True) for gpu in gpus}
        for gpu, origin in origins.items():  # streams idle: an event on one marks "now" for all
            origin.record(torch.cuda.current_stream(gpu))
        for stage, device in self.devices.items():
            device.start(t0, origins.get(device.device))
            mine = [chunk for chunk in self.chunks.values() if chunk.stage == stage]
            ledger = ActivationLedger([p for chunk in mine for p in chunk.parameters()]
                                      if mine and call.record_memory else ())
            with device.on_stream():  # e.g. batch norm's counters, read back on this stream's timeline
                for chunk in mine:
                    chunk.start(call, ledger)
        return t0

    def settle(self) -> None:
        """Wait until every stage's queued GPU work has run (none on CPU): results are read after it."""
        for device in self.devices.values():
            device.settle()

    def conclude(self, call: Call):
        """After every task ran: deferred batch norm's statistics, and the call's result if this
        process holds the last chunk (the mini-batch loss of a step, the joined outputs of a forward)."""
        for chunk in self.chunks.values():
            if chunk.batch_norm is not None:
                chunk.batch_norm.finish_step()
        if not self.runs_last:
            return None
        state = self.chunks[self.chunk_count - 1].state
        if call.training:
            weights = call.weights
            return sum(state.losses[m] * weights[m] for m in range(call.micro_batches))
        return gather([state.outputs[m] for m in range(call.micro_batches)])

    def finish(self) -> None:
        """Drop every reference the call kept (graphs, inputs, outputs), so nothing outlives it."""
        for chunk in self.chunks.values():
            chunk.finish()

    def parameters(self) -> list:
        """The parameters of every chunk this process runs, in model order."""
        return [p for index in sorted(self.chunks) for p in self.chunks[index].parameters()]

    def memory(self, stage: int) -> StageMemory:
        """Memory of one stage: its chunks' parameters and gradients, its activation peak."""
        chunks = [chunk for chunk in self.chunks.values() if chunk.stage == stage]
        param_bytes = grad_bytes = 0
        for chunk in chunks:  # one pass, at the call's end: each attribute read costs there
            for p in chunk.parameters():
                param_bytes += p.nbytes
                grad_bytes += 0 if p.grad is None else p.grad.nbytes
        device = self.devices[stage]
        return StageMemory(stage=stage, device=str(device.device), param_bytes=param_bytes, grad_bytes=grad_bytes,
                           activation_peak_bytes=chunks[0].ledger.peak, device_peak_bytes=device.peak_bytes())
