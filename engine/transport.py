"""How stages hand each other activations and gradients.

A stage's task loop needs three calls: `receive(stage, key)` for what its next task needs from
another chunk, `send(source, destination, key, value)` for what a task produced for one (source
and destination are chunks), and `check()` between tasks, which raises if the call is being
abandoned. The key is ("act" | "grad", micro-batch, chunk), named by the task that waits for it.
`ThreadTransport` connects K stage threads of one process through mailboxes;
`engine.distributed.transport.ProcessTransport` offers the same calls between processes over
torch.distributed, so chunk, schedule and task loop are shared.
"""
from __future__ import annotations

import queue
import threading

from .microbatch import Value


def message_key(task) -> tuple:
    """The mailbox key of what `task` needs from another chunk: ("act", m, chunk) for a forward,
    ("grad", m, chunk) for a backward, where chunk is the task's own (the receiving one)."""
    return ("act" if task.op == "F" else "grad", task.micro, task.chunk)


class Aborted(Exception):
    """Raised in a stage thread when another stage failed and the call is being abandoned."""


class StageFailed(RuntimeError):
    """Raised on every rank of a process pipeline when another rank's stage failed, or a rank
    became unreachable; the message names the rank, stage, micro-batch and task."""


_ABORT = object()


class Mailbox:
    """One stage's inbox: messages may arrive in any order; `get` waits for the one asked for."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._arrived: dict = {}

    def put(self, key, payload) -> None:
        self._queue.put((key, payload))

    def get(self, key):
        """The payload sent under `key`, waiting for it; raises Aborted if the call is abandoned."""
        while key not in self._arrived:
            message = self._queue.get()
            if message is _ABORT:
                raise Aborted()
            self._arrived[message[0]] = message[1]
        return self._arrived.pop(key)

    def abort(self) -> None:
        """Wake the waiting stage with Aborted."""
        self._queue.put(_ABORT)


class ThreadTransport:
    """Mailboxes for K stage threads in one process; values move between the chunks' devices."""

    def __init__(self, chunks: dict, stages: int):
        self.chunks = chunks
        self.mailboxes = [Mailbox() for _ in range(stages)]
        self._aborted = threading.Event()

    def receive(self, stage: int, key):
        """What another chunk sent to a chunk of `stage` under `key`: (value, ready event or None),
        for `StageDevice.receive` on the receiving stage."""
        return self.mailboxes[stage].get(key)

    def send(self, source: int, destination: int, key, value: Value) -> None:
        """Deliver `value` from chunk `source` to chunk `destination` under `key`, moving it towards
        the destination's device on the source's stream."""
        target = self.chunks[destination]
        payload = self.chunks[source].device.send(value, target.device.device)
        self.mailboxes[target.stage].put(key, payload)

    def check(self) -> None:
        """Raise Aborted if another stage failed."""
        if self._aborted.is_set():
            raise Aborted()

    def abort(self) -> None:
        """Abandon the call: every stage stops before its next task, and one that waits wakes."""
        self._aborted.set()
        for mailbox in self.mailboxes:
            mailbox.abort()
