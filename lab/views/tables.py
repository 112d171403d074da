"""The speedup tables as pandas DataFrames: the paper's Tables 2 and 3 as printed, and this host's
cells beside them (lab.views.charts draws figures; pandas loads only with this module)."""
from __future__ import annotations

from typing import Iterable

import pandas as pd

from lab import theory
from lab import zoo as models


def speedup_table(cells: Iterable) -> pd.DataFrame:
    """The paper's Table 2 layout beside this host, one row per (K, M) of `cells` (speedup.Cell):
    the paper's two models, normalized as the paper does to their K=2, M=1 cell; this host on the
    same normalization, and separately over one device (K=1, M=1); the unit-cost model with recompute
    on the same normalization (theory.on_paper_scale); the unit-cost ideal without recompute,
    K*M/(M+K-1), over one device; how each
    host cell was obtained ("measured (threads)", "measured (processes)" or "ideal replay")."""
    rows = []
    for cell in sorted(cells, key=lambda c: (c.micro_batches, c.stages)):
        key = (cell.stages, cell.micro_batches)
        rows.append({"K": cell.stages, "M": cell.micro_batches,
                     **{f"paper {name} (vs its K=2, M=1)": table.get(key)
                        for name, table in theory.PAPER_TABLE2.items()},
                     "model with recompute (vs its K=2, M=1)": round(theory.on_paper_scale(*key), 2),
                     "ideal without recompute K*M/(M+K-1)": round(theory.ideal_speedup(*key), 2),
                     "this host vs K=2, M=1": None if cell.vs_pair is None else round(cell.vs_pair, 2),
                     "this host vs one device (K=1, M=1)": round(cell.vs_single, 2), "how": cell.label})
    return pd.DataFrame(rows)


def paper_table() -> pd.DataFrame:
    """Table 2 of the paper as printed: rows M = 1, 4, 32; for each model columns K = 2, 4, 8, each
    normalized to that model's K=2, M=1 cell."""
    grid = {f"{name.split(' ')[0]} K={k}": [table[(k, m)] for m in (1, 4, 32)]
            for name, table in theory.PAPER_TABLE2.items() for k in (2, 4, 8)}
    return pd.DataFrame(grid, index=[f"M={m}" for m in (1, 4, 32)])


def paper_table3() -> pd.DataFrame:
    """Table 3 of the paper: P100 GPUs without NVLink, M=32, normalized to K=2."""
    return pd.DataFrame({f"K={k}": [table[k] for table in theory.PAPER_TABLE3.values()] for k in (2, 4, 8)},
                        index=list(theory.PAPER_TABLE3))


def zoo() -> pd.DataFrame:
    """Every model of the zoo, as its card says (a model added to lab/zoo appears here)."""
    return pd.DataFrame([{"model": card.name, "what it is": card.description,
                          "layers": f"blocks + {card.extra_layers}", "widths the app offers": card.page_widths}
                         for card in models.CARDS.values()])
