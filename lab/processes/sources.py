"""Where a run's stage processes come from (`pools=` of lab.runs.experiments.run): a pool of the
run's own, started for it and stopped after it (OWN, the default), or the lab's shared pool, kept up
between runs (SHARED: the app's sessions and the speedup tables, whose runs would each start one)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, ContextManager, Iterator, Optional, Protocol

from lab.processes import shared
from lab.processes.pool import ProcessPool


class Pools(Protocol):
    """A source of stage processes for one run at a time."""

    def hold(self, stages: int, threads_per_stage: int = 1, on_wait: Optional[Callable[[], None]] = None,
             device: str = "cpu") -> ContextManager[ProcessPool]:
        """A pool of `stages` processes for the length of a run (`on_wait()` if it must wait for it)."""

    def free_gpus(self) -> None:
        """Free what holds the GPUs' memory between runs, for a run that needs it alone."""


class OwnPools:
    """A pool started for each run and stopped after it: nothing is shared, nothing waits."""

    @contextmanager
    def hold(self, stages: int, threads_per_stage: int = 1, on_wait: Optional[Callable[[], None]] = None,
             device: str = "cpu") -> Iterator[ProcessPool]:
        with ProcessPool(stages, threads_per_stage=threads_per_stage, device=device) as pool:
            yield pool

    def free_gpus(self) -> None:
        """Nothing to stop: a run's own pool is gone when the run ends."""


class SharedPools:
    """The lab's one shared pool (lab.processes.shared), held by one run at a time."""

    def hold(self, stages: int, threads_per_stage: int = 1, on_wait: Optional[Callable[[], None]] = None,
             device: str = "cpu") -> ContextManager[ProcessPool]:
        return shared.pool_for(stages, threads_per_stage, on_wait, device)

    def free_gpus(self) -> None:
        shared.free_gpus()


OWN, SHARED = OwnPools(), SharedPools()
