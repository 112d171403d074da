"""Which of several measured alternatives is faster, said only when this host can tell.

A single timing of each alternative, taken one after the other, ranks them by the host's load as
much as by what they do. Here each alternative is measured in the same rounds (A, then B, then
A, ...), and a winner is named only when it beats every other alternative in every round and its
slowest round beats their fastest (the spreads separate); otherwise the verdict says the host
cannot name the fastest (and, of three or more, names one whose fastest round is slower than every
other's slowest as plainly the slowest), and shows each one's median and range. Winning every one of 5 paired rounds
alone happens by chance once in 16 between two equals, so a busy host named winners that flipped
from run to run; with the spreads apart as well, once in 126.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Verdict:
    """Per alternative its (median, lowest, highest) over the rounds; `winner` is the one lowest in
    every round (None when no alternative is); `line` says it in words."""

    spreads: dict[str, tuple[float, float, float]]
    winner: Optional[str]
    rounds: int
    line: str

    def told_apart(self) -> bool:
        """Whether this host could name a winner."""
        return self.winner is not None


def compare(rounds: dict[str, list[float]], what: str = "step", unit: str = "ms", scale: float = 1e3,
            digits: int = 1) -> Verdict:
    """The verdict on `rounds`: alternative name -> its value in each round (lower is better; every
    list as long, round i of each measured side by side). `what`, `unit` and `scale` only word the line."""
    lengths = {len(values) for values in rounds.values()}
    if len(rounds) < 2 or len(lengths) != 1 or 0 in lengths:
        raise ValueError(f"expected at least two alternatives measured in the same number of rounds (one or "
                         f"more), got {({name: len(v) for name, v in rounds.items()})}")
    count = lengths.pop()
    spreads = {name: (statistics.median(v), min(v), max(v)) for name, v in rounds.items()}
    names = list(rounds)
    # its slowest round faster than every other's fastest: so it also won every paired round
    winner = next((a for a in names if all(spreads[a][2] < spreads[b][1] for b in names if b != a)), None)

    def said(name: str) -> str:
        median, low, high = (value * scale for value in spreads[name])
        return f"{name} {median:.{digits}f}{' ' + unit if unit else ''} ({low:.{digits}f} to {high:.{digits}f})"

    figures = "; ".join(said(name) for name in names)
    loser = next((a for a in names if all(spreads[a][1] > spreads[b][2] for b in names if b != a)), None)
    if winner is None and loser is not None and count >= 3:
        line = (f"this host cannot name the fastest, but {loser} had the highest {what} in every one of {count} "
                f"rounds, its range clear of the others' (medians and ranges: {figures})")
    elif winner is None:
        line = (f"this host cannot tell them apart: no {what} is the lowest in every one of {count} round(s) with "
                f"its range clear of the others' (medians and ranges: {figures})")
    elif count < 3:
        line = (f"{winner} had the lowest {what} in each of only {count} round(s), too few to call it "
                f"(medians and ranges: {figures})")
        winner = None
    else:
        line = (f"{winner} had the lowest {what} in every one of {count} rounds, its range clear of the others' "
                f"(medians and ranges: {figures})")
    return Verdict(spreads, winner, count, line)
