"""Running a schedule: one worker thread per stage, failures reported to the caller promptly.

Each stage has a long-lived worker thread (a new thread per step would pay the CPU math
libraries' per-thread start-up, milliseconds, on every step). For each call the caller hands
every worker its stage's task list, then waits: it passes finished-task events to an optional
callback as they arrive and, on the first failure, aborts every worker, waits until all have
stopped, and re-raises the original exception with the stage, task and micro-batch named.
Workers end when their pipe is closed or garbage-collected.
"""
from __future__ import annotations

import queue
import threading
import weakref
from functools import partial
from typing import Callable, Optional

from .schedule import Task, timeline, upstream
from .stage import Stage
from .trace import Event
from .transport import Aborted, StageFailed, ThreadTransport, message_key

class StageThreads:
    """K persistent worker threads, one per stage; each runs the jobs submitted to it in order."""

    def __init__(self, count: int):
        self._inboxes = [queue.SimpleQueue() for _ in range(count)]
        for k, inbox in enumerate(self._inboxes):
            threading.Thread(target=_serve, args=(inbox,), name=f"gpipe-stage-{k}", daemon=True).start()
        self.close = weakref.finalize(self, _stop, self._inboxes)  # on close() or garbage collection

    def submit(self, stage: int, job: Callable[[], None]) -> None:
        self._inboxes[stage].put(job)


def _serve(inbox: queue.SimpleQueue) -> None:
    while True:
        job = inbox.get()
        if job is None:
            return
        job()
        del job  # hold nothing of a finished call while idle


def _stop(inboxes) -> None:
    for inbox in inboxes:
        inbox.put(None)


def run_schedule(threads: StageThreads, chunks: dict[int, Stage], schedule: list[list[Task]],
                 on_event: Optional[Callable[[Event], None]] = None) -> list[Event]:
    """Run every stage's tasks on its worker thread; return the timed events of all tasks."""
    transport = ThreadTransport(chunks, len(schedule))
    reports: queue.SimpleQueue = queue.SimpleQueue()
    abort = threading.Event()
    marks: list[list] = [[] for _ in schedule]
    for k, tasks in enumerate(schedule):
        threads.submit(k, partial(_work, chunks, k, tasks, transport, reports, abort, marks[k],
                                  live=on_event is not None))
    failure, running = None, len(schedule)

    def stop_all() -> None:
        abort.set()
        transport.abort()

    try:
        while running:
            kind, payload = reports.get()
            if kind == "event" and on_event is not None:
                on_event(payload)
            elif kind in ("done", "failed"):
                running -= 1
                if kind == "failed" and failure is None:
                    failure = payload
                    stop_all()
    except BaseException:  # e.g. Ctrl-C while waiting, or a failing callback: stop the workers first
        stop_all()
        while running:
            running -= reports.get()[0] in ("done", "failed")
        raise
    if failure is not None:
        raise failure
    return _collect_events(chunks, marks, on_event)


def run_serially(chunks: dict[int, Stage], schedule: list[list[Task]],
                 on_event: Optional[Callable[[Event], None]] = None) -> list[Event]:
    """Run every task on the caller's thread, one at a time, in the order of the unit-cost diagram.

    Each task is then timed alone on the host; this is what an ideal replay needs on a host with
    fewer cores than stages, where concurrent tasks would time each other's sharing.
    """
    transport = ThreadTransport(chunks, len(schedule))
    marks: list[list] = [[] for _ in schedule]
    unit = timeline(schedule, lambda stage, task: 1.0)
    order = sorted((start, k, i) for k, times in enumerate(unit) for i, (start, _) in enumerate(times))
    for _, k, i in order:
        task = schedule[k][i]
        stage = chunks[task.chunk]
        try:
            with stage.device.enter():
                start, end = run_task(chunks, task, transport)
        except BaseException as exc:
            raise name_place(exc, k, task)
        marks[k].append((task, start, end))
        if on_event is not None and not stage.device.is_cuda:
            on_event(stage.event(task, start, end))
    return _collect_events(chunks, marks, on_event)


def run_stage(chunks: dict[int, Stage], worker: int, tasks: list[Task], transport,
              on_event: Optional[Callable[[Event], None]] = None, prefix: str = "") -> list[Event]:
    """Run one stage's task list on the calling thread: the stage of a process that runs one
    (`engine.rank`). A failure is re-raised with `prefix` (its rank) and its place in the message."""
    marks, task = [], None
    device = chunks[worker].device
    try:
        with device.enter():
            for task in tasks:
                start, end = run_task(chunks, task, transport)
                marks.append((task, start, end))
                if on_event is not None and not device.is_cuda:
                    on_event(chunks[task.chunk].event(task, start, end))
    except (Aborted, StageFailed):  # another stage's failure: named where it happened
        raise
    except BaseException as exc:
        raise name_place(exc, worker, task, prefix)
    return _collect_events(chunks, [marks], on_event)


def _collect_events(chunks: dict[int, Stage], marks: list[list], on_event) -> list[Event]:
    events = [chunks[task.chunk].event(task, a, b, timed=True) for stage_marks in marks for task, a, b in stage_marks]
    events.sort(key=lambda e: (e.start, e.stage))
    if on_event is not None and any(stage.device.is_cuda for stage in chunks.values()):
        for event in events:  # GPU times are known only once the step is over
            on_event(event)
    return events


def run_task(chunks: dict[int, Stage], task: Task, transport) -> tuple:
    """Wait for the task's input, run it on its chunk, hand its output on; return its (start, end)
    marks. `transport` is a ThreadTransport or a ProcessTransport: the same code runs either way."""
    stage = chunks[task.chunk]
    if upstream(task, stage.count) is not None:
        received = transport.receive(stage.worker, message_key(task))
    else:
        received = None
    start = stage.device.mark()  # after the input arrived: waiting is idle time, not work
    message = stage.run(task, received)
    end = stage.device.mark()
    if message is not None:  # sent after the end mark: the receiver never starts before it
        destination, key, value = message
        transport.send(stage.index, destination, key, value)
    return start, end


def _work(chunks: dict[int, Stage], worker: int, tasks: list[Task], transport: ThreadTransport,
          reports: queue.SimpleQueue, abort: threading.Event, marks: list, live: bool) -> None:
    """Run one stage's task list for one call, reporting events, completion or failure."""
    task = None
    device = chunks[worker].device
    try:
        with device.enter():
            for task in tasks:
                if abort.is_set():
                    raise Aborted()
                start, end = run_task(chunks, task, transport)
                marks.append((task, start, end))
                if live and not device.is_cuda:
                    reports.put(("event", chunks[task.chunk].event(task, start, end)))
        reports.put(("done", None))
    except Aborted:
        reports.put(("done", None))
    except BaseException as exc:  # reported to the caller, who re-raises it
        reports.put(("failed", name_place(exc, worker, task)))


OP_NAMES = {"F": "forward", "R": "recompute", "B": "backward", "W": "weight gradient"}


def place(stage: int, task: Optional[Task]) -> str:
    """'stage 2, micro-batch 0, forward (F0)': where in the pipeline a task runs (and its chunk, when
    the stage holds several)."""
    if task is None:
        return f"stage {stage}"
    chunk = f", chunk {task.chunk}" if task.chunk != stage else ""
    return f"stage {stage}, micro-batch {task.micro}, {OP_NAMES.get(task.op, task.op)} ({task}){chunk}"


def name_place(exc: BaseException, stage: int, task: Optional[Task], prefix: str = "") -> BaseException:
    """Put the stage, task and micro-batch (after `prefix`, such as "rank 1, ") in the exception's
    message, keeping its type."""
    where = prefix + place(stage, task)
    if exc.args and isinstance(exc.args[0], str):
        exc.args = (f"[{where}] {exc.args[0]}",) + exc.args[1:]
    else:
        exc.args = (f"[{where}] {exc}",)
    return exc
