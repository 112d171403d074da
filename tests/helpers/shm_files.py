"""Processes in tests: finding what is left in /dev/shm of the pipes a test started (the processes
themselves: lab/machine/process_tree.py)."""
import os
import time
import uuid


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
