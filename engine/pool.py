"""K local stage processes that run one GPipe, driven from this process (a notebook, the app).

    pool = ProcessPool(stages=2)                        # K processes, gloo on loopback; they stay up
    pool.build("lab.models:build_mlp", dict(blocks=8, width=256), chunks=8, checkpoint="never")
    loss = pool.step(x, y, torch.nn.functional.mse_loss)  # inputs go to rank 0, targets to the last rank
    pool.trace                                          # every stage's events, messages and memory
    pool.parameters()                                   # on request: the model's parameters, stage by stage
    pool.close()                                        # or let the interpreter exit: nothing stays behind

Every child builds the model itself from a recipe importable by name ("package.module:function"
or a module-level function): spawned children cannot unpickle a notebook's own functions, so the
model is never sent, only how to make it. The parent hosts the Store that the children meet at,
so it outlives any of them. A child that dies, or any failure, is raised here promptly with the
stage named; the pool is then closed and a new one must be made. Children end with the parent:
each watches for its parent to be gone, and also stops when its command pipe closes.
"""
from __future__ import annotations

import importlib
import os
import signal
import threading
import time
import weakref
from datetime import timedelta
from typing import Callable, Optional, Union

from multiprocessing.connection import wait

import torch
import torch.multiprocessing as mp

from .trace import Trace

Recipe = Union[str, Callable]
START_SECONDS = 120.0


class StageProcessError(RuntimeError):
    """A stage process died, or the pool could not get an answer from one."""


def resolve(recipe: Recipe) -> Callable:
    """The function named by "package.module:function" (or the function itself)."""
    if callable(recipe):
        return recipe
    if not isinstance(recipe, str) or ":" not in recipe:
        raise ValueError(f"recipe={recipe!r}: expected 'package.module:function', a function importable by name")
    module, _, name = recipe.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"recipe={recipe!r} cannot be imported: {error}") from None


def _check_importable(function: Callable) -> None:
    module = getattr(function, "__module__", None)
    if module in (None, "__main__") or "<locals>" in getattr(function, "__qualname__", "<locals>"):
        raise ValueError(f"{function!r} is defined in {module or 'no module'}: stage processes cannot import it. "
                         f"Put it in a module (or name it as 'package.module:function')")


class ProcessPool:
    """K stage processes on this machine, one per stage, meeting over gloo on loopback."""

    def __init__(self, stages: int, threads_per_stage: int = 1, keep_freed_memory: bool = True,
                 timeout: float = 300.0):
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            raise ValueError(f"stages={stages!r}: expected an int >= 1 (one process per stage)")
        self.stages, self.timeout = stages, timeout
        self.trace: Optional[Trace] = None
        self.losses: list = []
        self.seconds = 0.0
        self.built = False
        self._store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                                 timeout=timedelta(seconds=START_SECONDS))
        context = mp.get_context("spawn")
        pipes = [context.Pipe() for _ in range(stages)]
        self._connections = [parent for parent, _ in pipes]
        self._processes = [context.Process(target=_serve, name=f"gpipe-stage-process-{rank}", daemon=True,
                                           args=(rank, stages, self._store.port, child, threads_per_stage,
                                                 keep_freed_memory, os.getpid()))
                           for rank, (_, child) in enumerate(pipes)]
        for process in self._processes:
            process.start()
        for _, child in pipes:
            child.close()
        self._finalizer = weakref.finalize(self, _shut_down, self._processes, self._connections)
        self._ask([("ready", ())] * stages, timeout=START_SECONDS)

    @property
    def alive(self) -> bool:
        """Whether every stage process is still running and the pool is open."""
        return self._finalizer.alive and all(p.is_alive() for p in self._processes)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes]

    def check_alive(self) -> None:
        """Raise StageProcessError (and close the pool) if a stage process has died since the last
        call, as a crash or an out-of-memory kill would leave it."""
        dead = [rank for rank, p in enumerate(self._processes) if not p.is_alive()]
        if self._finalizer.alive and dead:
            self._fail(dead[0])

    def build(self, recipe: Recipe, recipe_kwargs: Optional[dict] = None, balance=None,
              optimizer: Optional[tuple[Recipe, dict]] = None, **gpipe_options) -> None:
        """Make the pipe in every stage process: `recipe(**recipe_kwargs)` gives the nn.Sequential,
        `balance` defaults to K stages, `gpipe_options` go to GPipe (chunks, checkpoint, seed, ...).
        With `optimizer=("torch.optim.SGD", {"lr": 0.1})` each `step` also zeroes the gradients
        first and takes an optimizer step after."""
        function = resolve(recipe)
        _check_importable(function)
        spec = (f"{function.__module__}:{function.__qualname__}", recipe_kwargs or {},
                self.stages if balance is None else balance, gpipe_options, optimizer)
        self._ask([("build", spec)] * self.stages)
        self.built = True

    def step(self, inputs, targets, loss_fn: Callable):
        """One training step of the pipe (gradients zeroed first; with an optimizer, also its step);
        returns the mini-batch loss. Then `self.trace` is the step's trace and `self.seconds` the
        step's time as rank 0 measured it."""
        self._require_built()
        _check_importable(loss_fn)
        commands = [("step", (inputs if rank == 0 else None, targets if rank == self.stages - 1 else None, loss_fn))
                    for rank in range(self.stages)]
        answers = self._ask(commands)
        self.trace = answers[0][1]
        self.losses = [answer[0] for answer in answers]  # as each rank returned it: all equal
        self.seconds = answers[0][2]  # the step as rank 0 timed it, without this process's hand-over
        return answers[0][0]

    def forward(self, inputs):
        """The pipe's forward pass; returns the output (from the last stage's process)."""
        self._require_built()
        answers = self._ask([("forward", (inputs if rank == 0 else None,)) for rank in range(self.stages)])
        self.trace = answers[0][1]
        return answers[-1][0]

    def parameters(self) -> list[torch.Tensor]:
        """Copies of the model's parameters, in the model's order."""
        return self._by_chunk("parameters")

    def gradients(self) -> list[Optional[torch.Tensor]]:
        """Copies of the parameters' gradients after the last step, in the model's order."""
        return self._by_chunk("gradients")

    def buffers(self) -> list[torch.Tensor]:
        """Copies of the model's buffers (batch norm statistics), in the model's order."""
        return self._by_chunk("buffers")

    def _by_chunk(self, what: str) -> list:
        """Each process's tensors of `what`, per chunk of layers it holds, put in the model's order
        (a stage holds chunks k, k+K, ... when stages hold several)."""
        self._require_built()
        per_chunk = {chunk: tensors for answer in self._ask([(what, ())] * self.stages) for chunk, tensors in answer}
        return [t for chunk in sorted(per_chunk) for t in per_chunk[chunk]]

    def kill(self, stage: int) -> None:
        """Kill one stage process at once (SIGKILL), as a crash would: for tests and lessons."""
        os.kill(self._processes[stage].pid, signal.SIGKILL)

    def close(self) -> None:
        """Stop every stage process; none is left behind."""
        self._finalizer()

    def __enter__(self) -> "ProcessPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- internals -----------------------------------------------------------------------------

    def _require_built(self) -> None:
        if not self.built:
            raise RuntimeError("the pool has no pipe yet: call pool.build(recipe, ...) first")

    def _ask(self, commands: list, timeout: Optional[float] = None) -> list:
        """Send each process its command and wait for all answers. A failure in a stage is raised
        with its own type (the failing rank's report, not the others' echoes of it); a process that
        dies or stays silent past the timeout closes the pool and raises StageProcessError."""
        if not self._finalizer.alive:
            raise StageProcessError("the process pool is closed (after close(), or after a stage process died); "
                                    "make a new ProcessPool")
        try:
            for connection, command in zip(self._connections, commands):
                connection.send(command)
        except (BrokenPipeError, OSError):
            self._fail(None)
        answers: dict[int, tuple] = {}
        deadline = time.monotonic() + (timeout or self.timeout)
        while len(answers) < self.stages:
            waiting = {connection: rank for rank, connection in enumerate(self._connections) if rank not in answers}
            for connection in wait(list(waiting), timeout=0.1):
                try:
                    answers[waiting[connection]] = connection.recv()
                except (EOFError, OSError):
                    self._fail(waiting[connection])
            dead = [rank for rank, p in enumerate(self._processes) if not p.is_alive() and rank not in answers]
            if dead:
                self._fail(dead[0])
            if time.monotonic() > deadline:
                self._fail(None, timed_out=True)
        failures = {rank: answer for rank, answer in answers.items() if answer[0] == "error"}
        if failures:
            raise _first_failure(failures)
        return [answers[rank][1] for rank in range(self.stages)]

    def _fail(self, rank: Optional[int], timed_out: bool = False):
        if rank is not None:
            self._processes[rank].join(timeout=1)
        codes = {r: p.exitcode for r, p in enumerate(self._processes) if p.exitcode is not None}
        self.close()
        if timed_out:
            raise StageProcessError(f"the stage processes did not answer within {self.timeout:.0f} s; the pool "
                                    f"was closed")
        which = f"stage {rank}'s process" if rank is not None else "a stage process"
        raise StageProcessError(f"{which} died (exit codes {codes or 'unknown'}); the pool was closed and no "
                                f"stage process is left: make a new ProcessPool")


def _first_failure(failures: dict) -> BaseException:
    """The failing rank's own exception (its type when it can be imported here), else the first
    echo of a failure elsewhere."""
    own = [answer for answer in failures.values() if answer[1] != ("engine.transport", "StageFailed")]
    _, (module, name), message = (own or list(failures.values()))[0]
    try:
        kind = getattr(importlib.import_module(module), name)
        return kind(message)
    except Exception:
        return RuntimeError(f"{name}: {message}")


def _shut_down(processes, connections) -> None:
    """Ask every stage process to stop, then kill what is still there."""
    for connection in connections:
        try:
            connection.send(("stop", ()))
        except (BrokenPipeError, OSError):
            pass
    deadline = time.monotonic() + 5
    for process in processes:
        process.join(timeout=max(0.1, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(timeout=5)
    for connection in connections:
        connection.close()


# --- inside a stage process -------------------------------------------------------------------

def _die_with_parent(parent: int) -> None:
    """End this process soon after the process that started it is gone (then this one's parent
    changes). A thread watches, rather than Linux's parent-death signal, which fires when the
    parent's *thread* that started us ends: the app starts pools from short-lived script threads."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)
    threading.Thread(target=watch, name="gpipe-parent-watch", daemon=True).start()


def _serve(rank: int, size: int, port: int, connection, threads: int, keep_freed_memory: bool,
           parent: int) -> None:
    """A stage process: join the group, then answer commands until told to stop."""
    _die_with_parent(parent)
    import torch.distributed as dist

    from .device import keep_freed_cpu_memory

    if keep_freed_memory:
        keep_freed_cpu_memory()
    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=START_SECONDS))
    dist.init_process_group("gloo", store=dist.PrefixStore("pool/", store), rank=rank, world_size=size)
    pipe, optimizer = None, None
    try:
        while True:
            try:
                command, args = connection.recv()
            except (EOFError, OSError):
                return  # the parent is gone
            if command == "stop":
                return
            try:
                if command == "ready":
                    answer = None
                elif command == "build":
                    if pipe is not None:
                        pipe.close()
                    pipe, optimizer = _build(*args, threads=threads)
                elif command == "step":
                    inputs, targets, loss_fn = args
                    if optimizer is not None:
                        optimizer.zero_grad()
                    else:
                        pipe.zero_grad()
                    start = time.perf_counter()
                    loss = pipe.step(inputs, targets, loss_fn)
                    seconds = time.perf_counter() - start
                    if optimizer is not None:
                        optimizer.step()
                    answer = (loss.detach().cpu(), pipe.trace if rank == 0 else None, seconds)
                elif command == "forward":
                    out = pipe(*args)
                    answer = (None if out is None else out.detach().cpu(), pipe.trace if rank == 0 else None)
                elif command in ("parameters", "gradients", "buffers"):
                    answer = [(chunk, _copies(partition, command))
                              for chunk, partition in zip(pipe.local_chunks, pipe.partitions)]
                else:
                    raise ValueError(f"unknown command {command!r}")
                connection.send(("ok", answer))
            except Exception as error:  # reported to the parent, which raises it; keep serving
                connection.send(("error", (type(error).__module__, type(error).__qualname__), str(error)))
    finally:
        if pipe is not None:
            pipe.close()
        dist.destroy_process_group()


def _copies(partition: torch.nn.Module, what: str) -> list:
    """Copies, on the CPU, of a partition's parameters, their gradients, or its buffers."""
    if what == "buffers":
        return [b.detach().cpu().clone() for b in partition.buffers()]
    tensors = [p if what == "parameters" else p.grad for p in partition.parameters()]
    return [None if t is None else t.detach().cpu().clone() for t in tensors]


def _build(recipe: str, recipe_kwargs: dict, balance, options: dict, optimizer, threads: int):
    from .pipe import GPipe
    import torch.distributed as dist

    model = resolve(recipe)(**recipe_kwargs)
    pipe = GPipe(model, balance, group=dist.group.WORLD, **{"threads_per_stage": threads, **options})
    if optimizer is None:
        return pipe, None
    kind, settings = optimizer
    return pipe, resolve(kind if ":" in str(kind) else str(kind).replace("torch.optim.", "torch.optim:"))(
        pipe.parameters(), **settings)

