"""The lab's stage processes: one local ProcessPool, shared by every run that asks for stages as
processes (notebooks and every session of the app).

Starting K processes costs seconds, so the pool stays up between runs and is made again only
when K (or the threads per stage) changes, or after it failed; the app starts it ahead of its
first run (`start_ahead`). A K=1 baseline needs no pool: one stage is this process, one thread.
One run uses it at a time: a run that finds it busy waits its turn (and says so through
`on_wait`). It is shut down when the interpreter exits, and its processes die with this one in any
case.
"""
from __future__ import annotations

import atexit
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

from lab.processes.pool import ProcessPool, StageProcessError

_turn = threading.Lock()
_pool: Optional[ProcessPool] = None
_shape: tuple = ()  # (stages, threads per stage, device) of the pool that is up
_holder = ""  # who holds the turn: "a run", or "start-up" (a pool started ahead of its first run)


def busy() -> bool:
    """Whether a run is using the shared pool now."""
    return _turn.locked()


@contextmanager
def pool_for(stages: int, threads_per_stage: int = 1, on_wait: Optional[Callable[[], None]] = None,
             device: str = "cpu") -> Iterator[ProcessPool]:
    """Hold the shared pool, with `stages` processes computing on `device` ("cpu", or "cuda": a GPU
    each, NCCL between them where there are enough GPUs), for one run. If another run holds it, call
    `on_wait()` once and wait. A stage process that died, during this run or since the last, is
    raised as StageProcessError; the next run starts new processes."""
    global _holder
    if not _turn.acquire(blocking=False):
        if on_wait is not None and _holder == "a run":
            on_wait()
        _turn.acquire()
    _holder = "a run"
    try:
        if _pool is not None:
            _pool.check_alive()  # a stage process that died since the last run is reported, once
        yield _pool_of(stages, threads_per_stage, device)
    except StageProcessError:
        shutdown_pool()
        raise
    finally:
        _turn.release()


def start_ahead(stages: int, threads_per_stage: int = 1, device: str = "cpu") -> None:
    """Start the shared pool with `stages` processes now, on a thread of its own, unless it is up
    or being used: a page's first run then finds its stage processes starting or started (and
    waits for them without being told that another session holds them)."""
    def start() -> None:
        global _holder
        if not _turn.acquire(blocking=False):
            return
        if _pool is not None and not _pool.alive:  # a stage process died: the next run reports it, then rebuilds
            _turn.release()
            return
        _holder = "start-up"
        try:
            _pool_of(stages, threads_per_stage, device)
        except StageProcessError:
            shutdown_pool()  # the run that needs it will start new ones, and say why if it fails again
        finally:
            _turn.release()
    threading.Thread(target=start, name="gpipe-pool-start", daemon=True).start()


def _pool_of(stages: int, threads_per_stage: int, device: str = "cpu") -> ProcessPool:
    """The shared pool with that shape, made anew if it has another shape or is gone (turn held)."""
    global _pool, _shape
    if _pool is None or not _pool.alive or _shape != (stages, threads_per_stage, device):
        shutdown_pool()
        _pool = ProcessPool(stages, threads_per_stage=threads_per_stage, device=device)
        _shape = (stages, threads_per_stage, device)
    return _pool


def current() -> Optional[ProcessPool]:
    """The shared pool if one is up (for tests and lessons that look at its processes)."""
    return _pool


def shutdown_pool() -> None:
    """Stop the shared pool's processes, if any."""
    global _pool
    if _pool is not None:
        _pool.close()
        _pool = None


def free_gpus() -> None:
    """Free what the shared pool holds on its GPUs once no run holds it (its stage processes drop
    their pipe and stay up for the next run of the same shape): for a caller that needs the GPUs'
    memory (the GPU table, before each cell), without stopping another session's run midway."""
    with _turn:
        if _pool is not None and _pool.alive:
            try:
                _pool.release()
            except StageProcessError:  # the next run reports it and starts new processes
                shutdown_pool()


atexit.register(shutdown_pool)
