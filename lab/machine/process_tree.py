"""This host's processes as a tree, read from /proc: whether one runs, which ones it started.

A process group does not hold everything a command started: torchrun starts its workers in sessions
of their own, so stopping a command that may have started them means walking its descendants.
"""
from __future__ import annotations

import os
import re
import signal
from pathlib import Path


def _state_and_parent(pid: int) -> tuple[str, int]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return fields[0], int(fields[1])


def running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (killed, not yet reaped)."""
    try:
        return _state_and_parent(pid)[0] != "Z"
    except OSError:
        return False


def children(pid: int) -> list[int]:
    """Pids of the live processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                state, parent = _state_and_parent(int(entry.name))
            except OSError:
                continue
            if parent == pid and state != "Z":
                found.append(int(entry.name))
    return found


def descendants(pid: int) -> list[int]:
    """Pids of the live processes `pid` started, and those they started, and so on (stage processes
    are forked by a forker the parent started: lab/processes/forker.py)."""
    found, todo = [], [pid]
    while todo:
        below = children(todo.pop())
        found += below
        todo += below
    return found


def kill(pids: list[int]) -> None:
    """SIGKILL each of `pids` that is still there."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def orphaned(folder: str, owner: re.Pattern) -> list[str]:
    """The names in `folder` that `owner` matches (its group 1: the pid of the process that made
    them), made by this user, whose process is gone: what a process killed outright left behind."""
    found = []
    for name in sorted(os.listdir(folder)):
        made_by = owner.match(name)
        if made_by is None or running(int(made_by.group(1))):
            continue
        try:
            if os.stat(os.path.join(folder, name)).st_uid == os.getuid():
                found.append(name)
        except FileNotFoundError:  # swept by another process meanwhile
            pass
    return found
