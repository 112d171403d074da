"""Run under torchrun with GPIPE_LANE=gloo by tests/engine/distributed/test_turns.py: a step of every
built-in schedule, one stage per rank. Each rank writes one JSON line per schedule, in a file of its
own in the folder GPIPE_TURNS_OUT names: the transfers it takes part in, whether it posted them in
the call's one order (engine/distributed/turns.py), and whether the loss is the threads'.

    GPIPE_LANE=gloo torchrun --standalone --nproc-per-node 4 tests/helpers/distributed_turns.py
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from small_models import mlp  # noqa: E402

from engine import GPipe  # noqa: E402
from engine.distributed.turns import transfer_order  # noqa: E402
from engine.schedule import SCHEDULES  # noqa: E402

dist.init_process_group("gloo")
rank, stages = dist.get_rank(), dist.get_world_size()
torch.manual_seed(1)
x, y = torch.randn(24, 16, dtype=torch.float64), torch.randint(0, 3, (24,))
lines = []
for name, kind in SCHEDULES.items():
    options = dict(balance=stages, chunks=2 * stages, schedule=name, virtual_stages=kind.fewest_chunks,
                   checkpoint="always", seed=7)
    pipe = GPipe(mlp(dtype=torch.float64), threads_per_stage=1, group=dist.group.WORLD, **options)
    loss = pipe.step(x, y, nn.functional.cross_entropy)  # inputs are read on the first stage, targets on the last
    schedule = pipe._plan(2 * stages, True)[0]
    mine = [(t.key, "send" if t.sender == rank else "receive")
            for t in transfer_order(schedule, schedule.placement) if rank in (t.sender, t.receiver)]
    threads = GPipe(mlp(dtype=torch.float64), threads_per_stage=1, **options)
    lines.append({"schedule": name, "rank": rank, "transfers": len(mine),
                  "in_order": pipe.runner.transport.lane.turns.posted == mine,
                  "equal": loss.item() == threads.step(x, y, nn.functional.cross_entropy).item()})
    pipe.close()


class SlowBackward(torch.autograd.Function):
    """The identity, whose backward takes 0.1 s: the stage behind it sends its "end" while the
    stage before still holds a gradient that waits for its turn (that end must not overtake it)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.1)
        return grad


class Slow(nn.Module):
    def forward(self, x):
        return SlowBackward.apply(x)


def slow_middle() -> nn.Sequential:
    torch.manual_seed(0)
    middle = [nn.Sequential(nn.Linear(16, 16), Slow()) for _ in range(stages - 2)]
    return nn.Sequential(nn.Linear(16, 16), *middle, nn.Linear(16, 3)).to(torch.float64)


options = dict(balance=stages, chunks=6, schedule="1f1b", checkpoint="never", seed=1)
pipe = GPipe(slow_middle(), threads_per_stage=1, group=dist.group.WORLD, **options)
threads = GPipe(slow_middle(), threads_per_stage=1, **options)
losses = [(pipe.step(x, y, nn.functional.cross_entropy).item(), threads.step(x, y, nn.functional.cross_entropy).item())
          for _ in range(4)]
lines.append({"schedule": "1f1b, slow middle, 4 steps", "rank": rank, "transfers": len(losses), "in_order": True,
              "equal": all(a == b for a, b in losses)})
pipe.close()
with open(os.path.join(os.environ["GPIPE_TURNS_OUT"], f"rank{rank}.jsonl"), "w") as out:
    out.write("".join(json.dumps(line) + "\n" for line in lines))
dist.destroy_process_group()
