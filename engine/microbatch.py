"""Splitting a mini-batch into micro-batches and joining outputs back, with input checks."""
from __future__ import annotations

from typing import Sequence, Union

import torch

Value = Union[torch.Tensor, tuple]  # a tensor, or a tuple of tensors, as layers hand them on


def check_inputs(inputs) -> int:
    """Return the batch size of `inputs` (a tensor or a non-empty tuple of tensors) or raise TypeError."""
    if isinstance(inputs, torch.Tensor):
        tensors = (inputs,)
    elif isinstance(inputs, tuple) and inputs and all(isinstance(t, torch.Tensor) for t in inputs):
        tensors = inputs
    else:
        raise TypeError(
            f"inputs must be a tensor or a non-empty tuple of tensors, got {_describe(inputs)}")
    if any(t.dim() == 0 for t in tensors):
        raise ValueError("inputs must have a batch dimension (dim 0); got a 0-dimensional tensor")
    sizes = {t.shape[0] for t in tensors}
    if len(sizes) != 1:
        raise ValueError(f"all input tensors must share the batch size (dim 0), got sizes {sorted(sizes)}")
    size = sizes.pop()
    if size == 0:
        raise ValueError("inputs are an empty batch (dim 0 has size 0); expected at least one sample")
    return size


def check_targets(targets, batch_size: int) -> None:
    """Raise if `targets` is not a tensor whose dim 0 matches the inputs' batch size."""
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be a tensor, got {_describe(targets)}")
    if targets.dim() == 0 or targets.shape[0] != batch_size:
        got = "a 0-dimensional tensor" if targets.dim() == 0 else f"batch size {targets.shape[0]}"
        raise ValueError(f"targets must have the inputs' batch size {batch_size} in dim 0, got {got}")


def scatter(value: Value, chunks: int) -> list[Value]:
    """Split a tensor or tuple of tensors along dim 0 exactly as torch.chunk does.

    torch.chunk may return fewer than `chunks` pieces (batch 5 in 4 chunks gives 2, 2, 1; batch 3
    gives 3 of 1): the pipeline then runs that many micro-batches, so the short last batch of an
    epoch trains like any other.
    """
    if isinstance(value, torch.Tensor):
        return list(value.chunk(chunks))
    parts = [t.chunk(chunks) for t in value]
    return [tuple(p[i] for p in parts) for i in range(len(parts[0]))]


def gather(outputs: Sequence[Value]) -> Value:
    """Concatenate per-micro-batch outputs along dim 0 (element-wise for tuples)."""
    if isinstance(outputs[0], torch.Tensor):
        return torch.cat(list(outputs))
    return tuple(torch.cat([o[i] for o in outputs]) for i in range(len(outputs[0])))


def tensors_of(value: Value) -> tuple[torch.Tensor, ...]:
    """The tensors a stage boundary carries, as a tuple."""
    return (value,) if isinstance(value, torch.Tensor) else tuple(value)


def rebuild(value: Value, tensors: Sequence[torch.Tensor]) -> Value:
    """Put `tensors` back into the shape of `value` (a lone tensor or a tuple)."""
    return tensors[0] if isinstance(value, torch.Tensor) else tuple(tensors)


def as_leaves(value: Value) -> Value:
    """Cut the graph: float tensors become fresh leaves that require grad (their .grad is what a
    stage sends back), other tensors are passed on detached."""
    return rebuild(value, [t.detach().requires_grad_(t.is_floating_point() or t.is_complex())
                           for t in tensors_of(value)])


def detached(value: Value) -> Value:
    """The value without its autograd history."""
    return rebuild(value, [t.detach() for t in tensors_of(value)])


def _describe(obj) -> str:
    if isinstance(obj, tuple):
        return "an empty tuple" if not obj else f"a tuple of ({', '.join(type(o).__name__ for o in obj)})"
    return f"{type(obj).__name__}"
