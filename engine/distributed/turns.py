"""One order for a call's transfers, which every rank computes alike and posts its own in.

NCCL may hold a send until its receive is posted and runs a communicator's operations in posting
order, so ranks posting in crossing orders wait for each other for ever. The order: by when the
schedule's unit-cost timeline ends each sending task, ties by sending rank. The earliest transfer
not yet done is then next on both its ranks, so it completes; and no rank waits to post one that
needs a later one, since a task's input comes from a task that ended earlier (docs/processes.md).
"""
from __future__ import annotations

import threading
from typing import Callable, NamedTuple, Optional

from ..schedule import Schedule, Task, timeline, upstream
from ..transport import message_key

Key = tuple  # (kind, micro, receiving chunk), as message_key names a task's input


class Transfer(NamedTuple):
    """One message between two ranks: under `key` from rank `sender` to rank `receiver`."""

    key: Key
    sender: int
    receiver: int


def transfer_order(schedule: list[list[Task]], placement: tuple) -> list[Transfer]:
    """Every transfer between two ranks of a call running `schedule` (stage k on rank k, chunk c on
    rank placement[c]), in the order of the unit-cost timeline's end of each sending task, ties by
    sending rank then by its position in that rank's list."""
    schedule = Schedule(schedule, placement)
    times = timeline(schedule, lambda stage, task: 1.0)
    where = {task: (rank, position) for rank, tasks in enumerate(schedule) for position, task in enumerate(tasks)}
    ordered = []
    for rank, tasks in enumerate(schedule):
        for task in tasks:  # each task's input from another rank, as the task loop receives it
            needed = upstream(task, len(placement))
            if needed is not None and where[needed][0] != rank:
                sender, position = where[needed]
                ordered.append(((times[sender][position][1], sender, position),
                                Transfer(message_key(task), sender, rank)))
    return [transfer for _, transfer in sorted(ordered)]


class Turns:
    """This rank's transfers of the current call, each posted in its turn: `offer` hands over what
    posting one does (a call that does not block), run under one lock once every earlier transfer of
    this rank has posted, by whichever thread (stage or listener) offered the last one it waited for."""

    def __init__(self, rank: int):
        self.rank = rank
        self._lock = threading.Lock()
        self._step, self._mine, self._next, self._left = -1, [], 0, set()
        self._offered: dict = {}   # (step, key, "send" | "receive") -> (what posting it does, the peer)
        self.posted: list = []     # (key, "send" | "receive") in the order posted, this call

    def expect(self, step: int, order: Optional[list[Transfer]]) -> None:
        """Call `step` runs with `order` (transfer_order; None: no order, each posts as offered); what
        was offered for it already may post, and what earlier calls left (a failed one's) posts now."""
        mine = [(t.key, "send" if t.sender == self.rank else "receive") for t in order or ()
                if self.rank in (t.sender, t.receiver)]
        with self._lock:
            self._step, self._mine, self._next, self._left, self.posted = step, mine, 0, set(mine), []
            for turn in [turn for turn in self._offered
                         if turn[0] < step or (turn[0] == step and turn[1:] not in self._left)]:
                self._offered.pop(turn)[0]()
            self._post_in_turn()

    def offer(self, step: int, key: Key, way: str, post: Callable[[], None], peer: int = -1) -> None:
        """Post a transfer of call `step` under `key` ("send" or "receive") with `peer` in its turn;
        one of no turn of the call (an earlier call's) at once."""
        with self._lock:
            if step < self._step or (step == self._step and (key, way) not in self._left):
                post()
                return
            self._offered[(step, key, way)] = (post, peer)
            if step == self._step:
                self._post_in_turn()

    def _post_in_turn(self) -> None:
        """Post the offered transfers whose turn has come, in order (under the lock)."""
        while self._next < len(self._mine) and (self._step, *self._mine[self._next]) in self._offered:
            turn = self._mine[self._next]
            self._left.discard(turn)
            self.posted.append(turn)
            self._next += 1
            self._offered.pop((self._step, *turn))[0]()

    def held(self, step: int) -> dict[int, int]:
        """How many messages of call `step` each peer sent that landed here and wait for their turn."""
        with self._lock:
            held: dict[int, int] = {}
            for (when, _, way), (_, peer) in self._offered.items():
                if when == step and way == "receive":
                    held[peer] = held.get(peer, 0) + 1
            return held
