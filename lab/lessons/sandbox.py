"""Running the learner's code: bounded in CPU seconds and in wall seconds, its prints kept, stopped
without leaving a thread behind whatever it does."""
from __future__ import annotations

import contextlib
import ctypes
import io
import itertools
import sys
import threading
import time
from collections.abc import Iterator
from typing import Callable, Optional

from lab.lessons.feedback import SAYS, Feedback, NotAttempted, attempted


def called(fn: Callable, *args, returns: bool = True, within: Callable = contextlib.nullcontext):
    """fn(*args), the learner's function (bounded in time, inside `within()`: `_bounded`): an
    exception in it becomes feedback that names it; with `returns`, a result of None or `...` means
    the answer is not written yet."""
    attempted(fn, "the cell")
    if not callable(fn) or isinstance(fn, type):
        raise Feedback(f"expected a function, got {type(fn).__name__}: {SAYS['not a function']}")
    printed = _Printed(sys.stdout)
    try:
        with contextlib.redirect_stdout(printed):
            result = _bounded(lambda *given: _eager(fn(*given)), args, within)
    except KeyboardInterrupt:
        raise
    except _TookTooLong:
        raise Feedback(f"{call_text(fn, args)} did not return within {CALL_SECONDS:g} s of computing (or "
                       f"{WAIT_SECONDS:g} s in all): {SAYS['too long']}") from None
    except _Endless:
        raise Feedback(f"{call_text(fn, args)} returned an iterator of more than {MOST_ITEMS:,} items: "
                       f"{SAYS['endless']}") from None
    except BaseException as error:  # SystemExit, GeneratorExit...: whatever the learner's code raised
        raise Feedback(f"{call_text(fn, args)} raised {type(error).__name__}: {error}. {SAYS['raised']}") from None
    if returns and result is None and printed.wrote:
        raise Feedback(f"{call_text(fn, args)} returned None: {SAYS['printed']}")
    if returns and (result is None or result is Ellipsis):
        raise NotAttempted(f"{call_text(fn, args)} returned {result!r}: replace the `...` in it with your answer "
                           f"(and return it), run that cell, then this one")
    return result


class _Printed(io.TextIOBase):
    """Standard output while a learner's function runs: passed on as it is, and noted, so that a
    function that prints its answer instead of returning it is told so."""

    def __init__(self, out):
        self.out, self.wrote = out, False

    def write(self, text: str) -> int:
        self.wrote = self.wrote or bool(text.strip())
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


CALL_SECONDS = 5.0    # CPU seconds a learner's function may run before it is stopped and told so
WAIT_SECONDS = 20.0   # and seconds it may take in all (a loop that sleeps, a lock that never comes)
MOST_ITEMS = 100_000  # items a returned iterator may yield before it is taken for one that never ends


class _Endless(Exception):
    """A learner's function returned an iterator longer than MOST_ITEMS (an endless generator)."""


def _eager(value, depth: int = 2):
    """`value` with its iterators (a generator, map, zip), and those in a list it is, made lists while
    the bound still holds: a check that lists a lazy result later would wait on it unbounded."""
    if depth == 0:
        return value
    if isinstance(value, Iterator):
        value = list(itertools.islice(value, MOST_ITEMS + 1))
        if len(value) > MOST_ITEMS:
            raise _Endless
    return type(value)(_eager(item, depth - 1) for item in value) if type(value) in (list, tuple) else value


class _TookTooLong(BaseException):
    """Raised inside a learner's function that ran past its bound (a BaseException, so that an
    `except Exception` in the learner's loop does not swallow it)."""


def _bounded(fn: Callable, args: tuple, within: Callable = contextlib.nullcontext):
    """fn(*args) in a thread of its own (inside `within()`, for what is per thread, such as saved-
    tensor hooks), given up once it has used CALL_SECONDS of its CPU time (so a busy host does not
    stop a slow right answer) or WAIT_SECONDS in all: _TookTooLong is raised in it, which stops a loop
    between two bytecodes, and a call blocked for good (a lock, a queue) is left behind, asleep."""
    outcome: list = []
    clock: list = []   # the worker's CPU clock, read by the worker itself while it lives

    def run() -> None:
        clock.append(time.pthread_getcpuclockid(threading.get_ident()))
        try:
            with within():
                outcome.append((True, fn(*args)))
        except BaseException as error:  # whatever the learner's code raised, _TookTooLong included
            outcome.append((False, error))
    worker = threading.Thread(target=run, name="gpipe-learner-answer", daemon=True)
    worker.start()
    start = time.monotonic()

    def cpu_used() -> float:
        try:
            return time.clock_gettime(clock[0]) if clock else 0.0
        except OSError:  # it ended meanwhile
            return 0.0
    try:
        while worker.is_alive() and cpu_used() < CALL_SECONDS and time.monotonic() - start < WAIT_SECONDS:
            worker.join(0.02)
    except BaseException:  # Ctrl-C (the kernel's interrupt) in the check: stop the answer too
        _stop(worker, KeyboardInterrupt)
        raise
    if worker.is_alive():
        _stop(worker, _TookTooLong)
        if not outcome:
            raise _TookTooLong()
    finished, value = outcome[0]
    if not finished:
        raise value
    return value


def _raise_in(thread: threading.Thread, error: Optional[type]) -> None:
    """Raise `error` in `thread` at its next bytecode (None: withdraw what is pending there)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                               None if error is None else ctypes.py_object(error))


class _Absorbed(BaseException):
    """Raised in a helper thread only to take the interpreter's pending-exception signal (_stop)."""


def _stop(worker: threading.Thread, error: type) -> None:
    """Raise `error` in `worker`; if it is blocked for good (no bytecode runs to receive it), withdraw
    it. An exception left pending on a blocked thread keeps the interpreter's signal up, and on
    CPython 3.11 any thread that runs under a profile or trace function (a debugger, coverage,
    lab.engine_time.host_time's counts) then loops for ever on its next call. Withdrawing it leaves the signal
    up too; only a thread that receives one of its own takes it down, so a helper does."""
    _raise_in(worker, error)
    worker.join(1.0)
    if not worker.is_alive():
        return
    _raise_in(worker, None)

    inside = threading.Event()

    def absorb() -> None:
        try:
            inside.set()
            while True:
                time.sleep(0.001)
        except _Absorbed:
            pass
    helper = threading.Thread(target=absorb, name="gpipe-signal-taker", daemon=True)
    helper.start()
    inside.wait()
    _raise_in(helper, _Absorbed)
    helper.join(5.0)


def call_text(fn: Callable, args: tuple) -> str:
    name = getattr(fn, "__name__", type(fn).__name__)
    return f"{name}({', '.join(repr(a) if isinstance(a, (int, float, list)) else type(a).__name__ for a in args)})"


