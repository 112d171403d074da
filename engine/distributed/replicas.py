"""Data parallelism across pipelines: each stage averages its gradients with the same stage of the
other replicas (GPipe(..., group=pp_group, data_parallel=dp_group)).

Once a stage's last task ran, its gradients times its shard's size start an all-reduce in buckets
while earlier stages still drain; the sum is divided by the global batch's size, which travels
upstream with "end", so the gradients are the global mean loss's whatever the shards' sizes. Waits
poll the Store too: a failure in any replica stops every rank.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..transport import StageFailed
from .works import keys_within, progress_bound, setup_bound, until_completed

BUCKET_BYTES = 25 * 2 ** 20   # as DistributedDataParallel: large enough to amortize a call, small enough to overlap


def buckets(tensors: list[torch.Tensor], limit: int = BUCKET_BYTES) -> list[list[int]]:
    """Indexes of `tensors` grouped into buckets of one dtype and device, each at most `limit` bytes
    (a larger tensor gets a bucket of its own), in order."""
    groups: list[list[int]] = []
    open_bucket: dict = {}
    for i, t in enumerate(tensors):
        kind, size = (t.dtype, t.device), t.numel() * t.element_size()
        bucket = open_bucket.get(kind)
        if bucket is None or bucket[1] + size > limit:
            bucket = open_bucket[kind] = [[], 0]
            groups.append(bucket[0])
        bucket[0].append(i)
        bucket[1] += size
    return groups


@dataclass
class Pending:
    """One step's gradient all-reduce in flight."""

    gradients: list[torch.Tensor]
    flat: list[tuple[list[int], torch.Tensor]]    # (indexes into gradients, the flattened bucket)
    works: list
    start: float
    end: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.flat)


class Replicas:
    """This rank's stage and its replicas in the data-parallel group."""

    def __init__(self, group, stage: int, store):
        if group is None or dist.get_rank(group) < 0:
            raise ValueError("data_parallel= must be a process group this rank belongs to (the same stage of every "
                             "pipeline), e.g. init_device_mesh(..., mesh_dim_names=('dp', 'pp')).get_group('dp')")
        self.group, self.size, self.index = group, dist.get_world_size(group), dist.get_rank(group)
        self.broken = False   # a call failed: sums in flight with the other replicas will never match
        members = dist.get_process_group_ranks(group)
        store.set(f"stage-of/{dist.get_rank()}", str(stage))
        keys_within(store, [f"stage-of/{member}" for member in members], setup_bound(),
                    f"rank {dist.get_rank()}: meeting the stage's replicas")
        stages = {member: int(store.get(f"stage-of/{member}")) for member in members}
        if len(set(stages.values())) != 1:
            raise ValueError(f"the data_parallel group must hold the same stage of each pipeline; its ranks run stages "
                             f"{stages} (global rank: stage): check the order of the mesh's dimensions, ('dp', 'pp')")

    def abandon(self) -> None:
        """A call failed: the sums in flight will not complete (a replica stopped, or stops now). Where
        NCCL runs them the transport aborts them with its own NCCL groups (`ProcessTransport.also_abort`:
        kernels waiting for a peer would hold the GPU, and the next pipe's synchronize, forever); with
        gloo a stale sum could meet the next call's. No call follows."""
        self.broken = True

    def require_whole(self) -> None:
        """Refuse a call after one failed (`abandon`): its group cannot be trusted again."""
        if self.broken:
            raise StageFailed("an earlier call failed while this stage's replicas summed their gradients, so their "
                              "data-parallel group is abandoned: close this pipe, make new groups and a new pipe")

    def start(self, parameters: list[torch.Tensor], shard: int) -> Pending:
        """Start summing (shard size x gradient) over the replicas, bucket by bucket (None counts as zeros)."""
        started = time.perf_counter()
        gradients = []
        for p in parameters:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            gradients.append(p.grad)
        flat, works = [], []
        for bucket in buckets(gradients):
            tensor = _flatten_dense_tensors([gradients[i] for i in bucket]).mul_(shard)
            flat.append((bucket, tensor))
            works.append(dist.all_reduce(tensor, group=self.group, async_op=True))
        return Pending(gradients, flat, works, started)

    def global_loss(self, loss: torch.Tensor, shard: int, check: Callable[[], None]) -> tuple[torch.Tensor, int]:
        """(the global batch's mean loss, its size), from every replica's shard mean and size."""
        pair = torch.tensor([loss.item() * shard, float(shard)], dtype=torch.float64, device=loss.device)
        wait([dist.all_reduce(pair, group=self.group, async_op=True)], check)
        return (pair[0] / pair[1]).to(loss.dtype), int(round(pair[1].item()))

    def finish(self, pending: Pending, check: Callable[[], None]) -> None:
        """Wait for the sums (looking for failures elsewhere meanwhile); note when they ended."""
        wait(pending.works, check, pending.nbytes)
        pending.end = time.perf_counter()

    def assign(self, pending: Pending, total: int) -> None:
        """Divide the sums by the global batch's size into the parameters' gradients."""
        for bucket, tensor in pending.flat:
            tensor.div_(total)
            for i, mean in zip(bucket, _unflatten_dense_tensors(tensor, [pending.gradients[j] for j in bucket])):
                pending.gradients[i].copy_(mean)


def wait(works: list, check: Callable[[], None], nbytes: int = 16) -> None:
    """Wait for collectives of `nbytes` in all, calling `check` meanwhile, up to a transfer's bound
    (then Stalled, which the call reports to every rank, aborting the groups); a broken one is a
    StageFailed (or the reported cause)."""
    until_completed(works, check, within=progress_bound(nbytes),  # a replica may be behind, as a header waits
                    what=f"the all-reduce of {nbytes} bytes with the other replicas")
    for work in works:
        try:
            work.wait()
        except Exception as error:
            check()
            raise StageFailed("the gradient all-reduce with the other replicas broke "
                              f"({str(error).splitlines()[0][:200]}); a replica's process has probably died") from None
