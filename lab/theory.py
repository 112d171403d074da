"""GPipe's formulas and the paper's numbers, as plain functions.

K = stages (devices), M = micro-batches per mini-batch, N = mini-batch size, L = layers.
"""
from __future__ import annotations

from typing import Optional, Sequence

from engine.schedule import SCHEDULES, check, check_schedule, fill_drain_bubble, gpipe, timeline

# Table 2 of the paper: normalized training throughput on TPUs by (K, M). Each model is normalized
# to its own K=2, M=1 cell (value 1): the paper has no one-device column, and its caption says the
# batch size was adjusted to fit memory where necessary, so the cells are not all the same work.
PAPER_TABLE2 = {
    "Transformer-48": {(2, 1): 1.0, (4, 1): 1.07, (8, 1): 1.3, (2, 4): 1.7, (4, 4): 3.2, (8, 4): 4.8,
                       (2, 32): 1.8, (4, 32): 3.4, (8, 32): 6.3},
    "AmoebaNet-D (18, 256)": {(2, 1): 1.0, (4, 1): 1.13, (8, 1): 1.38, (2, 4): 1.07, (4, 4): 1.26, (8, 4): 1.72,
                              (2, 32): 1.21, (4, 32): 1.84, (8, 32): 3.48},
}
PAPER_SPEEDUP = PAPER_TABLE2["Transformer-48"]
# Table 3: P100 GPUs without NVLink (activations cross device-host-device over PCIe), M=32,
# normalized to K=2 for each model.
PAPER_TABLE3 = {"AmoebaNet-D (18, 128)": {2: 1.0, 4: 1.7, 8: 2.7}, "Transformer-24": {2: 1.0, 4: 1.8, 8: 3.3}}
# Why Table 2's cells sit where they do against the lab's unit-cost model (`why_cells_exceed`):
# the model put on the paper's scale (`on_paper_scale`), then what the paper says that bears on
# them (§2.3, §3 and Table 2's caption).
PAPER_VS_MODEL = ("K·M/(M+K-1) is the unit-cost ideal without recompute: equal stages, free transfers and the same "
                  "work in every cell. The paper describes GPipe with re-materialization (§2.3), and the lab's model "
                  "assumes Table 2's runs recomputed every micro-batch. With recompute the lab's unit-cost timeline "
                  "(forward 1, recompute 1, backward 2) differs: a stage can recompute a micro-batch while the next "
                  "stage still runs its backward, which one device cannot do, but every cell does a third more work. "
                  "Put on the paper's scale (over the same model's K=2, M=1 cell, the one normalization of these "
                  "tables) that model gives {m4k4:.2f} and {m4k8:.2f} at M=4, {m32k4:.2f} and {m32k8:.2f} at M=32, "
                  "for K=4 and 8. The paper's Transformer is above it in all four cells ({t4m4}, {t8m4}, {t4m32}, "
                  "{t8m32}), by far at M=4; its AmoebaNet is below it in the same cells, held back, the paper says, "
                  "by computation unevenly spread over its layers (§3). So the lab's model does not account for "
                  "the Transformer's cells. What the paper says that bears on them: it found the bubble overhead "
                  "negligible when M ≥ 4K, partly because recomputation in the backward pass can be scheduled "
                  "early, before the gradients from the layers above arrive (§2.3), the overlap the lab's model "
                  "already counts; and Table 2's caption says the batch size was adjusted to fit memory where "
                  "necessary, so the cells did not all do the same work. The paper does not say how much either "
                  "moved a cell, and the lab does not guess")
# Table 1: on TPUv3 cores with 16 GB each, re-materialization alone lets one core hold a 2.7x
# larger Transformer.
PAPER_REMAT_GROWTH = 2.7


def bubble(stages: int, micro_batches: int) -> float:
    """Fraction of time each device idles in a fill-drain schedule: (K-1) / (M+K-1)."""
    return fill_drain_bubble(stages, micro_batches)


def utilization(stages: int, micro_batches: int) -> float:
    """Fraction of time each device is busy: M / (M+K-1)."""
    return micro_batches / (micro_batches + stages - 1)


def ideal_speedup(stages: int, micro_batches: int) -> float:
    """Throughput over one device when stages are perfectly balanced, transfers free and nothing is
    recomputed: K*M/(M+K-1), the unit-cost ideal without recompute (not a bound: with recompute
    the stages can beat it, see `recompute_overlap_speedup`)."""
    return stages * utilization(stages, micro_batches)


def micro_batches_for_small_bubble(stages: int) -> int:
    """The paper's rule of thumb (§2.3): M >= 4K makes the bubble negligible ((K-1)/(5K-1) < 20% at M = 4K)."""
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


# --- the schedules that came after GPipe ------------------------------------------------------

SCHEDULE_PAPERS = {name: kind.paper for name, kind in SCHEDULES.items()}


def time_vs_one_device(stages: int, micro_batches: int, checkpoint: str = "never",
                       shares: Optional[Sequence[float]] = None) -> float:
    """A step's time in the unit-cost model, over one device's on the whole mini-batch without
    recompute (forward 1 + backward 2 = 3 units): GPipe's fill-drain timeline of K stages with
    `checkpoint`, each task costing its unit (forward 1, recompute 1, backward 2) over K·M. Without
    recompute (M+K-1)/(KM); with it less than (M+K-1)(3+1)/(3KM), since stage k's recompute of a
    micro-batch needs only its kept input and runs while stage k+1 still computes the gradient it
    waits for. The one time model of the lessons and of `fit.predict`. `shares`: each stage's share
    of the model's work where the cut is uneven (equal shares, 1/K each, by default)."""
    costs = unit_costs("gpipe")
    shares = shares or [1 / stages] * stages
    times = timeline(gpipe(stages, micro_batches, checkpoint),
                     lambda stage, task: costs[task.op] * shares[stage] / micro_batches)
    return max(end for stage in times for _, end in stage) / 3


def recompute_overlap_speedup(stages: int, micro_batches: int, checkpoint: str = "always") -> float:
    """K stages over one device running the same micro-batches and recompute, in the unit-cost
    model (time_vs_one_device). Without recompute this is K*M/(M+K-1); with it, more (the overlap)."""
    return time_vs_one_device(1, micro_batches, checkpoint) / time_vs_one_device(stages, micro_batches, checkpoint)


def on_paper_scale(stages: int, micro_batches: int, checkpoint: str = "always",
                   shares: Optional[Sequence[float]] = None) -> float:
    """The unit-cost model's throughput at (K, M) over its own K=2, M=1 cell: the normalization of
    the paper's Table 2, with every micro-batch recomputed, as the lab assumes of Table 2's runs
    (the paper describes GPipe with re-materialization, §2.3). Without recompute it
    is K*M/(M+K-1) itself (whose K=2, M=1 cell is 1), the unit-cost ideal. The one scale on which
    the lessons, the app and `lab.reproduce` compare the paper's cells with the model. `shares`:
    the stages' shares of the work, for an uneven cut (time_vs_one_device)."""
    return time_vs_one_device(2, 1, checkpoint) / time_vs_one_device(stages, micro_batches, checkpoint, shares)


def why_cells_exceed() -> str:
    """The paper's Table 2 cells against the unit-cost model on the paper's scale, in this model's
    own numbers, with what the paper says that bears on them."""
    return PAPER_VS_MODEL.format(m4k4=on_paper_scale(4, 4), m4k8=on_paper_scale(8, 4), m32k4=on_paper_scale(4, 32),
                                 m32k8=on_paper_scale(8, 32), t4m4=PAPER_SPEEDUP[(4, 4)], t8m4=PAPER_SPEEDUP[(8, 4)],
                                 t4m32=PAPER_SPEEDUP[(4, 32)], t8m32=PAPER_SPEEDUP[(8, 32)])


def unit_costs(schedule: str, virtual: int = 1) -> dict[str, float]:
    """Task costs of the unit-cost model, per chunk: a stage's forward is 1 and its backward 2 (F=1,
    B=2, a recompute is one more forward); the zero-bubble paper's accounting splits the backward
    into B=1 and W=1 (the schedules that split it: ZB-H1, ZB-V). A chunk of a stage of v chunks does
    1/v of the stage's work."""
    split = SCHEDULES[check_schedule(schedule)].splits_backward
    costs = {"F": 1.0, "B": 1.0, "W": 1.0, "R": 1.0} if split else {"F": 1.0, "B": 2.0, "R": 1.0}
    return {op: cost / virtual for op, cost in costs.items()}


def schedule_bubble(schedule: str, stages: int, micro_batches: int, virtual: int = 1) -> float:
    """Idle fraction of the K stages in the unit-cost model, without recompute (the schedule's entry
    in engine.schedule.SCHEDULES). gpipe and 1f1b: (K-1)/(M+K-1), the same idle time in another
    order. interleaved: the fill and drain pass through chunks of 1/v the work, (K-1)/(vM+K-1).
    zb-h1 (F=B=W=1): 1F1B leaves each stage 3(K-1) units idle; ZB-H1 fills two thirds of it with
    deferred W's, (K-1)/(3M+K-1). A schedule without a closed form (zb-v): its unit-cost timeline's."""
    kind = SCHEDULES[check_schedule(schedule)]
    if kind.bubble is not None:
        return kind.bubble(stages, micro_batches, virtual)
    return check(kind(stages, micro_batches, "never", virtual), micro_batches, "never").bubble


def peak_in_flight(schedule: str, stages: int, micro_batches: int, stage: int, virtual: int = 1) -> float:
    """Most micro-batches whose activations stage `stage` holds at once (forward done, backward or,
    where the backward is split, weight gradient not yet), counted in whole stages' worth: a chunk of
    a stage of v holds 1/v of its layers. gpipe: M. 1f1b: K-k. interleaved: Megatron's fill of
    2(K-1-k) + (v-1)K chunk forwards, plus one, over v. zb-h1 and zb-v: K on every stage, as many as
    1F1B's first stage holds."""
    return float(SCHEDULES[check_schedule(schedule)].held(stages, micro_batches, stage, virtual))
