"""What every lesson starts with: its first cell is one line, `from lab_setup import *`, which puts
this project on the path (the notebooks live in its notebooks/ folder) and brings

- QUICK: True when GPIPE_LAB_QUICK=1 (CI runs every notebook that way, at small sizes);
- DEVICE: where the measured runs of notebooks 04, 05 and 09 put their stages: "cpu" unless
  GPIPE_LAB_DEVICE says "cuda" (or "auto"); device_note(DEVICE) says which, and how to change it
  (the other lessons' models are tiny and stay on the CPU);
- display, Markdown, widgets, pd: what the cells use to show things;
- progress(items, about): a progress bar for heavy cells, saying roughly how long they take;
- ticker(about, total): the same bar for lab functions that report progress through a callback.
"""
import os
import pathlib
import sys
from typing import Callable, Iterable, Iterator, TypeVar

import ipywidgets as widgets
import pandas as pd
from IPython.display import Markdown, display
from tqdm.auto import tqdm

ROOT = next(p for p in [pathlib.Path.cwd(), *pathlib.Path.cwd().parents] if (p / "lab").is_dir())
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lab.host import device_note, lab_device  # noqa: E402 (needs the path above)

QUICK = os.environ.get("GPIPE_LAB_QUICK") == "1"  # tiny sizes for CI; a learner gets the real ones
DEVICE = lab_device()
Item = TypeVar("Item")

__all__ = ["QUICK", "DEVICE", "device_note", "display", "Markdown", "widgets", "pd", "progress", "ticker"]


def progress(items: Iterable[Item], about: str, total: int = None) -> Iterator[Item]:
    """Iterate with a progress bar whose label says what runs and roughly how long it takes
    ("about 30 s on 2 cores")."""
    return iter(tqdm(items, desc=about, total=total, leave=False))


def ticker(about: str, total: int = None) -> Callable[[object], None]:
    """A progress bar to hand to a lab function's `progress=` callback: each call advances it by
    one and shows what the call reported (a label, or a probe of the memory search)."""
    bar = tqdm(desc=about, total=total, leave=False)

    def tick(what) -> None:
        bar.set_postfix_str(str(what)[:60])
        bar.update(1)
    return tick
