"""A parent that steps a ProcessPool until it is killed (tests/test_processes.py kills its whole
process group with SIGKILL in the middle of a step, often while the first steps are still growing
their shared-memory slots). It writes its pool's file prefix and its stage processes' pids once the
pipe is built, then steps forever; no main guard, as a learner's script would have none."""
import json
import sys

import torch

TESTS = __file__.rsplit("/", 1)[0]
sys.path[:0] = [TESTS, TESTS.rsplit("/", 1)[0]]  # conftest's models, and the project
from lab.pool import ProcessPool  # noqa: E402

pool = ProcessPool(2)
pool.build("conftest:mlp", {"width": 64}, chunks=8)
x, y = torch.randn(256, 64), torch.randint(0, 3, (256,))
with open(sys.argv[1], "w") as ready:
    json.dump({"parent": pool._shm_prefix, "stages": pool.pids}, ready)
while True:
    pool.step(x, y, torch.nn.functional.cross_entropy)
