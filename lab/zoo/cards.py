"""What the lab knows of a zoo model without building it: its card.

A model file of the zoo opens with `CARD = Card(...)` written in plain values. The zoo reads that
line without running the file (`read_card`), so that the app can draw its controls, and a config
be checked, before torch loads; the builder below the card loads only when a run needs it.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

Size = tuple[int, int]  # (width, batch)


@dataclass(frozen=True)
class Card:
    """A zoo model as the lab offers it: what it is, what the app's page may ask of it, and the
    sizes its speedup tables train."""

    name: str                          # the file's name
    description: str
    extra_layers: int                  # nn.Sequential entries besides the blocks
    page_blocks: int                   # the most blocks the page offers
    page_widths: tuple[int, ...]       # the widths it offers, each small enough for seconds on 2 cores
    page_batches: tuple[int, ...]
    page_width: int                    # what the page opens with
    page_batch: int
    test_width: int                    # a width at which two blocks learn the task within a test's seconds
    cpu_table: tuple[Size, Size]       # the CPU speedup table's (width, batch): quick, then full
    gpu_table: Optional[tuple[Size, Size]]  # the same on GPUs, or None: grown until the GPU computes
    sequence: int                      # a sequence model's tokens per sample (a run may ask for others); else 0

    def layer_count(self, blocks: int) -> int:
        """The layers of the nn.Sequential the pipeline cuts: the blocks and the rest."""
        return blocks + self.extra_layers

    def __post_init__(self):
        for name, value, choices in (("page_width", self.page_width, self.page_widths),
                                     ("page_batch", self.page_batch, self.page_batches)):
            if value not in choices:
                raise ValueError(f"the {self.name}'s card: {name}={value} is not among {choices}")


def read_card(path: Path) -> Card:
    """The card a model file opens with, read without running the file, or a ValueError naming the
    file and what its card lacks."""
    tree = ast.parse(path.read_text(), str(path))
    call = next((node.value for node in tree.body if isinstance(node, ast.Assign)
                 and [getattr(t, "id", None) for t in node.targets] == ["CARD"]), None)
    if not (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "Card" and not call.args):
        raise ValueError(f"{path}: a zoo model file opens with CARD = Card(name=..., ...), keywords only")
    try:
        values = {keyword.arg: ast.literal_eval(keyword.value) for keyword in call.keywords}
    except ValueError:
        raise ValueError(f"{path}: its CARD must be written in plain values (numbers, strings, tuples)") from None
    missing = [field.name for field in fields(Card) if field.name not in values]
    unknown = sorted(set(values) - {field.name for field in fields(Card)})
    if missing or unknown:
        raise ValueError(f"{path}: its CARD " + (f"lacks {', '.join(missing)}" if missing else
                                                  f"has no field {', '.join(unknown)}"))
    if values["name"] != path.stem:
        raise ValueError(f"{path}: its CARD is named {values['name']!r}; expected the file's name, {path.stem!r}")
    return Card(**values)
