"""The lab's stage processes: one local ProcessPool, shared by every run that asks for stages as
processes (notebooks and every session of the app).

Starting K processes costs seconds, so the pool stays up between runs and is made again only
when K (or the threads per stage) changes, or after it failed. One run uses it at a time: a run
that finds it busy waits its turn (and says so through `on_wait`). It is shut down when the
interpreter exits, and its processes die with this one in any case.
"""
from __future__ import annotations

import atexit
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

from engine.distributed.pool import ProcessPool, StageProcessError

_turn = threading.Lock()
_pool: Optional[ProcessPool] = None
_shape: tuple[int, int] = (0, 0)


def busy() -> bool:
    """Whether a run is using the shared pool now."""
    return _turn.locked()


@contextmanager
def pool_for(stages: int, threads_per_stage: int = 1, on_wait: Optional[Callable[[], None]] = None
             ) -> Iterator[ProcessPool]:
    """Hold the shared pool, with `stages` processes, for one run. If another run holds it, call
    `on_wait()` once and wait. A stage process that died, during this run or since the last, is
    raised as StageProcessError; the next run starts new processes."""
    global _pool, _shape
    if not _turn.acquire(blocking=False):
        if on_wait is not None:
            on_wait()
        _turn.acquire()
    try:
        if _pool is not None:
            _pool.check_alive()  # a stage process that died since the last run is reported, once
        if _pool is None or not _pool.alive or _shape != (stages, threads_per_stage):
            shutdown_pool()
            _pool = ProcessPool(stages, threads_per_stage=threads_per_stage)
            _shape = (stages, threads_per_stage)
        yield _pool
    except StageProcessError:
        shutdown_pool()
        raise
    finally:
        _turn.release()


def current() -> Optional[ProcessPool]:
    """The shared pool if one is up (for tests and lessons that look at its processes)."""
    return _pool


def shutdown_pool() -> None:
    """Stop the shared pool's processes, if any."""
    global _pool
    if _pool is not None:
        _pool.close()
        _pool = None


atexit.register(shutdown_pool)
