"""A parent that steps a ProcessPool until it is killed (tests/test_processes.py kills its whole
process group with SIGKILL in the middle of a step, often while the first steps are still growing
their shared-memory slots). It runs as a child process (lab/children.py), forked with torch already
imported, and leads a process group of its own, as a script started by a supervisor would: its
pool's forker and stage processes are in that group."""
import json
import os
import threading

import torch

from lab.forker import forker
from lab.pool import ProcessPool


class PoolToKill:
    """Build a pool, say so in `ready` (its file prefix, its Store's folder, its forker's and stage
    processes' pids), then step forever."""

    def __init__(self, ready: str):
        os.setsid()
        pool = ProcessPool(2)
        pool.build("conftest:mlp", {"width": 64}, chunks=8)
        x, y = torch.randn(256, 64), torch.randint(0, 3, (256,))

        def step_forever() -> None:
            while True:
                pool.step(x, y, torch.nn.functional.cross_entropy)
        with open(ready + ".part", "w") as file:
            json.dump({"parent": pool._shm_prefix, "store": pool._meeting.folder, "stages": [forker().process.pid, *pool.pids]}, file)
        os.rename(ready + ".part", ready)
        threading.Thread(target=step_forever, daemon=True).start()

    def __call__(self, command):
        return None
