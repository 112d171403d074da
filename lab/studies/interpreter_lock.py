"""Why stages as threads of one Python process overlap badly on small models: the interpreter
lock. Pure-Python work in two threads takes turns; in two processes it runs at once. Measured
here, not asserted: the same loop alone, in 2 threads and in 2 processes, over a few rounds."""
from __future__ import annotations

import threading
import time
from queue import SimpleQueue

from engine.device import cpu_cores
from lab.processes.children import Children


def spin(count: int) -> tuple[float, float]:
    """Pure-Python work (a counting loop); (start, end) on the monotonic clock every process shares."""
    start = time.perf_counter()
    total = 0
    for i in range(count):
        total += i
    return start, time.perf_counter()


def _spin_after(barrier, count: int, spans) -> None:
    """Wait for the other worker, then spin and put (start, end) into `spans`."""
    barrier.wait()
    spans.put(spin(count))


def spinner():
    """A child process's server: each command is a count to spin, the answer its (start, end)."""
    return spin


def _span(spans: list[tuple[float, float]]) -> float:
    """Seconds from the first start to the last end."""
    return max(e for _, e in spans) - min(s for s, _ in spans)


def python_in_parallel(count: int = 5_000_000, rounds: int = 5) -> dict:
    """Seconds the loop takes alone, in 2 threads of this process and in 2 spawned processes
    (from the first start to the last end), and each over alone: about 2 for threads on any host,
    about 1 for processes when the host has 2 free cores (the cores this process may use are
    reported too). The three run one after the other in each of `rounds` rounds, and each figure
    is its best (shortest) round: a busy moment of a shared host only ever slows a run (measured
    here: a single round of processes at 1.8x alone), while threads take turns in every round.
    "rounds" keeps each round's seconds in 2 threads and in 2 processes, for lab.timelines.verdict."""
    spin(count // 10)  # warm-up
    workers = Children(spinner, [()] * 2, name="spinner", timeout=120)
    try:
        workers.ask([count // 10] * 2)  # warm-up, and both are up before the measured runs
        measured = [_one_round(count, workers) for _ in range(rounds)]
    finally:
        workers.close()
    alone, in_threads, in_processes = (min(m[i] for m in measured) for i in range(3))
    return {"cores": cpu_cores(), "alone (s)": alone, "2 threads (s)": in_threads, "2 processes (s)": in_processes,
            "2 threads / alone": in_threads / alone, "2 processes / alone": in_processes / alone,
            "rounds": {"2 threads": [m[1] for m in measured], "2 processes": [m[2] for m in measured]}}


def _one_round(count: int, workers: Children) -> tuple[float, float, float]:
    """Seconds alone, in 2 threads and in the 2 worker processes."""
    start, end = spin(count)
    spans, barrier = SimpleQueue(), threading.Barrier(2)
    threads = [threading.Thread(target=_spin_after, args=(barrier, count, spans)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return end - start, _span([spans.get() for _ in threads]), _span(workers.ask([count] * 2))
