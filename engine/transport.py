"""How stages hand each other activations and gradients.

The engine only needs two calls: `send(stage, key, payload)` and `Mailbox.get(key)`, where key
is ("act" | "grad", micro-batch), named by the task that waits for it. Here stages are threads in
one process and mailboxes are queues; a transport between processes (torch.distributed send/recv)
can offer the same two calls and reuse the stage and schedule code unchanged.
"""
from __future__ import annotations

import queue


def message_key(task) -> tuple:
    """The mailbox key of what `task` needs from another stage: ("act", m) for F, ("grad", m) for B."""
    return ("act" if task.op == "F" else "grad", task.micro)


class Aborted(Exception):
    """Raised in a stage worker when another stage failed and the step is being abandoned."""


_ABORT = object()


class Mailbox:
    """One stage's inbox: messages may arrive in any order; `get` waits for the one asked for."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._arrived: dict = {}

    def put(self, key, payload) -> None:
        self._queue.put((key, payload))

    def get(self, key):
        """The payload sent under `key`, waiting for it; raises Aborted if the step is abandoned."""
        while key not in self._arrived:
            message = self._queue.get()
            if message is _ABORT:
                raise Aborted()
            self._arrived[message[0]] = message[1]
        return self._arrived.pop(key)

    def abort(self) -> None:
        self._queue.put(_ABORT)


class ThreadTransport:
    """Mailboxes for K stage threads in one process."""

    def __init__(self, stages: int):
        self.mailboxes = [Mailbox() for _ in range(stages)]

    def send(self, stage: int, key, payload) -> None:
        """Deliver `payload` to `stage` under `key`."""
        self.mailboxes[stage].put(key, payload)

    def abort(self) -> None:
        """Wake every stage that waits for a message so it can stop."""
        for mailbox in self.mailboxes:
            mailbox.abort()
