"""How stages hand each other activations and gradients.

A stage's worker needs two calls: `receive(stage, key)` for what its next task needs from another
chunk, and `send(source, destination, key, value)` for what a task produced for one (source and
destination are chunks). The key is ("act" | "grad", micro-batch, chunk), named by the task that
waits for it. `ThreadTransport` connects K
stage threads of one process through mailboxes; `engine.distributed.ProcessTransport` offers the
same two calls between processes over torch.distributed, so stage and schedule code are shared.
"""
from __future__ import annotations

import queue
from typing import Callable, Optional

from .microbatch import Value


def message_key(task) -> tuple:
    """The mailbox key of what `task` needs from another chunk: ("act", m, chunk) for a forward,
    ("grad", m, chunk) for a backward, where chunk is the task's own (the receiving one)."""
    return ("act" if task.op == "F" else "grad", task.micro, task.chunk)


class Aborted(Exception):
    """Raised in a stage worker when another stage failed and the step is being abandoned."""


class StageFailed(RuntimeError):
    """Raised on every rank of a process pipeline when another rank's stage failed, or a rank
    became unreachable; the message names the rank, stage, micro-batch and task."""


_ABORT = object()


class Mailbox:
    """One stage's inbox: messages may arrive in any order; `get` waits for the one asked for."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._arrived: dict = {}
        self.failure: Optional[BaseException] = None

    def put(self, key, payload) -> None:
        self._queue.put((key, payload))

    def get(self, key, while_waiting: Optional[Callable[[], None]] = None, poll: float = 0.05):
        """The payload sent under `key`, waiting for it. Raises Aborted if the step is abandoned,
        or the failure this mailbox was told of. `while_waiting`, if given, is called every `poll`
        seconds of waiting (it may raise to give up: a watchdog that needs no thread of its own)."""
        while key not in self._arrived:
            if self.failure is not None:
                raise self.failure
            try:
                message = self._queue.get(timeout=poll) if while_waiting else self._queue.get()
            except queue.Empty:
                while_waiting()
                continue
            if message is _ABORT:
                if self.failure is not None:
                    raise self.failure
                raise Aborted()
            self._arrived[message[0]] = message[1]
        return self._arrived.pop(key)

    def abort(self) -> None:
        """Wake the waiting worker with Aborted."""
        self._queue.put(_ABORT)

    def fail(self, error: BaseException) -> None:
        """From now on every `get` that waits raises `error` (a connection is lost for good)."""
        self.failure = error
        self._queue.put(_ABORT)

    def forget(self, keep: Callable[[tuple], bool]) -> None:
        """Drop messages that arrived but are no longer wanted (those of an abandoned call)."""
        self._arrived = {k: v for k, v in self._arrived.items() if keep(k)}


class ThreadTransport:
    """Mailboxes for K stage threads in one process; values move between the chunks' devices."""

    def __init__(self, chunks: dict, stages: int):
        self.chunks = chunks
        self.mailboxes = [Mailbox() for _ in range(stages)]

    def receive(self, stage: int, key):
        """What another chunk sent to a chunk of `stage` under `key`: (value, ready event or None),
        for `StageDevice.receive` on the receiving stage."""
        return self.mailboxes[stage].get(key)

    def send(self, source: int, destination: int, key, value: Value) -> None:
        """Deliver `value` from chunk `source` to chunk `destination` under `key`, moving it towards
        the destination's device on the source's stream."""
        target = self.chunks[destination]
        payload = self.chunks[source].device.send(value, target.device.device)
        self.mailboxes[target.worker].put(key, payload)

    def abort(self) -> None:
        """Wake every stage that waits for a message so it can stop."""
        for mailbox in self.mailboxes:
            mailbox.abort()
