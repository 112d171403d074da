"""What every lesson starts with: its first cell is one line, `from lab_setup import *`, which puts
this project on the path (the notebooks live in its notebooks/ folder) and brings

- QUICK: True when GPIPE_LAB_QUICK=1 (CI runs every notebook that way, at small sizes);
- DEVICE: where the measured runs of notebooks 04, 05 and 09 put their stages: "cpu" unless
  GPIPE_LAB_DEVICE says "cuda" (or "auto"); device_note(DEVICE) says which, and how to change it
  (the other lessons' models are tiny and stay on the CPU);
- display, Markdown, widgets, pd: what the cells use to show things;
- Output: the widget the lessons draw into from a slider (ipywidgets' Output, captured in the kernel:
  a headless run, nbconvert or papermill, never waits on it);
- progress(items, about): a progress bar for heavy cells, saying roughly how long they take;
- ticker(about, total): the same bar for lab functions that report progress through a callback.
"""
import io
import os
import pathlib
import sys
from typing import Callable, Iterable, Iterator, TypeVar

import ipywidgets as widgets
import pandas as pd
from IPython.core.displaypub import CapturingDisplayPublisher
from IPython.core.getipython import get_ipython
from IPython.display import Markdown, display
from tqdm.auto import tqdm

ROOT = next(p for p in [pathlib.Path.cwd(), *pathlib.Path.cwd().parents] if (p / "lab").is_dir())
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lab.machine.host import device_note, lab_device  # noqa: E402 (needs the path above)

QUICK = os.environ.get("GPIPE_LAB_QUICK") == "1"  # tiny sizes for CI; a learner gets the real ones
DEVICE = lab_device()
Item = TypeVar("Item")

__all__ = ["QUICK", "DEVICE", "device_note", "display", "Markdown", "widgets", "Output", "pd", "progress", "ticker"]


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


class Output(widgets.Output):
    """An ipywidgets Output whose `with` block is captured here, in the kernel, and handed to the
    widget in one state update when the block ends. ipywidgets' own sends every print and display
    tagged for the widget as it happens, and a headless client (nbclient, as in nbconvert --execute
    and papermill) answers each with a message on the shell socket while it waits there for the
    cell's reply: when the reply lands during that send, the client misses it and the cell waits
    out the client's whole timeout (nbclient issue 312; notebook 3's slider cell, about one run in
    five). In a browser the widget shows the same, the block's output appearing when it ends."""

    def __enter__(self):
        shell = get_ipython()
        self._saved = (sys.stdout, sys.stderr, shell.display_pub if shell else None)
        sys.stdout, sys.stderr = io.StringIO(), io.StringIO()
        if shell:
            shell.display_pub = CapturingDisplayPublisher()
        return self

    def __exit__(self, *exc):
        shell = get_ipython()
        out, err, published = sys.stdout, sys.stderr, shell.display_pub if shell else None
        sys.stdout, sys.stderr, saved_pub = self._saved
        del self._saved
        if shell:
            shell.display_pub = saved_pub
        outputs = [{"output_type": "stream", "name": name, "text": text}
                   for name, text in (("stdout", out.getvalue()), ("stderr", err.getvalue())) if text]
        outputs += [{"output_type": "display_data", "data": o["data"], "metadata": o["metadata"] or {}}
                    for o in (published.outputs if isinstance(published, CapturingDisplayPublisher) else [])]
        self.outputs = tuple(outputs)
        return None  # an exception goes on to the caller (interactive_output shows it)

    def clear_output(self, *args, **kwargs):
        """Inside the block: forget what it captured so far; outside: empty the widget."""
        if not hasattr(self, "_saved"):
            self.outputs = ()
            return
        for stream in (sys.stdout, sys.stderr):
            stream.seek(0)
            stream.truncate()
        shell = get_ipython()
        if shell and isinstance(shell.display_pub, CapturingDisplayPublisher):
            shell.display_pub.outputs.clear()
