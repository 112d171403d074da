"""Run under torchrun with 4 processes by tests/engine/distributed/test_replicas.py: two pipelines
of two stages, trained as data-parallel replicas (a 2 x 2 mesh), compared on every rank with one
process training the whole model on the whole global batch. Each rank writes JSON lines to
GPIPE_FAULTS_OUT/rank<r>.jsonl.

    torchrun --standalone --nproc-per-node 4 tests/helpers/distributed_replicas.py exact   # then an exception
    torchrun --standalone --nproc-per-node 4 tests/helpers/distributed_replicas.py kill
"""
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.optim import ZeroRedundancyOptimizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from small_models import mlp  # noqa: E402

from engine import GPipe  # noqa: E402
from engine.partition import split  # noqa: E402

D, K, M, GLOBAL = 2, 2, 4, 32
LOSS = nn.CrossEntropyLoss()
SCENARIO = sys.argv[1] if len(sys.argv) > 1 else "exact"
FAULTS = {"raise": "errors", "kill": "kill"}  # the scenario a fault's reports are filed under


def report(scenario: str = SCENARIO, **fields) -> None:
    with open(os.path.join(os.environ["GPIPE_FAULTS_OUT"], f"rank{os.environ['RANK']}.jsonl"), "a") as out:
        out.write(json.dumps({"scenario": scenario, "rank": dist.get_rank(), **fields}) + "\n")


def batches(steps: int, dtype=torch.float64):
    generator = torch.Generator().manual_seed(7)
    return [(torch.randn(GLOBAL, 16, generator=generator, dtype=dtype),
             torch.randint(0, 3, (GLOBAL,), generator=generator)) for _ in range(steps)]


def shard(tensor: torch.Tensor, replica: int) -> torch.Tensor:
    return tensor.chunk(D)[replica]


def mesh_groups():
    mesh = init_device_mesh("cpu", (D, K), mesh_dim_names=("dp", "pp"))
    return mesh.get_group("pp"), mesh.get_group("dp")


def listed_groups():
    """The same layout from dist.new_group: every rank makes every group, in one order."""
    pipelines = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3])]
    replicas = [dist.new_group(ranks) for ranks in ([0, 2], [1, 3])]
    rank = dist.get_rank()
    return pipelines[rank // K], replicas[rank % K]


def optimizer_for(name: str, parameters, dp=None):
    if name == "sgd":
        return torch.optim.SGD(parameters, lr=0.1, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(parameters, lr=0.01)
    return ZeroRedundancyOptimizer(parameters, optimizer_class=torch.optim.Adam, process_group=dp, lr=0.01)


def train(pp, dp, schedule: str, checkpoint: str, optimizer: str, steps: int = 3) -> dict:
    """Train 3 steps as a 2 x 2 mesh and as one process on the whole batch; compare this rank's stage."""
    rank, stage, replica = dist.get_rank(), dist.get_rank(pp), dist.get_rank(dp)
    pipe = GPipe(mlp(dtype=torch.float64), K, chunks=M, checkpoint=checkpoint, schedule=schedule, group=pp,
                 data_parallel=dp)
    step_optimizer = optimizer_for(optimizer, pipe.parameters(), dp)
    reference = mlp(dtype=torch.float64)
    reference_optimizer = optimizer_for("adam" if optimizer == "zero" else optimizer, reference.parameters())
    losses, expected = [], []
    for x, y in batches(steps):
        step_optimizer.zero_grad()
        losses.append(pipe.step(shard(x, replica) if stage == 0 else None,
                                shard(y, replica) if stage == K - 1 else None, LOSS).item())
        step_optimizer.step()
        reference_optimizer.zero_grad()
        loss = LOSS(reference(x), y)
        loss.backward()
        reference_optimizer.step()
        expected.append(loss.item())
    mine = list(pipe.parameters())
    theirs = list(split(reference, pipe.balance)[stage].parameters())
    difference = max((a - b).abs().max().item() for a, b in zip(mine, theirs))
    trace = pipe.trace
    pipe.close()
    return {"rank": rank, "difference": difference,
            "loss_difference": max(abs(a - b) for a, b in zip(losses, expected)),
            "replicas": trace.replicas, "reductions": [[r.stage, r.start, r.end, r.bytes] for r in trace.reductions],
            "last_task_ends": {s: max(e.end for e in trace.events if e.stage == s) for s in range(K)}
                              if rank == 0 else {},
            "grad_bytes": sum(p.numel() * p.element_size() for p in mine)}


def dropout_matches_one_pipeline(pp, dp) -> float:
    """D x K with seed= against 1 x K threads over the global batch with D*M micro-batches."""
    stage, replica = dist.get_rank(pp), dist.get_rank(dp)
    x, y = batches(1)[0]
    model = mlp(dropout=0.3, dtype=torch.float64)
    pipe = GPipe(model, K, chunks=M, seed=5, group=pp, data_parallel=dp)
    pipe.step(shard(x, replica) if stage == 0 else None, shard(y, replica) if stage == K - 1 else None, LOSS)
    one = mlp(dropout=0.3, dtype=torch.float64)
    threads = GPipe(one, K, chunks=D * M, seed=5, threads_per_stage=1)
    threads.step(x, y, LOSS)
    threads.close()
    difference = max((a.grad - b.grad).abs().max().item()
                     for a, b in zip(pipe.parameters(), threads.partitions[stage].parameters()))
    pipe.close()
    return difference


class Explodes(nn.Module):
    """Fails on its first training forward call in this process: raising, or killing the process."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def forward(self, x):
        if self.training and dist.get_rank() == 3:
            report(FAULTS[self.how], failed_at=time.time())
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ZeroDivisionError("boom in replica 1")
        return x


def fault(how: str) -> None:
    pp, dp = mesh_groups()
    stage, replica = dist.get_rank(pp), dist.get_rank(dp)
    model = nn.Sequential(*mlp(), Explodes(how))
    pipe = GPipe(model, K, chunks=M, group=pp, data_parallel=dp)
    x, y = batches(1, dtype=torch.float32)[0]
    try:
        pipe.step(shard(x, replica) if stage == 0 else None, shard(y, replica) if stage == K - 1 else None, LOSS)
        report(FAULTS[how], raised=None, at=time.time())
    except Exception as error:  # reported for the test to read
        report(FAULTS[how], raised=type(error).__name__, message=str(error)[:300], at=time.time())
    if how == "raise":  # a step after a failed one is refused on every rank, not run on a half-summed group
        try:
            pipe.step(shard(x, replica) if stage == 0 else None, shard(y, replica) if stage == K - 1 else None, LOSS)
            report(FAULTS[how], after=None)
        except Exception as error:
            report(FAULTS[how], after=str(error)[:300])


def main() -> None:
    """`kill`: rank 3 dies in its first step. `exact` (one mesh for two tests, since a mesh costs its
    four interpreters): every exactness case, then an exception raised in one replica's first step."""
    dist.init_process_group("gloo")
    if SCENARIO == "kill":
        fault("kill")
        os._exit(0)  # a dead rank cannot join a barrier: leave now, as a survivor would
    pp, dp = mesh_groups()
    for schedule in ("gpipe", "1f1b"):
        for checkpoint in ("never", "always"):
            for optimizer in ("sgd", "adam"):
                report(case=[schedule, checkpoint, optimizer], **train(pp, dp, schedule, checkpoint, optimizer))
    report(case=["gpipe", "except_last", "zero"], **train(pp, dp, "gpipe", "except_last", "zero"))
    report(case=["listed groups"], **train(*listed_groups(), "1f1b", "except_last", "sgd"))
    report(case=["dropout"], difference=dropout_matches_one_pipeline(pp, dp))
    try:
        GPipe(mlp(), K, chunks=M, group=pp, data_parallel=pp)   # a stage's replicas must run that stage
        report(case=["same group twice"], raised=None)
    except ValueError as error:
        report(case=["same group twice"], raised=str(error))
    dist.barrier()
    fault("raise")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
