"""Waiting on the host for torch.distributed works (collectives, sends, receives).

NCCL's `work.wait()` only makes a CUDA stream wait and returns at once, so the host cannot tell
from it that the data has arrived, nor that a buffer may be released; a gloo collective's blocks
without a way to look for failures elsewhere. Polling `is_completed()` serves both. Not for gloo's
point-to-point sends and receives: their `is_completed()` stays False (only `wait()` finishes them).
"""
from __future__ import annotations

import time
from typing import Callable


def until_completed(works: list, check: Callable[[], None] = lambda: None, every: float = 0.05,
                    pause_cap: float = 1e-4) -> None:
    """Return once every work has completed (successfully or not: `work.wait()` then raises its
    error), calling `check` every `every` seconds meanwhile (it raises if a failure was reported
    elsewhere). The pause between looks stays short: a GPU stage waits here for data it needs now."""
    pause, next_check = 1e-6, time.monotonic() + every
    for work in works:
        while not work.is_completed():
            if time.monotonic() >= next_check:
                check()
                next_check = time.monotonic() + every
            time.sleep(pause)
            pause = min(2 * pause, pause_cap)
