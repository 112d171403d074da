"""A stage process of a ProcessPool (lab/processes/pool.py, the parent's side): it joins the
pool's group, builds its stage of the model from a recipe, and answers the pool's commands (build,
step, forward, parameters, ping, and `apply`: a function of its pipe, for what a study measures
inside a stage)."""
from __future__ import annotations

import gc
import os
import threading
import time
from typing import Optional

import torch

from engine.device import spread
from lab.machine.host import keep_freed_cpu_memory
from lab.machine.loopback import join
from lab.processes.children import resolve

START_SECONDS = 120.0  # how long a stage process waits for the others to join


class StageServer:
    """A stage process: joins the pool's group, then answers the pool's commands."""

    def __init__(self, rank: int, size: int, store: str, threads: int, keep_freed_memory: bool, device: str):
        if keep_freed_memory:
            keep_freed_cpu_memory()
        torch.set_num_threads(threads)
        # "cuda": the GPU of this rank of the pool (cuda:rank mod count), never a LOCAL_RANK inherited from a
        # torchrun worker that started the pool (every stage would land on that worker's GPU)
        self.rank, self.threads, self.device = rank, threads, spread(device, size)[rank]
        # stages on GPUs send their payloads over NCCL where each has a GPU of its own (the lane decides)
        nccl = torch.device(self.device).type == "cuda" and torch.distributed.is_nccl_available()
        if torch.device(self.device).type == "cuda":  # NCCL's helpers and default streams on this GPU, not cuda:0
            torch.cuda.set_device(self.device)
        join(store, rank, size, timeout=START_SECONDS, backend="cpu:gloo,cuda:nccl" if nccl else "gloo")
        self.pipe, self.optimizer = None, None
        self.tell = None  # set by children.serve: sends the parent a note while a command runs

    def __call__(self, command):
        what, args = command
        if what == "ready":
            return None
        if what == "build":
            self._drop_pipe()
            self.pipe, self.optimizer = _build(*args, threads=self.threads, device=self.device)
            return None
        if what == "release":  # the pipe and what the GPU's allocator cached, for a caller that needs the memory
            self._drop_pipe()
            gc.collect()
            if self.device == "cuda":
                torch.cuda.empty_cache()
            return None
        if what == "step":
            return self._step(*args)
        if what == "forward":
            out = self.pipe(*args)
            return None if out is None else out.detach().cpu(), self.pipe.trace if self.rank == 0 else None
        if what in ("parameters", "gradients", "buffers"):
            return [(chunk, _copies(partition, what))
                    for chunk, partition in zip(self.pipe.local_chunks, self.pipe.partitions)]
        if what == "ping":
            return self._ping(*args)
        if what == "apply":
            function, function_args = args
            return function(self.pipe, *function_args)
        if what == "resources":
            import torch.distributed as dist
            return {"threads": threading.active_count(), "file descriptors": len(os.listdir("/proc/self/fd")),
                    "process groups": len(dist.distributed_c10d._world.pg_map)}
        raise ValueError(f"unknown command {what!r}")

    def _step(self, inputs, targets, loss_fn, live: bool, record_memory: Optional[bool]):
        if record_memory is not None:  # read per call: a timed step keeps no ledger
            self.pipe.record_memory = record_memory
        if self.optimizer is not None:
            self.optimizer.zero_grad()
        else:
            self.pipe.zero_grad()
        on_event = (lambda event: self.tell((self.pipe.call_origin, event))) if live else None
        start = time.perf_counter()
        loss = self.pipe.step(inputs, targets, loss_fn, on_event=on_event)
        seconds = time.perf_counter() - start
        if self.optimizer is not None:
            self.optimizer.step()
        return loss.detach().cpu(), self.pipe.trace if self.rank == 0 else None, seconds

    def _ping(self, count: int, numel: int) -> float:
        """Round trips with the other stage process, through the pipe's transport, as a call of its own."""
        transport = self.pipe.runner.side_call()
        value, peer = torch.zeros(numel, device=self.device), 1 - self.rank  # on NCCL edges, a GPU tensor
        start = time.perf_counter()
        for number in range(count):
            if self.rank == 0:
                transport.send_control(peer, "act", value, micro=number)
                transport.receive_control("grad", micro=number)
            else:
                transport.receive_control("act", micro=number)
                transport.send_control(peer, "grad", value, micro=number)
        return (time.perf_counter() - start) / count / 2

    def _drop_pipe(self) -> None:
        """Close this stage's pipe (its transport's threads and groups) and let it go, with its optimizer."""
        if self.pipe is not None:
            self.pipe.close()
            self.pipe = self.optimizer = None

    def close(self) -> None:
        import torch.distributed as dist

        self._drop_pipe()
        dist.destroy_process_group()


def _copies(partition: torch.nn.Module, what: str) -> list:
    """Copies, on the CPU, of a partition's parameters, their gradients, or its buffers."""
    if what == "buffers":
        return [b.detach().cpu().clone() for b in partition.buffers()]
    tensors = [p if what == "parameters" else p.grad for p in partition.parameters()]
    return [None if t is None else t.detach().cpu().clone() for t in tensors]


def _build(recipe: str, recipe_kwargs: dict, balance, options: dict, optimizer, threads: int, device: str):
    import torch.distributed as dist

    from engine import GPipe

    model = resolve(recipe)(**recipe_kwargs)
    pipe = GPipe(model, balance, group=dist.group.WORLD,
                 **{"threads_per_stage": threads, "devices": device, **options})
    if optimizer is None:
        return pipe, None
    kind, settings = optimizer
    return pipe, resolve(kind if ":" in str(kind) else str(kind).replace("torch.optim.", "torch.optim:"))(
        pipe.parameters(), **settings)
