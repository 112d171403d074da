"""What data parallelism sends instead: a real all-reduce of gradient-sized tensors among K local
processes over gloo, timed (the lessons set it beside what a pipeline's cuts carry).

Data parallelism keeps a whole copy of the model on each of K devices and, after every step, sums
the gradients of all copies: in a ring all-reduce each device sends about 2(K-1)/K times the
gradients' bytes. Here the processes are spawned, meet at a Store in a private file of this
process's (gloo on loopback: nothing listens on a network, lab/machine/loopback.py), all-reduce
a tensor of that size a few times, and report the median; none is left behind.
"""
from __future__ import annotations

import statistics
import time

import torch

from lab.machine.loopback import Meeting, join
from lab.processes.children import Children


def time_all_reduce(nbytes: int, devices: int = 2, rounds: int = 5, timeout: float = 120.0) -> dict:
    """Seconds one gloo all-reduce of `nbytes` (float32) takes among `devices` processes on this
    host (median over `rounds`, after a warm-up), and the bytes a ring sends per device."""
    if devices < 2:
        raise ValueError(f"devices={devices}: an all-reduce needs at least 2 processes")
    meeting = Meeting()
    numel = max(1, nbytes // 4)
    try:
        members = Children(Member, [(rank, devices, meeting.path) for rank in range(devices)], name="all-reduce",
                           timeout=timeout, env=meeting.env)
        try:
            times = members.ask([(numel, rounds)] * devices)[0]
        finally:
            members.close()
    finally:
        meeting.close()
    return {"devices": devices, "gradient bytes": numel * 4, "bytes sent per device (ring)": 2 * (devices - 1) /
            devices * numel * 4, "seconds": statistics.median(times), "rounds": len(times)}


class Member:
    """One process of the all-reduce: joins the group, then times all-reduces of the size asked."""

    def __init__(self, rank: int, devices: int, store: str):
        torch.set_num_threads(1)
        join(store, rank, devices, timeout=60)

    def __call__(self, command: tuple[int, int]) -> list[float]:
        import torch.distributed as dist

        numel, rounds = command
        tensor = torch.ones(numel)
        dist.all_reduce(tensor)  # warm-up: connections, buffers
        times = []
        for _ in range(rounds):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            times.append(time.perf_counter() - start)
        return times

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()
