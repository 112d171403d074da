"""The model zoo: each model one file of this package, an nn.Sequential with a small real task.

Reading map:

1. `cards.py`: what the lab knows of a model without building it (its card), read without torch
2. `mlp.py`: the shortest model file; `transformer.py`, `cnn.py` and `resnet.py` have the same shape

A model is added by one new file here: its card, then `build(blocks, width, seed)` returning the
nn.Sequential, `batch(size, width, seed)` returning (inputs, targets), and `loss(output, targets)`;
a sequence model (its card's `sequence` above 0) takes `context=` in both as well.
The app's picker, `lab.runs.experiments.run`, `python -m lab.reproduce --model` and the notebooks
find it by its card. A model's "layers" are the entries of its nn.Sequential, the units a pipeline
cuts between.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from importlib import import_module
from pathlib import Path
from typing import Callable

from lab.zoo.cards import Card, read_card

CARDS: dict[str, Card] = {path.stem: read_card(path) for path in sorted(Path(__file__).parent.glob("*.py"))
                          if path.stem not in ("__init__", "cards")}


def card(name: str) -> Card:
    """The card of the zoo model called `name`, or a ValueError listing the choices."""
    if name not in CARDS:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(CARDS)}")
    return CARDS[name]


@dataclass(frozen=True)
class ZooModel(Card):
    """A zoo model's card with what its file builds: the model, its task's batches and its loss."""

    build: Callable = None      # (blocks, width, seed) -> nn.Sequential
    batch: Callable = None      # (size, width, seed) -> (inputs, targets)
    loss_fn: Callable = None    # (output, targets) -> scalar


def get(name: str) -> ZooModel:
    """The zoo model called `name` with its functions (this loads torch), or a ValueError naming
    what its file lacks."""
    module = import_module(f"{__name__}.{card(name).name}")
    functions = {part: getattr(module, part, None) for part in ("build", "batch", "loss")}
    lacking = [part for part, function in functions.items() if not callable(function)]
    if lacking:
        raise ValueError(f"{module.__file__}: a zoo model file defines build, batch and loss; it lacks "
                         f"{', '.join(lacking)}")
    return ZooModel(**asdict(CARDS[name]), build=functions["build"], batch=functions["batch"],
                    loss_fn=functions["loss"])


def build(name: str, blocks: int, width: int, seed: int = 0, context: int = 0):
    """The zoo model `name` built (a sequence model for `context` tokens per sample, 0 meaning its
    card's): what stage processes call to make their own copy."""
    return get(name).build(blocks, width, seed, **lengths(context))


def lengths(context: int) -> dict:
    """What a zoo model's build and batch are told of a run's sequence length: nothing for the card's own (0)."""
    return {"context": context} if context else {}
