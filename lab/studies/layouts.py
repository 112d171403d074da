"""Pipelines and replicas: W workers as D data-parallel replicas of a K-stage pipeline (D x K = W),
at a fixed global batch B = b·M·D (b samples per micro-batch, M micro-batches per replica).

`compare` runs each layout of a few workers on this host: a replica's pipeline step for real (its
task times measured one at a time and replayed on K devices, since a 2-core host cannot run K
stages of D replicas at once), the bytes crossing cuts and the bytes all-reduced, the memory of a
worker, and a gloo all-reduce of a stage's gradients among D processes, measured. `LargeRun` is the
same trade-off at scale, in closed form, for choosing D and K for a large model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from lab import theory
from lab.config import RunConfig
from lab.runs.experiments import run
from lab.studies import allreduce
from lab.timelines import replay


def layouts(workers: int, layers: int) -> list[tuple[int, int]]:
    """Every (D, K) with D x K = workers and K no more than the model's layers, deepest first."""
    return [(workers // k, k) for k in range(workers, 0, -1) if workers % k == 0 and k <= layers]


def micro_batches(global_batch: int, micro_size: int, replicas: int) -> int:
    """M = B / (b·D): at a fixed global batch, each replica gets fewer micro-batches as D grows."""
    if global_batch % (micro_size * replicas):
        raise ValueError(f"a global batch of {global_batch} does not split into {replicas} replica(s) of whole "
                         f"micro-batches of {micro_size}")
    return global_batch // (micro_size * replicas)


def compare(base: RunConfig, workers: int, global_batch: int, micro_size: int,
            progress: Optional[Callable[[str], None]] = None) -> list[dict]:
    """One row per layout of `workers`: micro-batches and bubble per replica, bytes per step across
    the cuts (all replicas) and all-reduced (per worker, ring), a worker's memory, and the step's
    time: the replayed pipeline of one replica plus the measured all-reduce of its largest stage's
    gradients (replicas run side by side, so one replica's time is the step's)."""
    rows = []
    for replicas, stages in layouts(workers, base.layers):
        m = micro_batches(global_batch, micro_size, replicas)
        config = base.but(stages=stages, micro_batches=m, batch=global_batch // replicas, transport="threads")
        record = run(config, replay="always")
        line = replay.of_record(record, "ideal replay")
        worst = max(record.memory, key=lambda s: s["param_bytes"] + s["activation_peak_bytes"])
        gradient_bytes = max(s["grad_bytes"] for s in record.memory)
        reduce = allreduce.time_all_reduce(gradient_bytes, devices=replicas, rounds=3) if replicas > 1 else None
        cut = sum(b["activations"] + b["gradients"] for b in record.boundary_bytes) * replicas
        rows.append({
            "D x K": f"{replicas} x {stages}", "D": replicas, "K": stages, "M per replica": m,
            "bubble (theory)": round(theory.bubble(stages, m), 3), "bubble (replay)": round(line.bubble, 3),
            "bytes across cuts (all replicas)": cut,
            "bytes all-reduced per worker (ring)": round(2 * (replicas - 1) / replicas * gradient_bytes),
            "memory per worker (bytes)": 4 * worst["param_bytes"] + worst["activation_peak_bytes"],
            "pipeline ms (replayed)": round(line.makespan * 1e3, 2),
            "all-reduce ms (measured)": round(reduce["seconds"] * 1e3, 2) if reduce else 0.0,
            "step ms": round((line.makespan + (reduce["seconds"] if reduce else 0.0)) * 1e3, 2)})
        if progress is not None:
            progress(f"{replicas} x {stages}")
    return rows


@dataclass(frozen=True)
class LargeRun:
    """A large training run to lay out: W workers of `memory` bytes each, a Transformer of `params`
    parameters in `layers` layers of width `width` with `heads` attention heads, a global batch of
    `global_batch` sequences of `sequence` tokens, micro-batches of `micro_size`. Every micro-batch
    is recomputed (GPipe's re-materialization); training keeps 16 bytes per parameter (weights,
    gradients, Adam's moments) and all-reduces 4-byte gradients. `selective` names the attention's
    recompute choice: False keeps the a·s² attention scores and their softmax while a micro-batch
    runs its backward; True recomputes them (Korthikanti et al.'s selective recompute) or never
    stores them (a fused attention kernel)."""

    workers: int = 8
    memory: float = 80e9                  # bytes per worker
    params: float = 12e9
    layers: int = 48
    width: int = 4096
    heads: int = 32
    sequence: int = 2048
    global_batch: int = 128
    micro_size: int = 4
    flops: float = 400e12                 # what a worker achieves, per second
    bandwidth: float = 100e9              # bytes per second each worker sends in an all-reduce
    selective: bool = False

    def layer_bytes(self) -> float:
        """Bytes one layer keeps for its backward per micro-batch, in 16-bit, as Korthikanti et al.
        (2022, "Reducing Activation Recomputation in Large Transformer Models") count them:
        s·b·h·(34 + 5·a·s/h) with the attention's scores kept, s·b·h·34 with `selective`."""
        s, b, h = self.sequence, self.micro_size, self.width
        return s * b * h * (34 + (0 if self.selective else 5 * self.heads * s / h))

    def memory_of(self, replicas: int, stages: int) -> float:
        """Bytes a worker holds: 16 per parameter of its stage, the kept input of each of its M
        micro-batches (2·s·b·h bytes each, 16-bit), and while one micro-batch is recomputed and runs
        its backward, that micro-batch's activations of the stage's layers (`layer_bytes`)."""
        m = micro_batches(self.global_batch, self.micro_size, replicas)
        kept_input = 2 * self.sequence * self.micro_size * self.width
        return 16 * self.params / stages + (self.layers / stages) * self.layer_bytes() + m * kept_input

    def seconds(self, replicas: int, stages: int) -> dict:
        """The step's time: one replica's pipeline in the lessons' one time model,
        theory.time_vs_one_device(K, M, "always") times one device's forward and backward of the
        replica's b·M sequences without recompute (6 flops per parameter and token), then the ring
        all-reduce of a stage's gradients among the D replicas."""
        m = micro_batches(self.global_batch, self.micro_size, replicas)
        one_device = 6 * self.params * self.sequence * self.micro_size * m / self.flops
        pipeline = theory.time_vs_one_device(stages, m, "always") * one_device
        reduce = 2 * (replicas - 1) / replicas * 4 * self.params / stages / self.bandwidth
        return {"pipeline": pipeline, "all-reduce": reduce, "step": pipeline + reduce}

    def table(self) -> list[dict]:
        """Every layout of the workers: whether it fits, its bubble and its time."""
        rows = []
        for replicas, stages in layouts(self.workers, self.layers):
            try:
                m = micro_batches(self.global_batch, self.micro_size, replicas)
            except ValueError:
                continue
            time = self.seconds(replicas, stages)
            rows.append({"D": replicas, "K": stages, "M": m, "bubble": round(theory.bubble(stages, m), 3),
                         "GB per worker": round(self.memory_of(replicas, stages) / 1e9, 1),
                         "fits": self.memory_of(replicas, stages) <= self.memory,
                         "pipeline s": round(time["pipeline"], 3), "all-reduce s": round(time["all-reduce"], 3),
                         "step s": round(time["step"], 3)})
        return rows

    def best(self) -> tuple[int, int]:
        """The fastest layout that fits."""
        fitting = [row for row in self.table() if row["fits"]]
        if not fitting:
            raise ValueError("no layout of these workers holds the model")
        row = min(fitting, key=lambda r: r["step s"])
        return row["D"], row["K"]
