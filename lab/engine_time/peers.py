"""Racing the peers: the same model, batch and K=2 on this host, for our engine (stages as threads,
and stages as processes over gloo), torch.distributed.pipelining's ScheduleGPipe (two processes over
gloo, one core each) and, when it is installed, torchgpipe. Every implementation is also checked
for gradient exactness against the unpipelined model on the whole batch.

The host is noisy, so the contenders are timed side by side: at each M, every round runs one step
of each of them in turn, and a speedup is the median over the rounds of the ratio to the one-core
step of the same round.
"""
from __future__ import annotations

import functools
import importlib.util
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, TypeVar

import torch
from torch import nn

from lab import theory
from lab.engine_time.call_ends import median_ends
from lab.machine.host import keep_freed_cpu_memory
from lab.machine.loopback import Meeting, join
from lab.processes.children import Children
from lab.processes.pool import ProcessPool
from lab.runs.exactness import unpipelined_gradients
from lab.runs.stepper import Stepper
from lab.zoo import mlp

T = TypeVar("T")
BASELINE = "one core, no pipeline"
RECIPE = mlp.build   # the workload's model: stage processes build it too


@dataclass(frozen=True)
class Workload:
    """A uniform MLP regression problem every peer trains identically."""

    width: int = 1024
    blocks: int = 8
    batch: int = 512
    seed: int = 0

    def model(self) -> nn.Sequential:
        return mlp.build(**self.recipe)

    @property
    def recipe(self) -> dict:
        """How the model is made (lab.zoo.mlp.build's arguments), for processes that build it themselves."""
        return dict(blocks=self.blocks, width=self.width, seed=self.seed)

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed + 1)
        return (torch.randn(self.batch, self.width, generator=gen),
                torch.randn(self.batch, self.width, generator=gen))


@dataclass(frozen=True)
class Result:
    peer: str
    micro_batches: int
    times: tuple[float, ...]  # seconds per training step, one per round
    max_grad_diff: float      # largest |gradient - unpipelined gradient|

    @property
    def seconds(self) -> float:
        return statistics.median(self.times)


def _difference(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(grads, reference))


def with_threads(threads: Optional[int], run: Callable[[], T]) -> T:
    """`run()` with `threads` intra-op threads in this thread if given (restored after)."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return run()
    finally:
        torch.set_num_threads(previous)


def _timed(step: Callable[[], None], threads: Optional[int] = None) -> float:
    """Seconds one call of `step` takes, with `threads` intra-op threads in this thread if given."""
    def timed() -> float:
        start = time.perf_counter()
        step()
        return time.perf_counter() - start
    return with_threads(threads, timed)


class InProcess:
    """A contender that trains in this process: `step()` times one training step, `grads()` are
    the gradients of the last one."""

    def __init__(self, name: str, model: nn.Sequential, train: Callable[[], None],
                 threads: Optional[int] = None, close: Callable[[], None] = lambda: None):
        self.name, self.model, self.train, self.threads, self.close = name, model, train, threads, close

    def step(self) -> float:
        self.model.zero_grad()
        return _timed(self.train, self.threads)

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.model.parameters()]


def single_device(work: Workload, micro: int, checkpoint: str) -> InProcess:
    """The baseline: one core, plain PyTorch, the batch as `micro` accumulated micro-batches
    (`checkpoint` does not apply: plain PyTorch keeps every activation)."""
    model, (x, y) = work.model(), work.data()

    def train():
        for xc, yc in zip(x.chunk(micro), y.chunk(micro)):
            (nn.functional.mse_loss(model(xc), yc) * (xc.shape[0] / work.batch)).backward()
    return InProcess(BASELINE, model, train, threads=1)


class Ours:
    """This project's engine as a contender: a Stepper of the workload at one M, its two stages as
    threads (one core each) or in the race's stage processes; a step's time is the stepper's."""

    def __init__(self, name: str, work: Workload, stepper: Stepper):
        self.name, self.stepper, self.data = name, stepper, work.data()

    def step(self) -> float:
        return self.stepper.step(*self.data, nn.functional.mse_loss)[2]

    def grads(self) -> list[torch.Tensor]:
        return self.stepper.gradients()

    def close(self) -> None:
        self.stepper.close()


def ours(work: Workload, micro: int, checkpoint: str, **options) -> Ours:
    """This project's engine: K=2 stages, one thread (core) each; `options` for GPipe."""
    return Ours("gpipe-lab engine, threads", work,
                Stepper(RECIPE, work.recipe, 2, chunks=micro, checkpoint=checkpoint, threads_per_stage=1, **options))


def ours_in_processes(pool: ProcessPool, work: Workload, micro: int, checkpoint: str, **options) -> Ours:
    """This project's engine with one process per stage: `pool`, kept for the whole race and
    rebuilt at each M; a step's time is measured by the first stage's process."""
    return Ours("gpipe-lab engine, processes", work,
                Stepper(RECIPE, work.recipe, 2, pool=pool, chunks=micro, checkpoint=checkpoint, **options))


def torchgpipe_available() -> bool:
    return importlib.util.find_spec("torchgpipe") is not None


def torchgpipe_peer(work: Workload, micro: int, checkpoint: str) -> InProcess:
    """torchgpipe's GPipe with both partitions on "cpu" (it runs one worker per device, so the two
    stages share one worker thread on a CPU host)."""
    import torchgpipe
    model, (x, y) = work.model(), work.data()
    pipe = torchgpipe.GPipe(model, balance=[work.blocks // 2, work.blocks - work.blocks // 2],
                            devices=["cpu", "cpu"], chunks=micro, checkpoint=checkpoint)
    return InProcess("torchgpipe", model, lambda: nn.functional.mse_loss(pipe(x), y).backward(), threads=1)


class PipeliningProcesses:
    """torch.distributed.pipelining ScheduleGPipe in two processes (one stage and one core each)
    talking over gloo on loopback, kept alive for the whole race and driven step by step, so that
    its steps interleave with the other contenders'. A step's time is the slower rank's, each
    measured from a barrier."""

    name = "torch.distributed.pipelining ScheduleGPipe"

    def __init__(self, work: Workload, tuned_malloc: bool, timeout_s: float = 600):
        self.meeting = Meeting()
        self.ranks = Children(PipeliningRank, [(rank, self.meeting.path, work, tuned_malloc) for rank in range(2)],
                              name="torch.distributed.pipelining rank", timeout=timeout_s, env=self.meeting.env)

    def ping(self, count: int, numel: int) -> float:
        """Seconds a message of `numel` float32 takes one way between the two ranks (`PipeliningRank.ping`)."""
        return self.ask("ping", (count, numel))[0]

    def ends(self, micro: int, count: int) -> tuple[float, float]:
        """Median seconds a step at M=`micro` spends on rank 0 before the first layer and after its
        last gradient, over `count` steps (`PipeliningRank.ends`)."""
        return self.ask("ends", (micro, count))[0]

    def ask(self, command: str, argument: object = 0) -> list:
        """Send `command` with its `argument` (an M, or a tuple for "ping" and "ends") to both ranks and
        return their answers, rank 0 first; a failure in a rank is raised here with its own type, a
        dead or silent rank after at most the timeout."""
        return self.ranks.ask([(command, argument)] * 2)

    def at(self, micro: int) -> "PipeliningAt":
        return PipeliningAt(self, micro)

    def close(self) -> None:
        self.ranks.close()
        self.meeting.close()


@dataclass
class PipeliningAt:
    """The two-process peer seen as a contender at one M."""

    processes: PipeliningProcesses
    micro: int
    name: str = PipeliningProcesses.name

    def step(self) -> float:
        return max(self.processes.ask("step", self.micro))

    def grads(self) -> list[torch.Tensor]:
        first, second = self.processes.ask("grads", self.micro)
        return first + second

    def close(self) -> None:
        pass


class PipeliningRank:
    """One rank of the peer: builds its half of the model, then serves ("step" | "grads", M),
    ("ping", (count, numel)) and ("ends", (M, count)) commands. With `tuned_malloc` its malloc
    keeps freed memory, as the racing process's does."""

    def __init__(self, rank: int, store: str, work: Workload, tuned_malloc: bool):
        if tuned_malloc:
            keep_freed_cpu_memory()
        torch.set_num_threads(1)
        join(store, rank, 2)
        self.rank = rank
        model, (self.x, self.y) = work.model(), work.data()
        half = work.blocks // 2
        self.part = nn.Sequential(*(list(model)[:half] if rank == 0 else list(model)[half:]))
        self.schedules: dict = {}

    def __call__(self, command: tuple[str, int]):
        what, micro = command
        if what == "ping":
            return self.ping(*micro)
        if what == "ends":
            return self.ends(*micro)
        if what not in ("step", "grads"):
            raise ValueError(f"unknown command {what!r}; expected 'step', 'grads', 'ping' or 'ends'")
        if what == "grads":
            return [p.grad.clone() for p in self.part.parameters()]
        self._ready(micro)
        start = time.perf_counter()
        self._step(micro)
        return time.perf_counter() - start

    def _ready(self, micro: int) -> None:
        """Before a timed step: its schedule made (once per M), gradients zeroed, both ranks at a barrier."""
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        if micro not in self.schedules:
            stage = PipelineStage(self.part, self.rank, 2, torch.device("cpu"))
            self.schedules[micro] = ScheduleGPipe(stage, n_microbatches=micro, loss_fn=nn.functional.mse_loss)
        self.part.zero_grad()
        dist.barrier()

    def _step(self, micro: int) -> None:
        if self.rank == 0:
            self.schedules[micro].step(self.x)
        else:
            self.schedules[micro].step(target=self.y, losses=[])

    def ends(self, micro: int, count: int) -> Optional[tuple[float, float]]:
        """`count` steps; on rank 0 (the first layer's) the median seconds before that layer's forward
        and after its last gradient (lab.engine_time.call_ends), None on rank 1."""
        return median_ends(self.part[0] if self.rank == 0 else None, lambda: self._step(micro), count,
                           before_each=lambda: self._ready(micro))

    def ping(self, count: int, numel: int) -> float:
        """Seconds a tensor of `numel` float32 takes one way between the two ranks over gloo, the
        point-to-point sends the schedule's steps use, over `count` round trips."""
        import torch.distributed as dist

        buffer, other = torch.zeros(numel), 1 - self.rank
        dist.barrier()
        start = time.perf_counter()
        for _ in range(count):
            if self.rank == 0:
                dist.send(buffer, other)
                dist.recv(buffer, other)
            else:
                dist.recv(buffer, other)
                dist.send(buffer, other)
        return (time.perf_counter() - start) / (2 * count)

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


def race(work: Workload, micros: list[int], rounds: int, progress: Optional[Callable[[str], None]] = None,
         checkpoint: str = "never", pipelining: Optional[PipeliningProcesses] = None,
         burst: Callable[[int], int] = lambda micro: 1,
         engine_options: Optional[dict] = None) -> Iterator[list[Result]]:
    """Yield, M after M, every peer's result at that M, the one-core baseline first. At each M the
    contenders take turns, `burst(M)` steps each per round (a round's time is their median: a
    process's first steps after its pause between turns run slow, up to 1.6x for a step of a
    millisecond on this host), after an untimed warm-up round; `engine_options` go to our
    engine's pipes, which keep no activation ledger unless they say so (the peers keep none). Every
    process in the race, the peer's two included, gets the same malloc tuning (see
    lab.machine.host.keep_freed_cpu_memory). `pipelining`: the peer's ranks, if already started for `work`
    (closed at the end either way)."""
    tuned_malloc = keep_freed_cpu_memory()
    reference = unpipelined_gradients(work.model(), *work.data(), nn.functional.mse_loss)
    options = {"record_memory": False, **(engine_options or {})}
    if_installed = [torchgpipe_peer] if torchgpipe_available() else []
    builders = [single_device, functools.partial(ours, **options)] + if_installed
    pipelining = pipelining or PipeliningProcesses(work, tuned_malloc)
    pool = None
    try:
        pool = ProcessPool(2, threads_per_stage=1, keep_freed_memory=tuned_malloc)
        for micro in micros:
            contenders = [build(work, micro, checkpoint) for build in builders] + \
                [ours_in_processes(pool, work, micro, checkpoint, **options), pipelining.at(micro)]
            try:
                times: list[list[float]] = [[] for _ in contenders]
                for round_ in range(rounds + 1):
                    for contender, measured in zip(contenders, times):
                        if progress:
                            progress(f"M={micro}, round {round_}/{rounds}: {contender.name}")
                        seconds = statistics.median([contender.step() for _ in range(burst(micro))])
                        if round_:
                            measured.append(seconds)
                yield [Result(contender.name, micro, tuple(measured), _difference(contender.grads(), reference))
                       for contender, measured in zip(contenders, times)]
            finally:
                for contender in contenders:
                    contender.close()
    finally:
        pipelining.close()
        if pool is not None:
            pool.close()


def table_rows(results: list[Result], batch: int) -> list[dict]:
    """One row per (peer, M): samples/s (median step), speedup over one core at the same M (median
    of the per-round ratios), share of the ideal."""
    baseline = {r.micro_batches: r.times for r in results if r.peer == BASELINE}
    rows = []
    for r in sorted(results, key=lambda r: (r.micro_batches, r.peer != BASELINE, r.peer)):
        speedup = statistics.median(b / t for b, t in zip(baseline[r.micro_batches], r.times))
        stages = 1 if r.peer == BASELINE else 2
        rows.append({"M": r.micro_batches, "implementation": r.peer, "samples/s": round(batch / r.seconds, 1),
                     "speedup vs one core": round(speedup, 2),
                     "of ideal": round(speedup / theory.ideal_speedup(stages, r.micro_batches), 2),
                     "max grad diff": f"{r.max_grad_diff:.1e}"})
    return rows
