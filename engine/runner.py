"""Running a call's tasks: one task loop, driven by stage threads or, one task at a time, serially.

`run_tasks` is the only task loop: each task waits for its input, runs on its chunk, and hands its
output on through a transport. `ThreadRunner` gives every stage a long-lived worker thread (a new
thread per step would pay the CPU math libraries' per-thread start-up, milliseconds, on every
step) that runs its stage's list through that loop; the caller passes finished-task events to an
optional callback as they arrive and, on the first failure, stops every stage, waits until all
have stopped, and re-raises the original exception with the stage, task and micro-batch named.
Serially, the same loop runs every stage's tasks on the calling thread, in the order of the
unit-cost diagram, so that each task is timed alone. Stages in other processes run the same loop
(engine/distributed/runner.py).
"""
from __future__ import annotations

import functools
import queue
import threading
import time
import weakref
from contextlib import ExitStack, contextmanager, suppress
from typing import Callable, ContextManager, Iterable, Optional, Protocol

from .call import Call, Decision
from .schedule import Task, timeline, upstream
from .stages import LocalStages
from .trace import Event, Trace
from .transport import Aborted, StageFailed, ThreadTransport, message_key

EventCallback = Optional[Callable[[Event], None]]
Mark = tuple  # (task, start mark, end mark)


class Runner(Protocol):
    """What GPipe asks of the stages of a call, wherever they run: ThreadRunner (here) or RankRunner
    (engine/distributed/runner.py, one stage per process)."""

    origin: float                    # the current call's time origin, a perf_counter reading
    replicas: object                 # the data-parallel replicas, or None

    def calling(self) -> ContextManager: ...                    # the scope of one call
    def agree(self, decision: Optional[Decision]) -> Decision: ...  # the first stage's decision, everywhere
    # run gives (result, () -> trace)
    def run(self, call: Call, on_event: EventCallback = None, serial: bool = False) -> tuple: ...
    def close(self) -> None: ...                                # stop threads, transports, groups


def run_tasks(local: LocalStages, work: Iterable[tuple[int, Task]], transport,
              on_mark: Optional[Callable[[int, Task, object, object], None]] = None, prefix: str = "",
              settle: bool = False, gate: bool = False) -> list[Mark]:
    """Run `work`, (stage, task) pairs, in order on the calling thread, each under its stage's device
    setup; return their (task, start, end) marks. `on_mark(stage, task, start, end)` is told of each
    as it ends. `settle` waits for each task's GPU work before the next starts (a serial run), `gate`
    holds its kernels until the host has issued them all (StageDevice.hold). A
    failure is re-raised with `prefix` and its place in the message; Aborted (another stage failed)
    is passed on as it is."""
    marks: list[Mark] = []
    current, setup, stage, task = None, ExitStack(), None, None
    try:
        for stage, task in work:
            transport.check()
            if stage != current:
                setup.close()
                setup, current = local.devices[stage].enter(), stage
            chunk = local.chunks[task.chunk]
            received = chunk.device.receive(transport.receive(stage, message_key(task))) \
                if upstream(task, chunk.count) else None
            if gate:  # on CUDA the task's kernels wait until the host has issued them all
                chunk.device.hold()
            start = chunk.device.mark()  # after the input arrived (on CUDA: after the stream's wait for
            message = chunk.run(task, received)  # it is queued), so waiting is idle time, not work
            end = chunk.device.mark()
            if gate:  # the gate learns whether it held until the host had issued the task
                chunk.device.settle(start, end)
            elif settle:
                chunk.device.settle()
            if message is not None:  # (destination, key, value), sent after the end mark: the receiver
                transport.send(chunk.index, *message)  # never starts before it
            marks.append((task, start, end))
            if on_mark is not None:
                on_mark(stage, task, start, end)
    except (Aborted, StageFailed):  # another stage failed: named where it happened
        raise
    except BaseException as exc:
        raise name_place(exc, stage, task, prefix)  # noqa: B904 (it is exc itself, renamed in place)
    finally:
        setup.close()
    return marks


def events_of(local: LocalStages, marks: list[Mark], on_event: EventCallback) -> Callable[[], list[Event]]:
    """A function giving the timed events of a call's marks, in start order. On CUDA they are read
    now (the times are known only once the GPU is waited for, against this call's origin), so the
    callback hears of them now rather than live; CPU times are plain numbers, made into events when
    first asked for (a trace nobody reads makes none)."""
    def read() -> list[Event]:
        events = [local.chunks[task.chunk].event(task, a, b, timed=True) for task, a, b in marks]
        return sorted(events, key=lambda e: (e.start, e.stage))
    if not any(device.is_cuda for device in local.devices.values()):
        return functools.cache(read)
    events = read()
    if on_event is not None:
        for event in events:
            on_event(event)
    return lambda: events


def call_shape(call: Call, kind_prefix: str = "") -> dict:
    """What a call's trace says of the call itself (Trace's fields)."""
    return dict(micro_batches=call.micro_batches, batch_size=call.decision.batch, checkpoint=call.checkpoint,
                kind=kind_prefix + call.kind)


def live(local: LocalStages, on_event: EventCallback):
    """An `on_mark` that hands each CPU task's event to `on_event` as it ends (None if no callback)."""
    if on_event is None:
        return None

    def on_mark(stage: int, task: Task, start, end) -> None:
        if not local.devices[stage].is_cuda:
            on_event(local.chunks[task.chunk].event(task, start, end))
    return on_mark


class ThreadRunner:
    """Runs every stage of a call in this process: on K worker threads, or serially on the caller's."""

    replicas = None  # data parallelism needs stages as processes (engine/distributed/runner.py)

    def __init__(self, local: LocalStages, stages: int):
        self.local, self.stages = local, stages
        self.origin = 0.0  # perf_counter at the start of the current (or last) call: events count from it
        self._threads: Optional[StageThreads] = None

    @contextmanager
    def calling(self):
        """The scope of one call: whatever happens, the call's state is dropped at its end."""
        try:
            yield
        finally:
            self.local.finish()

    def agree(self, decision: Decision) -> Decision:
        """Every stage is here: the first stage's decision is everyone's."""
        return decision

    def run(self, call: Call, on_event: EventCallback = None, serial: bool = False):
        """Run the call's tasks; return its result and a function that builds its trace."""
        t0 = self.origin = self.local.start(call)
        transport = ThreadTransport(self.local.chunks, self.stages)
        try:
            if serial:
                unit = timeline(call.schedule, lambda stage, task: 1.0)
                order = sorted((start, k, i) for k, times in enumerate(unit) for i, (start, _) in enumerate(times))
                marks = run_tasks(self.local, [(k, call.schedule[k][i]) for _, k, i in order], transport,
                                  live(self.local, on_event), settle=True, gate=serial == "gated")
            else:
                if self._threads is None:
                    self._threads = StageThreads(self.stages)
                marks = self._threads.run(self.local, call.schedule, transport, on_event)
        except BaseException:
            with suppress(Exception):  # the failed call's GPU work ends before its state is dropped
                self.local.settle()
            raise
        self.local.settle()
        wall = time.perf_counter() - t0
        result = self.local.conclude(call)
        memory = [self.local.memory(stage) for stage in self.local.devices]  # now: grads and ledgers change later
        events = events_of(self.local, marks, on_event)
        shape = call_shape(call, "serial " if serial else "")  # not the call: it holds the inputs

        def trace() -> Trace:  # built when read: a step nobody looks at does not pay for it
            return Trace(stages=self.stages, **shape, memory=memory, wall=wall, events=events())
        return result, trace

    def close(self) -> None:
        """Stop the worker threads now; a later call starts new ones."""
        if self._threads is not None:
            self._threads.close()
            self._threads = None


class StageThreads:
    """K persistent worker threads, one per stage; each runs the jobs submitted to it in order."""

    def __init__(self, count: int):
        self._inboxes = [queue.SimpleQueue() for _ in range(count)]
        for k, inbox in enumerate(self._inboxes):
            threading.Thread(target=_serve, args=(inbox,), name=f"gpipe-stage-{k}", daemon=True).start()
        self.close = weakref.finalize(self, _stop, self._inboxes)  # on close() or garbage collection

    def run(self, local: LocalStages, schedule: list[list[Task]], transport: ThreadTransport,
            on_event: EventCallback) -> list[Mark]:
        """Run every stage's task list on its thread; return all marks. The first failure stops
        every stage and is raised here once all have stopped."""
        reports: queue.SimpleQueue = queue.SimpleQueue()
        on_mark = live(local, None if on_event is None else lambda event: reports.put(("event", event)))

        def work(stage: int, tasks: list[Task]) -> None:
            try:
                reports.put(("done", run_tasks(local, [(stage, task) for task in tasks], transport, on_mark)))
            except Aborted:
                reports.put(("done", []))
            except BaseException as exc:  # reported to the caller, who re-raises it
                reports.put(("failed", exc))

        for stage, tasks in enumerate(schedule):
            self._inboxes[stage].put(lambda stage=stage, tasks=tasks: work(stage, tasks))
        marks, failure, running = [], None, len(schedule)
        try:
            while running:
                kind, payload = reports.get()
                if kind == "event":
                    on_event(payload)
                    continue
                running -= 1
                if kind == "done":
                    marks += payload
                elif failure is None:
                    failure = payload
                    transport.abort()
        except BaseException:  # e.g. Ctrl-C while waiting, or a failing callback: stop the stages first
            transport.abort()
            while running:
                running -= reports.get()[0] != "event"
            raise
        if failure is not None:
            raise failure
        return marks


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


OP_NAMES = {"F": "forward", "R": "recompute", "B": "backward", "W": "weight gradient"}


def where(stage: int, task: Optional[Task]) -> str:
    """'stage 2, micro-batch 0, forward (F0)': where in the pipeline a task runs (and its chunk, when
    the stage holds several)."""
    if task is None:
        return f"stage {stage}"
    chunk = f", chunk {task.chunk}" if task.chunk != stage else ""
    return f"stage {stage}, micro-batch {task.micro}, {OP_NAMES.get(task.op, task.op)} ({task}){chunk}"


def name_place(exc: BaseException, stage: int, task: Optional[Task], prefix: str = "") -> BaseException:
    """Put the stage, task and micro-batch (after `prefix`, such as "rank 1, ") in the exception's
    message, keeping its type."""
    place = prefix + where(stage, task)
    if exc.args and isinstance(exc.args[0], str):
        exc.args = (f"[{place}] {exc.args[0]}",) + exc.args[1:]
    else:
        exc.args = (f"[{place}] {exc}",)
    return exc
