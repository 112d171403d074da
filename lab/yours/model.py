"""Your model as the lab takes it: `MODULE:FUNCTION` imported, called, and made a chain of layers
with a batch to train on, or refused in one line saying what stops it and how to write it."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn


class Refused(ValueError):
    """What the lab cannot take, in one line: what was wrong and what was expected."""


def cross_entropy(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dimension, for classes (N, C) or sequences (N, T, C) alike."""
    return F.cross_entropy(output.flatten(0, -2), targets.flatten())


LOSSES: dict[str, Callable] = {"cross_entropy": cross_entropy, "mse": F.mse_loss}


@dataclass
class Yours:
    """A model ready to pipeline: its layers, a mini-batch, the loss, and where it came from."""

    name: str
    model: nn.Sequential
    inputs: torch.Tensor
    targets: torch.Tensor
    loss_fn: Callable
    note: str = ""   # what was done to take it (a chain of children made a Sequential, say)

    def fresh(self) -> nn.Sequential:
        """A copy of the model as it was given: every run starts from the same weights."""
        import copy
        return copy.deepcopy(self.model)


def function_of(target: str) -> Callable:
    """The function `MODULE:FUNCTION` names (MODULE a module on the path, or a .py file)."""
    module_name, colon, function_name = target.rpartition(":")
    if not colon or not module_name or not function_name:
        raise Refused(f"{target!r}: expected MODULE:FUNCTION, e.g. mymodels:build (a module on the path, "
                      f"or a file: path/to/models.py:build)")
    try:
        if module_name.endswith(".py") or "/" in module_name:
            path = Path(module_name)
            spec = importlib.util.spec_from_file_location(path.stem, path)
            if spec is None or not path.exists():
                raise ImportError(f"no file {path}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            sys.path.insert(0, str(Path.cwd()))
            module = importlib.import_module(module_name)
    except Exception as error:
        raise Refused(f"{module_name} does not import ({type(error).__name__}: {error}); expected a module on "
                      f"the path (this folder is on it) or a .py file") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise Refused(f"{module_name} has no function {function_name!r}; expected MODULE:FUNCTION naming one")
    return function


def take(made, name: str, shape: Optional[Sequence[int]] = None, loss: str = "cross_entropy",
         seed: int = 0) -> Yours:
    """What a model function returned, ready to pipeline: an nn.Sequential (a batch made to
    `shape`), or (model, inputs) or (model, (inputs, targets)); a module whose forward is a chain
    of its children is taken as that chain; anything else is Refused."""
    if loss not in LOSSES:
        raise Refused(f"--loss {loss!r}: expected one of {', '.join(LOSSES)}")
    model, batch = (made if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module)
                    else (made, None))
    if not isinstance(model, nn.Module):
        raise Refused(f"{name} returned {type(made).__name__}; expected an nn.Sequential, or (model, inputs), "
                      f"or (model, (inputs, targets))")
    torch.manual_seed(seed)
    inputs, targets = (batch if isinstance(batch, tuple) else (batch, None))
    if inputs is None:
        inputs = sample_inputs(model, shape, name)
    note = ""
    if not isinstance(model, nn.Sequential):
        model, note = as_chain(model, inputs, name)
    output = first_output(model, inputs, shape)
    if targets is None:
        targets = sample_targets(output, loss)
    return Yours(name, model, inputs, targets, LOSSES[loss], note)


def sample_inputs(model: nn.Module, shape: Optional[Sequence[int]], name: str) -> torch.Tensor:
    """A mini-batch of `shape`: token ids where the first layer is an embedding, else normal floats."""
    if not shape:
        raise Refused(f"{name} returned a model without a batch: give --shape (the mini-batch's, e.g. "
                      f"32,3,32,32), or return (model, inputs)")
    leaves = [m for m in model.modules() if not list(m.children())]
    if leaves and isinstance(leaves[0], nn.Embedding):
        return torch.randint(0, leaves[0].num_embeddings, tuple(shape))
    return torch.randn(*shape)


def first_output(model: nn.Sequential, inputs: torch.Tensor, shape) -> torch.Tensor:
    """The model's output on the batch, or Refused naming the layer the batch does not fit."""
    x = inputs
    with torch.no_grad():
        for index, (layer_name, layer) in enumerate(model.named_children()):
            try:
                x = layer(x)
            except Exception as error:
                given = f"--shape {','.join(map(str, shape))}" if shape else "the batch given"
                said = (str(error).strip().splitlines() or [""])[0][:200]
                raise Refused(f"{given} does not fit layer {index} ({layer_name}: {type(layer).__name__}): "
                              f"{said}; expected a batch whose first dimension is the samples") from None
    if not torch.is_tensor(x):
        raise Refused(f"the model's output is a {type(x).__name__}; expected one tensor for the loss")
    return x


def sample_targets(output: torch.Tensor, loss: str) -> torch.Tensor:
    """Targets the loss can take: a class per sample (or per position) for cross-entropy, else normals."""
    if loss == "cross_entropy":
        if output.dim() < 2:
            raise Refused(f"cross-entropy needs outputs of (samples, classes); the model gives {tuple(output.shape)}"
                          f": use --loss mse")
        return torch.randint(0, output.shape[-1], output.shape[:-1])
    return torch.randn_like(output)


def as_chain(model: nn.Module, inputs: torch.Tensor, name: str) -> tuple[nn.Sequential, str]:
    """The model as an nn.Sequential of its children if its forward is exactly a chain of them (each
    given the previous one's output, each once, the last one's output returned); else Refused,
    naming the first thing that breaks the chain."""
    children = list(model.named_children())
    calls: list[tuple[str, tuple, object]] = []
    hooks = [child.register_forward_hook(lambda m, args, out, n=n: calls.append((n, args, out)))
             for n, child in children]
    try:
        with torch.no_grad():
            output = model(inputs)
    finally:
        for hook in hooks:
            hook.remove()
    how = ("write it as an nn.Sequential whose entries each take the one before's output (a block with a "
           "skip connection as one module, its forward adding its input)")
    kind = type(model).__name__
    if not calls:
        raise Refused(f"{name} returned a {kind} whose forward calls none of its children; {how}")
    previous, previous_name, seen = inputs, "the input", []
    for child, args, out in calls:
        if child in seen:
            raise Refused(f"{kind}'s forward calls {child!r} twice (shared layers cannot be cut apart); {how}")
        if len(args) != 1 or args[0] is not previous:
            raise Refused(f"{kind}'s forward gives {child!r} something other than {previous_name} (a skip "
                          f"connection, or an operation in forward between them); {how}")
        seen.append(child)
        previous, previous_name = out, f"{child!r}'s output"
    if output is not previous:
        raise Refused(f"{kind}'s forward does more after {seen[-1]!r} than return its output; {how}")
    modules = dict(children)
    return (nn.Sequential(OrderedDict((child, modules[child]) for child in seen)),
            f"{kind} taken as the chain of its children ({', '.join(seen)})")
