"""Waiting on the host for torch.distributed works, looking for failures meanwhile.

NCCL's `work.wait()` returns at once (it only makes a stream wait), and a gloo collective's blocks
blind; polling `is_completed()` serves both. Not for gloo's point-to-point works, whose
`is_completed()` stays False.
"""
from __future__ import annotations

import time
from typing import Callable


def until_completed(works: list, check: Callable[[], None] = lambda: None, every: float = 0.05,
                    pause_cap: float = 1e-4) -> None:
    """Return once every work completed (well or not), calling `check` every `every` seconds; pauses
    stay short: a GPU stage waits here for data it needs now."""
    pause, next_check = 1e-6, time.monotonic() + every
    for work in works:
        while not work.is_completed():
            if time.monotonic() >= next_check:
                check()
                next_check = time.monotonic() + every
            time.sleep(pause)
            pause = min(2 * pause, pause_cap)
