"""Run under torchrun with 2 processes (tests/engine/distributed/test_processes.py), on a host with 2 GPUs with `cuda`
(the default): stages on cuda:0 and cuda:1 over NCCL train 3 steps; each rank compares its stage with
the same training done by stage threads on the two GPUs, and writes one JSON line to
GPIPE_FAULTS_OUT/rank<r>.jsonl: how far apart the parameters are, relative to the largest (cuBLAS
promises no bitwise equality across streams or processes; the doctor allows lab.checkup.comparisons.GPU_TOLERANCE).
With `cpu` the same body runs on CPU cores over gloo, as CI runs it."""
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from small_models import mlp  # noqa: E402

from engine import GPipe  # noqa: E402


def train(pipe, x, y):
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        pipe.step(x, y, nn.functional.cross_entropy)
        optimizer.step()


def main(kind: str):
    cuda = kind == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    if cuda:
        torch.cuda.set_device(rank)

    def on(tensor, gpu):
        return tensor.cuda(gpu) if cuda else tensor

    torch.manual_seed(1)
    x, y = torch.randn(32, 16), torch.randint(0, 3, (32,))
    model = mlp(dropout=0.2)
    pipe = GPipe(model, 2, chunks=4, seed=3, checkpoint="always", group=dist.group.WORLD, devices=kind)
    train(pipe, on(x, rank) if rank == 0 else None, on(y, rank) if rank == 1 else None)
    reference = mlp(dropout=0.2)
    threads = GPipe(reference, 2, chunks=4, seed=3, checkpoint="always",
                    devices=["cuda:0", "cuda:1"] if cuda else ["cpu", "cpu"])
    train(threads, on(x, 0), on(y, 1))
    mine = [p.cpu() for p in pipe.parameters()]
    theirs = [p.cpu() for p in threads.partitions[rank].parameters()]
    with open(os.path.join(os.environ["GPIPE_FAULTS_OUT"], f"rank{rank}.jsonl"), "w") as out:
        apart = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in zip(mine, theirs))
        out.write(json.dumps({"rank": rank, "apart": apart, "lane": pipe.trace.lane}) + "\n")
    pipe.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cuda")
