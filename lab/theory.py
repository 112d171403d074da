"""GPipe's formulas and the paper's numbers, as plain functions.

K = stages (devices), M = micro-batches per mini-batch, N = mini-batch size, L = layers.
"""
from __future__ import annotations

from typing import Sequence

# Table 2 of the paper: Transformer on TPUs, speedup over one device, by (K, M).
PAPER_SPEEDUP = {(2, 1): 1.0, (4, 1): 1.07, (8, 1): 1.3,
                 (2, 4): 1.7, (4, 4): 3.2, (8, 4): 4.8,
                 (2, 32): 1.8, (4, 32): 3.4, (8, 32): 6.3}
# Table 1: on TPUv3 cores with 16 GB each, re-materialization alone lets one core hold a 2.7x
# larger Transformer; with 128 partitions the model grows from 282M to 83.9B parameters.
PAPER_REMAT_GROWTH = 2.7
PAPER_LARGEST_PARAMS = {"naive-1": 282.2e6, "pipeline-128": 83.9e9}


def bubble(stages: int, micro_batches: int) -> float:
    """Fraction of time each device idles in a fill-drain schedule: (K-1) / (M+K-1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def utilization(stages: int, micro_batches: int) -> float:
    """Fraction of time each device is busy: M / (M+K-1)."""
    return micro_batches / (micro_batches + stages - 1)


def ideal_speedup(stages: int, micro_batches: int) -> float:
    """Throughput over one device when stages are perfectly balanced and transfers free: K*M/(M+K-1)."""
    return stages * utilization(stages, micro_batches)


def micro_batches_for_small_bubble(stages: int) -> int:
    """The paper's rule of thumb: M >= 4K makes the bubble negligible ((K-1)/(5K-1) < 20% at M = 4K)."""
    return 4 * stages


def activation_bytes(batch: int, layers: int, stages: int, micro_batches: int, layer_bytes: float,
                     input_bytes: float, recompute: bool) -> float:
    """Activation memory one stage holds at its peak, for L identical layers.

    `layer_bytes` is what one layer adds for backward per sample (beyond its input), `input_bytes`
    the size of one sample's stage input. Without recompute a stage keeps its input and every
    layer's activations for all M micro-batches: N * (input_bytes + (L/K) * layer_bytes), so one
    device running everything holds O(N*L). With re-materialization it keeps only each
    micro-batch's input, plus the activations of one micro-batch while it is recomputed:
    N * input_bytes + (L/K) * (N/M) * layer_bytes, that is O(N + (L/K)(N/M)).
    """
    return stage_activation_bytes([layer_bytes] * round(layers / stages), input_bytes, batch,
                                  micro_batches, recompute)


def stage_activation_bytes(layer_bytes: Sequence[float], input_bytes: float, batch: int, micro_batches: int,
                           recompute: bool) -> float:
    """The same model for one stage whose layers keep different amounts (bytes per sample each)."""
    if not recompute:
        return batch * (input_bytes + sum(layer_bytes))
    return batch * input_bytes + (batch / micro_batches) * sum(layer_bytes)


def data_vs_pipeline(param_bytes: int, boundary_bytes_per_sample: float, batch: int, devices: int) -> dict:
    """Per device and per training step, what data parallelism and a K-stage pipeline hold and send.

    Data parallel: every device keeps the whole model and, per step, all-reduces the gradients
    (a ring all-reduce sends about 2 (K-1)/K of the gradient bytes from each device). Pipeline:
    each device keeps 1/K of the model and, per step, sends each boundary activation forward and
    its gradient back: 2 x N x (bytes per sample at a boundary), on each of the K-1 boundaries.
    """
    k = devices
    return {
        "data parallel: model bytes per device": param_bytes,
        "pipeline: model bytes per device": param_bytes / k,
        "data parallel: bytes sent per device per step": 2 * (k - 1) / k * param_bytes,
        "pipeline: bytes sent per boundary per step": 2 * batch * boundary_bytes_per_sample,
    }
