"""Formula exercises: a learner's formula judged on many cases, and the ways to get any formula
wrong (upside down, an argument off by one or swapped, another unit, rounding, precedence) named
when one fits. A number is a number whether Python, numpy, torch or Decimal made it."""
from __future__ import annotations

import itertools
import math
import numbers
from dataclasses import dataclass
from decimal import Decimal
from typing import Callable, Optional

import numpy as np
import torch

from lab import theory
from lab.lessons.feedback import SAYS, Feedback, exercise
from lab.lessons.sandbox import call_text, called


def as_number(value) -> Optional[float]:
    """The value of a real number made by Python, numpy or torch (a one-element tensor or array),
    or None for anything else: a bool, a string, a list, a complex number."""
    try:
        if isinstance(value, torch.Tensor):
            if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
                return None
            value = value.item()
        elif isinstance(value, np.ndarray):
            if value.size != 1 or value.dtype.kind not in "iuf":
                return None
            value = value.item()
        if isinstance(value, Decimal):
            return float(value) if value.is_finite() else None
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
            return None
        try:
            return float(value)
        except OverflowError:  # an int too large for a float is still a number: an infinitely wrong one
            return math.copysign(math.inf, value)
    except (TypeError, ValueError, OverflowError, RuntimeError):
        return None


def as_whole(value) -> Optional[int]:
    """A whole number (an int, an integral float, numpy's or torch's), or None."""
    number = as_number(value)
    return int(number) if number is not None and math.isfinite(number) and number.is_integer() else None


def _tolerance(value) -> float:
    """How close a number of `value`'s type can come: float32's rounding for Python's numbers (a
    learner's numpy.float32 is a right answer too), a few steps of its own precision for a
    lower-precision numpy or torch float (float16, bfloat16)."""
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return 1e-6
    try:
        eps = torch.finfo(dtype).eps if isinstance(dtype, torch.dtype) else np.finfo(dtype).eps
    except (TypeError, ValueError):
        return 1e-6
    return max(1e-6, 4 * float(eps))


def _close(a: Optional[float], b: Optional[float], tolerance: float = 1e-6) -> bool:
    """a equals b up to a relative `tolerance` (_tolerance)."""
    return a is not None and b is not None and math.isclose(a, b, rel_tol=tolerance, abs_tol=1e-9)


def _shown(value: float) -> str:
    return f"{value:g}" if float(value).is_integer() else f"{value:.4g}"


# The units a formula's answer comes in, and the factors a learner's answer in another unit is off
# by (with that mistake's family): bytes given in GiB are the answer times 2^-30.
UNITS = {
    "bytes": ((8, "bits"), (1e-3, "kilobytes"), (2 ** -10, "kibibytes"), (1e-6, "megabytes"),
              (2 ** -20, "mebibytes"), (1e-9, "gigabytes"), (2 ** -30, "gibibytes")),
    "ms": ((1e-3, "seconds"), (1e3, "microseconds")),
    "fraction": ((100, "percent"),),
    "ratio": ((100, "ratio as percent"),),
    "": (),
}


@dataclass(frozen=True)
class Formula:
    """A formula exercise: the cases it is tried on, the right answer, and the mistakes it knows
    (family in SAYS, what a function with that mistake returns). Besides its own mistakes, every
    formula knows the usual ways to get any formula wrong (`known`), alone or with its answer in
    another unit."""

    names: tuple[str, ...]                      # the arguments' names, for the feedback
    cases: tuple[tuple, ...]                    # with the edge cases that tell the variants apart
    right: Callable[..., float]
    mistakes: tuple[tuple[str, Callable[..., float]], ...] = ()
    hint: str = ""                              # said when no known mistake fits
    unit: str = ""                              # a key of UNITS
    symmetric: bool = False                     # swapping the arguments gives the same answer

    def known(self) -> list[tuple[str, Callable[..., float]]]:
        """The exercise's own mistakes, then those of any formula: the answer upside down, an
        argument off by one, two arguments swapped, a fraction dropped or rounded."""
        right, generic = self.right, [("inverse", lambda *a: 1 / right(*a))]
        for i, name in enumerate(self.names):
            for step in (1, -1):
                def shifted(*a, _i=i, _step=step):
                    return right(*a[:_i], a[_i] + _step, *a[_i + 1:])
                generic.append((f"one variable off:{name}{'+' if step > 0 else '-'}1", shifted))
        if not self.symmetric:
            for i, j in itertools.combinations(range(len(self.names)), 2):
                def swapped(*a, _i=i, _j=j):
                    b = list(a)
                    b[_i], b[_j] = a[_j], a[_i]
                    return right(*b)
                generic.append((f"swapped:{self.names[i]},{self.names[j]}", swapped))
        if any(not float(right(*case)).is_integer() for case in self.cases):
            generic += [("integer division", lambda *a: math.floor(right(*a))),
                        *(("rounded", lambda *a, _d=d: round(right(*a), _d)) for d in range(4)),
                        ("rounded", lambda *a: math.ceil(right(*a)))]
        return [*self.mistakes, *generic]

    def judge(self, fn: Callable) -> None:
        """Raise Feedback unless fn gives the right answer on every case, naming the mistake it
        recognizes in the answer, or saying that the answer is the same whatever the arguments;
        when no mistake fits, a table of every case shows where the answer goes wrong."""
        got, tolerance = [], 1e-6
        for case in self.cases:
            result = called(fn, *case)
            value = as_number(result)
            if value is None:
                raise Feedback(f"{self.where(case)}: {call_text(fn, case)} returned {result!r:.60} "
                               f"({type(result).__name__}): {SAYS['not a number']}")
            got.append(value)
            tolerance = max(tolerance, _tolerance(result))
        expected = [float(self.right(*case)) for case in self.cases]
        wrong = [i for i, (mine, right) in enumerate(zip(got, expected)) if not _close(mine, right, tolerance)]
        if not wrong:
            return
        said = f"{self.where(self.cases[wrong[0]])}: got {_shown(got[wrong[0]])}, expected {_shown(expected[wrong[0]])}"
        constant = len(set(got)) == 1
        mistake = self.recognize(got, expected, tolerance)
        if mistake:
            # a constant that a mistake also gives: both are said, since either may be what was written
            raise Feedback(f"{said}: {SAYS['constant'] + '; or, if it computes, ' if constant else ''}{mistake}")
        if constant:
            raise Feedback(f"{said}: {SAYS['constant']}")
        seen = self.pattern(got, expected, wrong, tolerance)
        raise Feedback(f"wrong in {len(wrong)} of {len(self.cases)} cases: {seen or self.hint}; "
                       f"{SAYS['no pattern']}\n{self.table(got, expected, wrong)}")

    def pattern(self, got: list[float], expected: list[float], wrong: list[int], tolerance: float) -> Optional[str]:
        """What the wrong answers have in common, when a simple rule says it: the same factor or the
        same offset on every case, or right exactly where a condition on the arguments holds."""
        if all(_close(g, 0.0, tolerance) for g, e in zip(got, expected) if e == 0):
            ratios = [g / e for g, e in zip(got, expected) if e != 0]
            if ratios and all(math.isclose(r, ratios[0], rel_tol=tolerance) for r in ratios):
                return f"each answer is {_shown(ratios[0])} times the expected one: {SAYS['a factor']}"
        offsets = [g - e for g, e in zip(got, expected)]
        if all(math.isclose(d, offsets[0], rel_tol=tolerance, abs_tol=1e-9) for d in offsets):
            return f"each answer is {offsets[0]:+.4g} off the expected one: {SAYS['an offset']}"
        right = [i not in wrong for i in range(len(got))]
        if sum(right) < 2:   # right on one case only (K = 1 makes many a formula trivially right): no rule
            return None
        for words, holds in self.conditions():
            if [bool(holds(*case)) for case in self.cases] == right:
                return f"right exactly where {words}, wrong elsewhere: {SAYS['special case']}"
        return None

    def conditions(self) -> list[tuple[str, Callable[..., bool]]]:
        """Simple conditions on the arguments a learner's special case might test."""
        found = []
        for i, name in enumerate(self.names):
            found += [(f"{name} = 1", lambda *a, _i=i: a[_i] == 1), (f"{name} > 1", lambda *a, _i=i: a[_i] > 1)]
        counts = [(i, name) for i, name in enumerate(self.names) if name in ("K", "M")]  # f and b are times
        for (i, a), (j, b) in itertools.permutations(counts, 2):
            found += [(f"{a} ≥ {b}", lambda *v, _i=i, _j=j: v[_i] >= v[_j]),
                      (f"{a} > {b}", lambda *v, _i=i, _j=j: v[_i] > v[_j])]
        return found

    def recognize(self, got: list[float], expected: list[float], tolerance: float) -> Optional[str]:
        """The sentence of the first known mistake that gives `got` on every case: a mistake of the
        formula, the answer in another unit, or both at once."""
        def gives(values: list[Optional[float]], scale: float = 1.0) -> bool:
            """A mistake's `values` match on every case where it has one (a learner guards a
            division by zero as they like), at least three of them."""
            defined = [(mine, scale * v) for mine, v in zip(got, values) if v is not None]
            return len(defined) >= 3 and all(_close(mine, v, tolerance) for mine, v in defined)
        known = [(family, [_safely(mistake, case) for case in self.cases]) for family, mistake in self.known()]
        units = UNITS[self.unit]
        for family, values in known:
            if gives(values):
                return _sentence(family)
        for scale, unit in units:
            if gives(expected, scale):
                return SAYS[unit]
        for scale, unit in units:
            for family, values in known:
                if gives(values, scale):
                    return f"{SAYS[unit]}; and besides, {_sentence(family)}"
        return None

    def table(self, got: list[float], expected: list[float], wrong: list[int]) -> str:
        """Every case with the expected value and the learner's, the wrong ones marked."""
        rows = [[*self.names, "expected", "yours", ""]] + [
            [*(f"{v:g}" for v in case), _shown(right), _shown(mine), "✗" if i in wrong else "✓"]
            for i, (case, right, mine) in enumerate(zip(self.cases, expected, got))]
        widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
        return "\n".join("    " + "  ".join(cell.rjust(width) for cell, width in zip(row, widths)).rstrip()
                         for row in rows)

    def where(self, case: tuple) -> str:
        return ", ".join(f"{name}={value:g}" for name, value in zip(self.names, case))

    def as_check(self, name: str, doc: str, praise: str) -> Callable[[Callable], str]:
        """The check a lesson calls: `praise` for a right function, else the judge's feedback."""
        def judge(fn: Callable) -> str:
            self.judge(fn)
            return praise
        judge.__name__ = judge.__qualname__ = name
        judge.__doc__ = doc
        return exercise(judge)


def _sentence(family: str) -> str:
    """A family's sentence; "one variable off:K+1" and "swapped:K,M" name the argument(s) first."""
    family, _, detail = family.partition(":")
    if family == "one variable off":
        name, sign = detail[:-2], detail[-2]
        return f"that is the formula with {name}{sign}1 wherever {name} should be: {SAYS[family]}"
    if family == "swapped" and detail:
        return f"{SAYS[family]} ({detail.replace(',', ' and ')} trade places)"
    return SAYS[family]


def _safely(fn: Callable[..., float], case: tuple) -> Optional[float]:
    """A mistake's value on a case, or None where it has none (a division by zero)."""
    try:
        return float(fn(*case))
    except (ArithmeticError, ValueError):
        return None


TRAINING_BYTES = Formula(
    ("parameters",), ((1,), (1000,), (123_456,), (7,)), lambda p: 16 * p,
    (("weights alone", lambda p: 4 * p), ("weights and gradients", lambda p: 8 * p), ("one moment", lambda p: 12 * p),
     ("four bytes twice", lambda p: 64 * p)),
    hint="4 bytes each for the weight, its gradient and Adam's two moments", unit="bytes")
NAIVE_BUBBLE = Formula(
    ("K",), ((2,), (4,), (8,), (1,), (3,)), lambda k: (k - 1) / k,
    (("busy share", lambda k: 1 / k), ("idle slots", lambda k: k - 1), ("precedence", lambda k: k - 1 / k)),
    hint="with one micro-batch the step is a chain of K stages, and each stage works during 1 of its K slots",
    unit="fraction")
BUBBLE = Formula(
    ("K", "M"), ((2, 1), (4, 4), (4, 16), (8, 32), (1, 4), (3, 2), (8, 2), (5, 1)), lambda k, m: (k - 1) / (m + k - 1),
    (("busy share", lambda k, m: m / (m + k - 1)), ("divided by M", lambda k, m: (k - 1) / m),
     ("off by one slot", lambda k, m: (k - 1) / (m + k)), ("off by one slot", lambda k, m: k / (m + k - 1)),
     ("off by one slot", lambda k, m: (k - 1) / (m + k - 2)), ("idle slots", lambda k, m: k - 1),
     ("precedence", lambda k, m: k - 1 / (m + k - 1)), ("precedence", lambda k, m: (k - 1) / m + k - 1),
     ("precedence", lambda k, m: k - 1 / m + k - 1),
     ("special case", lambda k, m: (k - 1) / (m + k - 1) if m >= k else (k - 1) / k)),
    hint="the bubble is (K-1)/(M+K-1): K-1 idle slots of fill and drain out of M+K-1", unit="fraction")
IDEAL_SPEEDUP = Formula(
    ("K", "M"), ((1, 1), (2, 1), (4, 4), (8, 32), (3, 5), (4, 2), (8, 1)), lambda k, m: k * m / (m + k - 1),
    (("forgets the bubble", lambda k, m: k), ("one device's share", lambda k, m: m / (m + k - 1)),
     ("bubble times K", lambda k, m: k * (k - 1) / (m + k - 1)), ("off by one slot", lambda k, m: k * m / (m + k)),
     ("precedence", lambda k, m: k * m / m + k - 1), ("precedence", lambda k, m: k * m / (m + k) - 1)),
    hint="K devices, each busy M/(M+K-1) of the time: K·M/(M+K-1)", unit="ratio", symmetric=True)
IN_FLIGHT = Formula(
    ("K", "k"), tuple((stages, stage) for stages in (1, 2, 4, 8) for stage in range(stages)),
    lambda stages, stage: theory.peak_in_flight("1f1b", stages, 64, stage),
    (("one less held", lambda stages, stage: stages - 1 - stage),
     ("counted from the end", lambda stages, stage: stage + 1),
     ("same on every stage", lambda stages, stage: stages),
     ("a share", lambda stages, stage: (stages - stage) / stages)),
    hint="the fill takes K-1-k forwards, then one forward and one backward alternate")
BOUNDARY_BYTES = Formula(
    ("N", "bytes per sample"), ((1, 4.0), (32, 256.0), (64, 4096.0), (3, 100.0)), lambda n, b: 2 * n * b,
    (("forward only", lambda n, b: n * b), ("per sample", lambda n, b: 2 * b),
     ("four bytes again", lambda n, b: 8 * n * b)),
    hint="activations forward and gradients back, N samples each way", unit="bytes", symmetric=True)

BUBBLE_MS = Formula(
    ("K", "M", "f", "b"), ((2, 8, 1.0, 2.0), (4, 8, 1.5, 3.0), (4, 32, 1.5, 3.0), (8, 32, 0.25, 0.5), (1, 4, 2.0, 4.0),
                          (3, 2, 2.0, 1.5), (5, 1, 0.5, 3.0)),
    lambda k, m, f, b: (k - 1) * (f + b),
    (("fill only", lambda k, m, f, b: (k - 1) * f), ("drain only", lambda k, m, f, b: (k - 1) * b),
     ("share, not time", lambda k, m, f, b: (k - 1) / (m + k - 1)),
     ("own work", lambda k, m, f, b: m * (f + b)), ("whole step", lambda k, m, f, b: (m + k - 1) * (f + b)),
     ("off by one slot", lambda k, m, f, b: k * (f + b)), ("precedence", lambda k, m, f, b: k - 1 * (f + b)),
     ("recompute added", lambda k, m, f, b: (k - 1) * (2 * f + b)),
     ("per micro-batch", lambda k, m, f, b: (k - 1) * (f + b) / m),
     ("precedence", lambda k, m, f, b: (k - 1) * f + b)),
    hint="every stage waits K-1 forward and K-1 backward slots: the last before its first forward and after its "
         "last backward, the first in one block between its forwards and its backwards",
    unit="ms")


check_training_bytes = TRAINING_BYTES.as_check(
    "check_training_bytes", "fn(parameters): bytes a float32 model with Adam keeps besides activations.",
    "✓ 16 bytes per parameter: weights, gradients and Adam's two moments, 4 bytes each")
check_naive_bubble = NAIVE_BUBBLE.as_check(
    "check_naive_bubble", "fn(K): the idle share of K stages running one micro-batch (M = 1).",
    "✓ (K-1)/K: with M = 1 only one stage works at a time")
check_bubble = BUBBLE.as_check(
    "check_bubble", "fn(K, M): the bubble of GPipe's fill-drain schedule.",
    "✓ (K-1)/(M+K-1): K-1 idle slots of fill and drain out of M+K-1")
check_ideal_speedup = IDEAL_SPEEDUP.as_check(
    "check_ideal_speedup", "fn(K, M): throughput over one device with equal stages, free transfers and no recompute.",
    "✓ K·M/(M+K-1): K devices times the busy share, the unit-cost ideal without recompute")
check_in_flight = IN_FLIGHT.as_check(
    "check_in_flight", "fn(K, k): micro-batches stage k holds at most under 1F1B (M >= K).",
    "✓ K-k: the first stage holds K micro-batches, the last one only one (GPipe holds all M)")
check_bubble_ms = BUBBLE_MS.as_check(
    "check_bubble_ms", "fn(K, M, f, b): ms a stage of a GPipe step waits, equal stages taking f ms per forward and "
                       "b ms per backward, no recompute.",
    "✓ (K-1)·(f+b): K-1 forward slots of fill and K-1 backward slots of drain, whatever M is")
check_boundary_bytes = BOUNDARY_BYTES.as_check(
    "check_boundary_bytes", "fn(N, bytes_per_sample): bytes crossing one cut between stages in one training step.",
    "✓ 2·N·(bytes per sample): activations forward, gradients back, whatever M is")


