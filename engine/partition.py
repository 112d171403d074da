"""Cutting an nn.Sequential into consecutive stages, by an explicit or an even balance."""
from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from typing import Callable, Sequence, Union

from torch import nn


def check_module(module) -> nn.Sequential:
    """Return `module` if it is a non-empty nn.Sequential, else raise a TypeError/ValueError."""
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"module must be an nn.Sequential (the pipeline cuts it between layers), "
                        f"got {type(module).__name__}")
    if len(module) == 0:
        raise ValueError("module is an empty nn.Sequential; expected at least one layer")
    return module


def even_balance(layers: int, stages: int) -> list[int]:
    """Layer counts for `stages` stages as equal as possible, earlier stages taking the extra layers."""
    base, extra = divmod(layers, stages)
    return [base + (1 if k < extra else 0) for k in range(stages)]


def resolve_balance(balance: Union[int, Sequence[int]], layers: int) -> list[int]:
    """Check `balance` (layers per stage, or a stage count K) against a model of `layers` layers."""
    if isinstance(balance, bool) or not isinstance(balance, (int, Sequence)) or isinstance(balance, str):
        raise TypeError(f"balance must be an int (number of stages) or a list of layer counts, got {balance!r}")
    if isinstance(balance, int):
        if balance < 1:
            raise ValueError(f"balance={balance} stages: expected at least 1")
        if balance > layers:
            raise ValueError(f"balance={balance} stages but the model has only {layers} layers; "
                             f"expected at most one stage per layer")
        return even_balance(layers, balance)
    balance = list(balance)
    if not balance:
        raise ValueError("balance is empty; expected one layer count per stage")
    for k, count in enumerate(balance):
        if isinstance(count, bool) or not isinstance(count, int):
            raise TypeError(f"balance[{k}]={count!r} is not an int layer count")
        if count < 1:
            raise ValueError(f"balance[{k}]={count}: every stage needs at least one layer")
    if sum(balance) != layers:
        raise ValueError(f"balance {balance} sums to {sum(balance)} but the model has {layers} layers; "
                         f"expected the counts to sum to {layers}")
    return balance


class Partition(nn.Sequential):
    """One stage's layers, the model's own modules. While its stage runs a task, calling it runs the
    layers the stage's way (random streams, batch norm control), so forward hooks and pre-hooks that
    users register on a partition see every micro-batch's stage input and output, recompute included."""

    def forward(self, x):
        run_layers = self.__dict__.get("_run_layers")
        return super().forward(x) if run_layers is None else run_layers(x)

    @contextmanager
    def running(self, run_layers: Callable):
        """Within this block a call of the partition runs `run_layers(x)` instead of plain Sequential."""
        self.__dict__["_run_layers"] = run_layers
        try:
            yield self
        finally:
            self.__dict__["_run_layers"] = None


def split(module: nn.Sequential, balance: Sequence[int]) -> list[Partition]:
    """The stages as Partitions of the model's own layers (shared, not copied), names kept; a
    parameter two stages would share (tied weights) is refused, naming both layers."""
    named = list(module._modules.items())  # every entry, even a layer listed twice
    stages, start = [], 0
    for count in balance:
        stages.append(Partition(OrderedDict(named[start:start + count])))
        start += count
    owners = {}
    for stage, partition in enumerate(stages):
        for layer, child in partition.named_children():
            for name, parameter in child.named_parameters():
                first = owners.setdefault(id(parameter), (stage, layer, name))
                if first[0] != stage:
                    raise ValueError(f"layer {first[1]!r} (stage {first[0]}) and layer {layer!r} (stage {stage}) "
                                     f"share a parameter ({first[1]}.{first[2]} is {layer}.{name}): each stage "
                                     f"holds its own weights, so tied weights must sit on one stage (a balance "
                                     f"that keeps both layers together) or be untied")
    return stages
