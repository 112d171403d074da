"""K local stage processes that run one GPipe, driven from this process (a notebook, the app).

    pool = ProcessPool(stages=2)                        # K processes, gloo on loopback; they stay up
    pool.build(mlp.build, dict(blocks=8, width=256), chunks=8, checkpoint="never")
    loss = pool.step(x, y, torch.nn.functional.mse_loss)  # inputs go to rank 0, targets to the last rank
    pool.trace                                          # every stage's events, messages and memory
    pool.parameters()                                   # on request: the model's parameters, stage by stage
    pool.close()                                        # or let the interpreter exit: nothing stays behind

The stage processes never import the parent's main module (children.py), so the parent may be anything: a script
without a main guard, a Jupyter kernel, the Streamlit server. Each builds the model from a recipe
importable by name ("package.module:function"); the model is never sent. They meet at a Store in a
private folder and talk on loopback only (loopback.py). A stage's failure is raised here with its own
type, the stage named; a dead child is a StageProcessError, after which the pool is closed.
"""
from __future__ import annotations

import itertools
import os
import re
from dataclasses import replace
from typing import Callable, Optional, Sequence, Union

import torch

from engine.distributed.shm_lane import SHM, checked_spin, sweep
from engine.trace import Trace
from lab.machine.host import stage_processes_refused_here
from lab.machine.loopback import Meeting
from lab.machine.process_tree import orphaned
from lab.processes.children import ChildFailed, Children, name_of, resolve
from lab.processes.server import START_SECONDS, StageServer

Recipe = Union[str, Callable]
_pools = itertools.count()
POOL_FILE = re.compile(r"gpipe-pool(\d+)-")  # a pool's files in /dev/shm: named after the process that made it


class StageProcessError(ChildFailed):
    """A stage process died, or the pool could not get an answer from one."""


class ProcessPool:
    """K stage processes on this machine. `device`: "cpu", or "cuda" (stage k on GPU k mod the GPUs
    visible; NCCL between them when each has its own). `spin`: seconds a stage waiting on the
    shared-memory lane polls before it sleeps (None: the lane decides, shm_lane.spin_for)."""

    def __init__(self, stages: int, threads_per_stage: int = 1, keep_freed_memory: bool = True,
                 timeout: float = 300.0, device: str = "cpu", lane: str = "auto", spin: Optional[float] = None):
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            raise ValueError(f"stages={stages!r}: expected an int >= 1 (one process per stage)")
        if spin is not None:
            checked_spin(spin, f"spin={spin!r} (or None: the lane decides)")
        if device == "cuda":
            refused = stage_processes_refused_here(stages, torch.cuda.is_initialized())
            if refused:
                raise ValueError(f"ProcessPool({stages}, device='cuda'): {refused}")
        self.stages, self.timeout, self.device, self.lane = stages, timeout, device, lane
        self.trace: Optional[Trace] = None
        self.losses: list = []
        self.seconds = 0.0
        self.built = False
        sweep_orphans()
        self._meeting = Meeting()
        self._shm_prefix = f"gpipe-pool{os.getpid()}-{next(_pools)}"
        try:
            self._children = Children(StageServer,
                                      [(rank, stages, self._meeting.path, threads_per_stage, keep_freed_memory, device)
                                       for rank in range(stages)], name="stage", timeout=timeout,
                                      env={**self._meeting.env, "GPIPE_SHM_PREFIX": self._shm_prefix,
                                           "GPIPE_LANE": lane,
                                           **({} if spin is None else {"GPIPE_SPIN_SECONDS": repr(float(spin))})})
            self._ask([("ready", ())] * stages, timeout=START_SECONDS)
        except BaseException:
            self._meeting.close()
            raise

    @property
    def alive(self) -> bool:
        """Whether every stage process is still running and the pool is open."""
        return self._children.open and not self._children.dead()

    @property
    def pids(self) -> list[int]:
        return self._children.pids

    def check_alive(self) -> None:
        """Raise StageProcessError (and close the pool) if a stage process died since the last call."""
        dead = self._children.dead()
        if self._children.open and dead:
            self.close()
            rank = min(dead)
            raise StageProcessError(f"stage {rank}'s process died (exit codes {dead}); the others were stopped, "
                                    f"none is left: make a new ProcessPool")

    def build(self, recipe: Recipe, recipe_kwargs: Optional[dict] = None, balance=None,
              optimizer: Optional[tuple[Recipe, dict]] = None, **gpipe_options) -> None:
        """Make the pipe in every stage process from `recipe(**recipe_kwargs)`; `gpipe_options` go to
        GPipe. With `optimizer=("torch.optim.SGD", {"lr": 0.1})` each `step` also takes its step."""
        spec = (name_of(resolve(recipe)), recipe_kwargs or {}, self.stages if balance is None else balance,
                gpipe_options, optimizer)
        self._ask([("build", spec)] * self.stages)
        self.built = True

    def step(self, inputs, targets, loss_fn: Callable, on_event: Optional[Callable] = None,
             record_memory: Optional[bool] = None):
        """One training step (gradients zeroed first); returns the loss, and sets `trace` and `seconds`
        (as rank 0 timed it). `on_event` is called here, live, with each task's event. `record_memory`
        sets the pipe's ledger on or off from this step on (None: as it is)."""
        self._require_built()
        name_of(loss_fn)
        live = on_event is not None
        # targets: where the last chunk is (rank 0 in a V)
        commands = [("step", (inputs if rank == 0 else None, targets, loss_fn, live, record_memory))
                    for rank in range(self.stages)]
        answers = self._ask(commands, on_note=_live_events(on_event) if live else None)
        self.trace = answers[0][1]
        self.losses = [answer[0] for answer in answers]  # as each rank returned it: all equal
        self.seconds = answers[0][2]  # the step as rank 0 timed it, without this process's hand-over
        return answers[0][0]

    def forward(self, inputs):
        """The pipe's forward pass; returns the output (from the last stage's process)."""
        self._require_built()
        answers = self._ask([("forward", (inputs if rank == 0 else None,)) for rank in range(self.stages)])
        self.trace = answers[0][1]
        return next((answer[0] for answer in answers if answer[0] is not None), None)  # the last chunk's rank

    def parameters(self) -> list[torch.Tensor]:
        """Copies of the model's parameters, in the model's order."""
        return self._by_chunk("parameters")

    def gradients(self) -> list[Optional[torch.Tensor]]:
        """Copies of the parameters' gradients after the last step, in the model's order."""
        return self._by_chunk("gradients")

    def buffers(self) -> list[torch.Tensor]:
        """Copies of the model's buffers (batch norm statistics), in the model's order."""
        return self._by_chunk("buffers")

    def ping(self, count: int = 2000, numel: int = 1) -> float:
        """Seconds a message of `numel` float32 takes one way between 2 stages, over `count` round trips."""
        self._require_built()
        if self.stages != 2:
            raise ValueError(f"ping needs a pool of 2 stages, this one has {self.stages}")
        return self._ask([("ping", (count, numel))] * 2)[0]

    def apply(self, function: Callable, args: Sequence[tuple]) -> list:
        """`function(pipe, *args[rank])` in each stage process, on its own pipe; the answers by rank.
        What a study measures inside the stages (lab.engine_time.call_ends) comes this way, so that
        a stage process knows no study. `function` must be importable by name (children.name_of)."""
        self._require_built()
        name_of(function)
        return self._ask([("apply", (function, tuple(rank_args))) for rank_args in args])

    def resources(self) -> list[dict]:
        """Each stage process's threads, file descriptors and process groups (they must not grow)."""
        return self._ask([("resources", ())] * self.stages)

    def _by_chunk(self, what: str) -> list:
        """Each process's tensors of `what`, per chunk it holds, in the model's order."""
        self._require_built()
        per_chunk = {chunk: tensors for answer in self._ask([(what, ())] * self.stages) for chunk, tensors in answer}
        return [t for chunk in sorted(per_chunk) for t in per_chunk[chunk]]

    def kill(self, stage: int) -> None:
        """Kill one stage process at once (SIGKILL), as a crash would: for tests and lessons."""
        self._children.kill(stage)

    def release(self) -> None:
        """Drop the pipe in every stage process, with what their GPUs' allocators cached, keeping the
        processes up for the next `build`: for a caller that needs the GPUs' memory meanwhile."""
        if self.built:
            self._ask([("release", None)] * self.stages)
            self.built = False

    def close(self) -> None:
        """Stop every stage process; none is left behind, nor any of their files in /dev/shm."""
        self._children.close()
        self._meeting.close()
        sweep(f"{SHM}/{self._shm_prefix}-")

    def __enter__(self) -> "ProcessPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- internals -----------------------------------------------------------------------------

    def _require_built(self) -> None:
        if not self.built:
            raise RuntimeError("the pool has no pipe yet: call pool.build(recipe, ...) first")

    def _ask(self, commands: list, timeout: Optional[float] = None, on_note=None) -> list:
        if not self._children.open:
            raise StageProcessError("the process pool is closed (after close(), or after a stage process died); "
                                    "make a new ProcessPool")
        try:
            return self._children.ask(commands, timeout, on_note)
        except StageProcessError:
            raise
        except ChildFailed as failure:
            raise StageProcessError(f"{failure}: make a new ProcessPool") from None


def sweep_orphans() -> list[str]:
    """Remove from /dev/shm what pools whose process is gone left there, and say what: a pool
    killed together with its stage processes (SIGKILL to its process group, as a supervisor, a
    container stop or the OOM killer does) cleans up nothing itself. Every new pool sweeps first,
    so a lab restarted that way all day does not fill /dev/shm."""
    if not os.path.isdir(SHM):
        return []
    removed = []
    for name in orphaned(SHM, POOL_FILE):
        try:
            os.unlink(f"{SHM}/{name}")
            removed.append(name)
        except FileNotFoundError:  # another pool swept it first
            pass
    return removed


def _live_events(on_event: Callable):
    """An `on_note` that hands live events to `on_event`, moved to the earliest stage origin seen."""
    origins: list[float] = []

    def on_note(rank: int, note) -> None:
        origin, event = note
        origins.append(origin)
        on_event(replace(event, start=event.start + origin - min(origins), end=event.end + origin - min(origins)))
    return on_note
