"""Waiting on the host, always with a bound: for torch.distributed works, Store keys and set-ups.

NCCL's `work.wait()` returns at once, and a gloo collective's blocks blind; polling `is_completed()`
serves both, but not gloo's point-to-point works (it stays False): those wait with gloo's own
timeout, which closes the pair. docs/processes.md lists every bound.
"""
from __future__ import annotations

import datetime
import os
import threading
import time
from typing import Callable, Optional, TypeVar

from ..transport import StageFailed

TRANSFER_FLOOR = 120.0      # seconds any one transfer may take, at least (GPIPE_TRANSFER_SECONDS overrides)
SLOWEST_LINK = 100e6        # bytes/s a transfer is allowed beyond the floor: a 1 Gb/s Ethernet link
SETUP_SECONDS = 600.0       # making a pipe's lane: the ranks' meeting, groups, NCCL's communicators
                            # (GPIPE_SETUP_SECONDS overrides)
WAIT_SECONDS = 1800.0       # a call's wait for a message no rank sends (GPIPE_WAIT_SECONDS), as gloo's default
Result = TypeVar("Result")


class Stalled(TimeoutError):
    """A transfer outlasted its bound; the message says which, to whom, and how long it waited."""


def seconds_from(variable: str, default: float) -> float:
    """A bound in seconds from the environment variable `variable`, else `default`."""
    asked = os.environ.get(variable)
    if asked is None:
        return default
    try:
        seconds = float(asked)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{variable}={asked!r}: expected a number of seconds above 0")
    return seconds


def in_seconds(seconds: float) -> str:
    """A wait's length as a report says it: "3.0 s", "120 s"."""
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"


def transfer_bound(nbytes: int) -> float:
    """The longest one transfer of `nbytes` may take before its wait gives up: a floor for latency
    and a sender's queued work, plus its bytes over the slowest link."""
    return seconds_from("GPIPE_TRANSFER_SECONDS", TRANSFER_FLOOR) + nbytes / SLOWEST_LINK


def progress_bound(nbytes: int) -> float:
    """The longest a wait on another rank's progress, then a transfer of `nbytes`, may take."""
    return wait_bound() + transfer_bound(nbytes)


def wait_bound() -> float:
    """The longest a stage waits, within a call, for a message (its header) before the call fails."""
    return seconds_from("GPIPE_WAIT_SECONDS", WAIT_SECONDS)


def setup_bound() -> float:
    """The longest a pipe's lane may take to be made, every rank together."""
    return seconds_from("GPIPE_SETUP_SECONDS", SETUP_SECONDS)


def gloo_timeout(seconds: float) -> datetime.timedelta:
    """A gloo work's wait timeout: past it gloo raises and closes the connection to the peer."""
    return datetime.timedelta(seconds=seconds)


def until_completed(works: list, check: Callable[[], None] = lambda: None, every: float = 0.05,
                    pause_cap: float = 1e-4, within: Optional[float] = None, what: str = "") -> None:
    """Return once every work completed (well or not), calling `check` every `every` seconds (a
    failure elsewhere raises from there); past `within` seconds, Stalled naming `what`. Pauses stay
    short: a GPU stage waits here for data it needs now."""
    start = time.monotonic()
    pause, next_check = 1e-6, start + every
    for work in works:
        while not work.is_completed():
            now = time.monotonic()
            if now >= next_check:
                check()
                if within is not None and now - start > within:
                    raise Stalled(f"waited {in_seconds(within)} for {what}, its bound")
                next_check = time.monotonic() + every
            time.sleep(pause)
            pause = min(2 * pause, pause_cap)


def gloo_waited(work, seconds: float, what: str) -> None:
    """Wait for a gloo point-to-point work at most `seconds` (gloo then closes the pair): Stalled
    naming `what` past it, the work's own error before it."""
    since = time.monotonic()
    try:
        work.wait(gloo_timeout(seconds))
    except Exception:
        if time.monotonic() - since < seconds:
            raise
        raise Stalled(f"waited {in_seconds(seconds)} for {what}, its bound") from None


def finished_within(seconds: float, what: str, work: Callable[[], Result], check: Callable[[], None] = lambda: None,
                    every: float = 0.05) -> Result:
    """`work()`'s result, run on a daemon thread the caller can give up on (NCCL making a communicator
    has no bound short of its group's timeout), calling `check` every `every` seconds; past
    `seconds`, StageFailed naming `what`."""
    done, box = threading.Event(), {}

    def run() -> None:
        try:
            box["result"] = work()
        except BaseException as error:  # raised on the caller's thread
            box["error"] = error
        finally:
            done.set()
    threading.Thread(target=run, daemon=True, name="gpipe-setup").start()
    deadline = time.monotonic() + seconds
    while not done.wait(every):
        check()
        if time.monotonic() > deadline:
            raise StageFailed(f"{what} did not finish within {seconds:g} s; has a rank died or stopped?")
    if "error" in box:
        raise box["error"]
    return box["result"]


def keys_within(store, keys: list[str], seconds: float, what: str, check: Callable[[], None] = lambda: None) -> None:
    """Return once every key is in `store`, calling `check`; past `seconds`, StageFailed naming the missing."""
    pause, deadline, next_check = 1e-3, time.monotonic() + seconds, time.monotonic() + 0.05
    while not store.check(keys):
        if time.monotonic() >= next_check:
            check()
            next_check = time.monotonic() + 0.05
        if time.monotonic() > deadline:
            missing = [key for key in keys if not store.check([key])]
            raise StageFailed(f"{what}: {missing} not in the Store within {seconds:g} s; has a rank died or stopped?")
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
