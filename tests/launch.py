"""Processes in tests: finding what is left of those a test started, in processes and in /dev/shm."""
import os
import time
import uuid
from pathlib import Path


def children(pid):
    """Pids of the live processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def descendants(pid: int) -> list[int]:
    """Pids of the live processes `pid` started, and those they started, and so on (stage processes
    are forked by a forker the parent started: lab/forker.py)."""
    found, todo = [], [pid]
    while todo:
        below = children(todo.pop())
        found += below
        todo += below
    return found


def shm_prefix() -> str:
    """A prefix of this test's own for the pipes' files in /dev/shm (GPIPE_SHM_PREFIX), so that what
    it checks there is its own, whatever else runs on the host."""
    return f"gpipe-test{uuid.uuid4().hex[:10]}"


def shm_left(prefix: str, wait: float = 10.0) -> list[str]:
    """The files in /dev/shm whose names start with `prefix`, once they are gone or `wait` seconds
    have passed (a stage process may still be closing)."""
    deadline = time.monotonic() + wait
    while True:
        left = sorted(name for name in os.listdir("/dev/shm") if name.startswith(prefix))
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.2)
