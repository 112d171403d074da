"""Racing the peers: the same model, batch and K=2 on this host, for our engine,
torch.distributed.pipelining's ScheduleGPipe (two processes over gloo, one core each) and, when it
is installed, torchgpipe. Every implementation is also checked for gradient exactness against the
unpipelined model on the whole batch.
"""
from __future__ import annotations

import importlib.util
import io
import os
import socket
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.multiprocessing as mp
from torch import nn

from engine import GPipe

from . import theory


@dataclass(frozen=True)
class Workload:
    """A uniform MLP regression problem every peer trains identically."""

    width: int = 1024
    blocks: int = 8
    batch: int = 512
    seed: int = 0

    def model(self) -> nn.Sequential:
        torch.manual_seed(self.seed)
        return nn.Sequential(*[nn.Sequential(nn.Linear(self.width, self.width), nn.ReLU())
                               for _ in range(self.blocks)])

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed + 1)
        return (torch.randn(self.batch, self.width, generator=gen),
                torch.randn(self.batch, self.width, generator=gen))


@dataclass(frozen=True)
class Result:
    peer: str
    micro_batches: int
    seconds: float            # median seconds per training step
    max_grad_diff: float      # largest |gradient - unpipelined gradient|



def reference_grads(work: Workload) -> list[torch.Tensor]:
    """Gradients of the mean-squared error on the whole batch, one device, no pipeline."""
    model = work.model()
    x, y = work.data()
    nn.functional.mse_loss(model(x), y).backward()
    return [p.grad for p in model.parameters()]


def _difference(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(grads, reference))


def _timed(step: Callable[[], None], rounds: int) -> float:
    step()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def single_device(work: Workload, micro: int, rounds: int, reference) -> Result:
    """The baseline: one core, plain PyTorch, the batch as `micro` accumulated micro-batches."""
    model, (x, y) = work.model(), work.data()
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        def step():
            model.zero_grad()
            for xc, yc in zip(x.chunk(micro), y.chunk(micro)):
                (nn.functional.mse_loss(model(xc), yc) * (xc.shape[0] / work.batch)).backward()
        seconds = _timed(step, rounds)
    finally:
        torch.set_num_threads(previous)
    return Result("one core, no pipeline", micro, seconds, _difference([p.grad for p in model.parameters()], reference))


def ours(work: Workload, micro: int, rounds: int, reference, checkpoint: str = "never") -> Result:
    """This project's engine: K=2 stages, one thread (core) each."""
    model, (x, y) = work.model(), work.data()
    pipe = GPipe(model, 2, chunks=micro, checkpoint=checkpoint, threads_per_stage=1)
    try:
        def step():
            model.zero_grad()
            pipe.step(x, y, nn.functional.mse_loss)
        seconds = _timed(step, rounds)
    finally:
        pipe.close()
    return Result("gpipe-lab engine", micro, seconds, _difference([p.grad for p in model.parameters()], reference))


def torchgpipe_available() -> bool:
    return importlib.util.find_spec("torchgpipe") is not None


def torchgpipe_peer(work: Workload, micro: int, rounds: int, reference, checkpoint: str = "never") -> Result:
    """torchgpipe's GPipe with both partitions on "cpu" (it runs one worker per device, so the two
    stages share one worker thread on a CPU host)."""
    import torchgpipe
    model, (x, y) = work.model(), work.data()
    pipe = torchgpipe.GPipe(model, balance=[work.blocks // 2, work.blocks - work.blocks // 2],
                            devices=["cpu", "cpu"], chunks=micro, checkpoint=checkpoint)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        def step():
            model.zero_grad()
            nn.functional.mse_loss(pipe(x), y).backward()
        seconds = _timed(step, rounds)
    finally:
        torch.set_num_threads(previous)
    return Result("torchgpipe", micro, seconds, _difference([p.grad for p in model.parameters()], reference))


def torch_pipelining(work: Workload, micros: list[int], rounds: int, reference) -> list[Result]:
    """torch.distributed.pipelining ScheduleGPipe: two processes (one stage and one core each)
    talking over gloo on loopback; all micro-batch counts are timed in one process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=_pipelining_worker, args=(rank, port, work, micros, rounds, queue))
                 for rank in range(2)]
    for process in processes:
        process.start()
    try:
        replies = sorted((queue.get(timeout=600) for _ in processes), key=lambda r: r[0])
    finally:
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    grads_by_rank = [torch.load(io.BytesIO(reply[2])) for reply in replies]
    results = []
    for i, micro in enumerate(micros):
        seconds = max(reply[1][i] for reply in replies)
        grads = grads_by_rank[0][i] + grads_by_rank[1][i]
        results.append(Result("torch.distributed.pipelining ScheduleGPipe", micro, seconds,
                              _difference(grads, reference)))
    return results


def _pipelining_worker(rank: int, port: int, work: Workload, micros: list[int], rounds: int, queue) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model, (x, y) = work.model(), work.data()
        half = work.blocks // 2
        part = nn.Sequential(*(list(model)[:half] if rank == 0 else list(model)[half:]))
        times, grads = [], []
        for micro in micros:
            stage = PipelineStage(part, rank, 2, torch.device("cpu"))
            schedule = ScheduleGPipe(stage, n_microbatches=micro, loss_fn=nn.functional.mse_loss)

            def step():
                part.zero_grad()
                if rank == 0:
                    schedule.step(x)
                else:
                    schedule.step(target=y, losses=[])
            step()
            measured = []
            for _ in range(rounds):
                dist.barrier()
                start = time.perf_counter()
                step()
                measured.append(time.perf_counter() - start)
            times.append(statistics.median(measured))
            grads.append([p.grad.clone() for p in part.parameters()])
        buffer = io.BytesIO()  # plain bytes: shared-memory tensors would die with this process
        torch.save(grads, buffer)
        queue.put((rank, times, buffer.getvalue()))
    finally:
        dist.destroy_process_group()


def race(work: Workload, micros: list[int], rounds: int, progress: Optional[Callable[[str], None]] = None,
         checkpoint: str = "never") -> Iterator[Result]:
    """Yield every peer's result at every M, the one-core baseline first at each M."""
    reference = reference_grads(work)
    for micro in micros:
        for name, peer in (("one core", single_device), ("gpipe-lab", ours), ("torchgpipe", torchgpipe_peer)):
            if name == "torchgpipe" and not torchgpipe_available():
                continue
            if progress:
                progress(f"{name}, M={micro}")
            extra = {} if name == "one core" else {"checkpoint": checkpoint}
            yield peer(work, micro, rounds, reference, **extra)
    if progress:
        progress("torch.distributed.pipelining, all M (2 processes)")
    yield from torch_pipelining(work, micros, rounds, reference)


def table_rows(results: list[Result], batch: int) -> list[dict]:
    """One row per (peer, M): samples/s, speedup over one core at the same M, share of the ideal."""
    baseline = {r.micro_batches: r.seconds for r in results if r.peer == "one core, no pipeline"}
    rows = []
    for r in sorted(results, key=lambda r: (r.micro_batches, r.peer != "one core, no pipeline", r.peer)):
        speedup = baseline[r.micro_batches] / r.seconds
        stages = 1 if r.peer == "one core, no pipeline" else 2
        rows.append({"M": r.micro_batches, "implementation": r.peer, "samples/s": round(batch / r.seconds, 1),
                     "speedup vs one core": round(speedup, 2),
                     "of ideal": round(speedup / theory.ideal_speedup(stages, r.micro_batches), 2),
                     "max grad diff": f"{r.max_grad_diff:.1e}"})
    return rows
