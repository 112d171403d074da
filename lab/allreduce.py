"""What data parallelism sends instead: a real all-reduce of gradient-sized tensors among K local
processes over gloo, timed (the lessons set it beside what a pipeline's cuts carry).

Data parallelism keeps a whole copy of the model on each of K devices and, after every step, sums
the gradients of all copies: in a ring all-reduce each device sends about 2(K-1)/K times the
gradients' bytes. Here the processes are spawned, meet at a Store this process hosts on loopback,
all-reduce a tensor of that size a few times, and report the median; none is left behind.
"""
from __future__ import annotations

import queue
import statistics
import time
from datetime import timedelta

import torch
import torch.multiprocessing as mp


def time_all_reduce(nbytes: int, devices: int = 2, rounds: int = 5, timeout: float = 120.0) -> dict:
    """Seconds one gloo all-reduce of `nbytes` (float32) takes among `devices` processes on this
    host (median over `rounds`, after a warm-up), and the bytes a ring sends per device."""
    if devices < 2:
        raise ValueError(f"devices={devices}: an all-reduce needs at least 2 processes")
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=timeout))
    context = mp.get_context("spawn")
    answers = context.Queue()
    numel = max(1, nbytes // 4)
    workers = [context.Process(target=_all_reduce, args=(rank, devices, store.port, numel, rounds, answers),
                               daemon=True) for rank in range(devices)]
    for worker in workers:
        worker.start()
    try:
        times = answers.get(timeout=timeout)
    except queue.Empty:
        raise RuntimeError(f"the all-reduce processes did not answer within {timeout:.0f} s") from None
    finally:
        for worker in workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.kill()
                worker.join()
    if isinstance(times, str):
        raise RuntimeError(f"an all-reduce process failed: {times}")
    return {"devices": devices, "gradient bytes": numel * 4, "bytes sent per device (ring)": 2 * (devices - 1) /
            devices * numel * 4, "seconds": statistics.median(times), "rounds": len(times)}


def _all_reduce(rank: int, devices: int, port: int, numel: int, rounds: int, answers) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=client, rank=rank, world_size=devices)
        tensor = torch.ones(numel)
        dist.all_reduce(tensor)  # warm-up: connections, buffers
        times = []
        for _ in range(rounds):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            times.append(time.perf_counter() - start)
        if rank == 0:
            answers.put(times)
        dist.barrier()
        dist.destroy_process_group()
    except Exception as error:  # reported to the parent, which raises it
        answers.put(f"rank {rank}: {type(error).__name__}: {error}")
