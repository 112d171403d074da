"""Are your pipelined gradients those of one device? For each K and M, every parameter's largest
difference from one device on the whole batch, whether K changes a single bit, and, where they
differ, the cause, found by test: kernels that differ run to run, dropout's streams, batch norm's
per-micro-batch statistics or another layer that sees the batch as a whole, float32's order of sums."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import nn

from engine import GPipe
from lab.yours.model import Yours

Grads = list[tuple[str, torch.Tensor]]
CLOSE = 1e-5   # relative to the largest gradient: float32's rounding of sums taken in another order


@dataclass
class Row:
    """One (K, M): how far the pipeline's gradients are from one device's, and why."""

    stages: int
    micro_batches: int
    largest_abs: float = 0.0
    largest_rel: float = 0.0
    worst: str = ""                       # the parameter with the largest relative difference
    same_bits_as_k1: Optional[bool] = None
    refused: str = ""                     # why this K cannot cut the model (tied weights)
    cause: str = ""
    per_parameter: list = field(default_factory=list)  # (name, largest abs, largest rel)


def pipelined(yours: Yours, stages: int, micro: int, model: Optional[nn.Sequential] = None,
              deferred: bool = False) -> tuple[Grads, nn.Sequential]:
    """One step's gradients through GPipe: K stages as threads, one thread each (a kernel's sums
    follow its threads), M micro-batches, recompute except the last, seeded streams."""
    model = model if model is not None else yours.fresh()
    pipe = GPipe(model, stages, chunks=micro, checkpoint="except_last", seed=0, threads_per_stage=1,
                 deferred_batch_norm=deferred)
    try:
        pipe.step(yours.inputs, yours.targets, yours.loss_fn)
    finally:
        pipe.close()
    return [(n, p.grad.clone()) for n, p in model.named_parameters()], model


@torch.random.fork_rng(devices=[])
def one_device(yours: Yours, model: Optional[nn.Sequential] = None, micro: int = 1) -> Grads:
    """The reference: the loss on the whole mini-batch through the model, no pipeline (with
    `micro` > 1, the micro-batches one after another, each weighted by its share, summed), its
    random stream seeded alike on every call."""
    model = model if model is not None else yours.fresh()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)  # dropout's masks the same from run to run (fork_rng keeps the caller's stream)
        size = yours.inputs.shape[0]
        for x, y in zip(yours.inputs.chunk(micro), yours.targets.chunk(micro)):
            (yours.loss_fn(model(x), y) * (x.shape[0] / size)).backward()
    finally:
        torch.set_num_threads(threads)
    return [(n, p.grad.detach().clone()) for n, p in model.named_parameters() if p.grad is not None]


def differences(got: Grads, expected: Grads) -> list[tuple[str, float, float]]:
    """Per parameter: (name, largest absolute difference, that over the reference's largest value)."""
    rows = []
    for (name, a), (_, b) in zip(got, expected):
        largest = (a - b).abs().max().item()
        rows.append((name, largest, largest / max(b.abs().max().item(), 1e-30)))
    return rows


def same_bits(a: Grads, b: Grads) -> bool:
    return all(torch.equal(x, y) for (_, x), (_, y) in zip(a, b))


def close(a: Grads, b: Grads) -> bool:
    return all(rel <= CLOSE for _, _, rel in differences(a, b))


def without_dropout(yours: Yours) -> Yours:
    """The same model with every dropout's probability 0: its masks out of the question."""
    quiet = copy.copy(yours)
    quiet.model = yours.fresh()
    for module in quiet.model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
    return quiet


def has(model: nn.Module, kind: type) -> bool:
    return any(isinstance(m, kind) for m in model.modules())


def cause(yours: Yours, micro: int, got: Grads, reference: Grads) -> str:
    """Why the pipeline's gradients differ from one device's at this M, found by test."""
    again = one_device(yours)
    if not same_bits(again, reference):
        worst = max(rel for _, _, rel in differences(again, reference))
        return f"non-deterministic kernels: one device run twice differs by up to {worst:.1e} of the largest value"
    quiet = yours
    if has(yours.model, nn.modules.dropout._DropoutNd):
        quiet = without_dropout(yours)
    alone, whole, in_turn = pipelined(quiet, 1, micro)[0], one_device(quiet), one_device(quiet, micro=micro)
    if quiet is not yours and close(alone, in_turn) and close(alone, whole):
        return ("dropout: the pipeline draws each micro-batch's masks from seeded streams of its own (the same "
                "for every K), one device from torch's global stream; with dropout at 0 they agree")
    if micro > 1 and close(alone, in_turn) and not close(alone, whole):
        if has(yours.model, nn.modules.batchnorm._BatchNorm):
            return ("batch norm: in training each micro-batch is normalized with its own statistics, as on one "
                    "device fed the micro-batches one at a time (the same for every K; M=1 is the whole batch)")
        return ("a layer depends on the batch as a whole (it normalizes or mixes across samples): with M micro-"
                "batches it sees each alone, as one device fed them one at a time would")
    if close(got, reference):
        return "float32's rounding: the micro-batches' gradients are summed in another order than one batch's"
    return "not found: the gradients differ from one device's, and from one device fed the micro-batches in turn"


def table(yours: Yours, stages: Sequence[int], micro: Sequence[int]) -> list[Row]:
    """A row for each K and M: the pipeline's gradients against one device's, K against K=1."""
    reference = one_device(yours)
    rows = []
    layers = len(yours.model)
    for m in micro:
        first: Optional[Grads] = None
        found = ""
        for k in sorted(set([1, *stages])):
            if k > layers:
                continue
            row = Row(k, m)
            try:
                got, _ = pipelined(yours, k, m)
            except ValueError as error:
                row.refused = str(error)
                if k in stages:
                    rows.append(row)
                continue
            first = got if k == 1 else first
            row.per_parameter = differences(got, reference)
            name, row.largest_abs, row.largest_rel = max(row.per_parameter, key=lambda d: d[2])
            row.worst = name
            row.same_bits_as_k1 = same_bits(got, first)
            if not same_bits(got, reference):
                found = found or cause(yours, m, got, reference)
                row.cause = found
            if k in stages:
                rows.append(row)
    return rows


def running_statistics(yours: Yours, stages: int, micro: int) -> Optional[str]:
    """For a model with batch norm: how far its running statistics land from one device's after one
    step, per micro-batch and with deferred batch norm (the mini-batch's statistics)."""
    if not has(yours.model, nn.modules.batchnorm._BatchNorm):
        return None
    single = yours.fresh()
    single.train()
    with torch.no_grad():
        single(yours.inputs)
    gaps = []
    for deferred in (False, True):
        _, model = pipelined(yours, stages, micro, deferred=deferred)
        gaps.append(max((a - b).abs().max().item() for a, b in zip(model.buffers(), single.buffers())
                        if a.is_floating_point()))
    return (f"running statistics after one step at K={stages}, M={micro}: {gaps[0]:.2e} from one device's "
            f"(each micro-batch's statistics); with deferred_batch_norm=True {gaps[1]:.2e} (the mini-batch's)")
