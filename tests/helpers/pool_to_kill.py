"""A parent that steps a ProcessPool until it is killed (tests/engine/distributed/test_processes.py kills its whole
process group with SIGKILL in the middle of a step, often while the first steps are still growing
their shared-memory slots). It runs as a child process (lab/processes/children.py), forked with torch already
imported, and leads a process group of its own, as a script started by a supervisor would: its
pool's forker and stage processes are in that group. Its forker is a fork of itself (torch is
imported already) rather than a fresh `python -m lab.processes.forker`, which would import torch again for
each of the 20 kills: the same forker, started in milliseconds."""
import json
import os
import socket
import threading

import torch

from lab.processes import forker as forkers
from lab.processes.pool import ProcessPool


class ForkedProcess:
    """The forker's process, as Forker holds it (a Popen's pid and poll), made by os.fork."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


class ForkedForker(forkers.Forker):
    """A Forker whose forker process is forked from this one, serving as `python -m lab.processes.forker` does."""

    def _start(self, theirs: socket.socket) -> ForkedProcess:
        pid = os.fork()
        if pid == 0:
            try:
                forkers.main(theirs)
            finally:
                os._exit(0)
        return ForkedProcess(pid)


class PoolToKill:
    """Build a pool, say so in `ready` (its file prefix, its Store's folder, its forker's and stage
    processes' pids), then step forever."""

    def __init__(self, ready: str):
        os.setsid()
        forkers._forker = ForkedForker()
        pool = ProcessPool(2)
        pool.build("small_models:mlp", {"width": 64}, chunks=8)
        x, y = torch.randn(256, 64), torch.randint(0, 3, (256,))

        def step_forever() -> None:
            while True:
                pool.step(x, y, torch.nn.functional.cross_entropy)
        with open(ready + ".part", "w") as file:
            json.dump({"parent": pool._shm_prefix, "store": pool._meeting.folder,
                       "stages": [forkers.forker().process.pid, *pool.pids]}, file)
        os.rename(ready + ".part", ready)
        threading.Thread(target=step_forever, daemon=True).start()

    def __call__(self, command):
        return None
