"""The lessons' checks accept right answers however a learner's numbers come (Python, numpy,
torch), reject every mutation of the reference answers with the sentence of its mistake's family,
and never raise, whatever they are given."""
import decimal
import fractions
import itertools
import subprocess
import sys
import threading
import time
from itertools import accumulate
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from engine import GPipe
from engine.balance import solve
from engine.schedule import Schedule, Task, gpipe, one_f_one_b, zb_h1
from lab import theory
from lab.lessons import cuts, exercises, sandbox
from lab.schedules.writer import format, parse

SAYS = exercises.SAYS


@pytest.fixture(autouse=True)
def one_second_per_answer(monkeypatch):
    """A learner's function gets 1 s of CPU here, not a lesson's 5: the answers that never return
    are stopped sooner, and every right one takes a few milliseconds."""
    monkeypatch.setattr(sandbox, "CALL_SECONDS", 1.0)


def bubble(k, m):
    return (k - 1) / (m + k - 1)


def speedup(k, m):
    return k * m / (m + k - 1)


def fill_drain(k, m):
    return [[f"F{i}" for i in range(m)] + [f"B{i}" for i in reversed(range(m))] for _ in range(k)]


def accumulate_right(model, x, y, loss_fn, micro):
    for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
        (loss_fn(model(xs), ys) / micro).backward()


def accumulate_with(scale=lambda i, m, xs: 1 / m, zero_inside=False, cut=torch.Tensor.chunk, zero_after=False):
    """A learner's accumulation loop with one thing changed."""
    def accumulate_(model, x, y, loss_fn, micro):
        for i, (xs, ys) in enumerate(zip(cut(x, micro), cut(y, micro))):
            if zero_inside:
                model.zero_grad()
            (loss_fn(model(xs), ys) * scale(i, micro, xs)).backward()
        if zero_after:
            model.zero_grad(set_to_none=False)
    return accumulate_


def doubled_inputs(model, x, y, loss_fn, micro):
    """Each micro-batch fed twice its inputs."""
    for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
        (loss_fn(model(2 * xs), ys) / micro).backward()


def shifted_inputs(model, x, y, loss_fn, micro):
    """Each micro-batch's inputs moved by 1: gradients that are no weighting of the micro-batches' own."""
    for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
        (loss_fn(model(xs + 1), ys) / micro).backward()


def scaled_logits(model, x, y, loss_fn, micro):
    for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
        loss_fn(model(xs) / micro, ys).backward()


def one_backward(model, x, y, loss_fn, micro):
    """The right sum, differentiated once: autograd holds every micro-batch's graph until then."""
    sum(loss_fn(model(xs), ys) / micro for xs, ys in zip(x.chunk(micro), y.chunk(micro))).backward()


def gradients_not_kept(model, x, y, loss_fn, micro):
    for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
        torch.autograd.grad(loss_fn(model(xs), ys) / micro, list(model.parameters()))


def summed_by_hand(model, x, y, loss_fn, micro):
    """Right, in another form: each micro-batch's gradients from autograd.grad, added up into .grad."""
    parameters = list(model.parameters())
    total = [torch.zeros_like(p) for p in parameters]
    for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
        for t, g in zip(total, torch.autograd.grad(loss_fn(model(xs), ys) / micro, parameters)):
            t += g
    for p, t in zip(parameters, total):
        p.grad = t


def kept_on_the_host(block, x):
    """Activations kept (moved to host memory), nothing recomputed: the learner's own saved-tensor
    hooks hide them from the check's."""
    with torch.autograd.graph.save_on_cpu():
        return block(x)


def scaled_by_integer_division(model, x, y, loss_fn, micro):
    for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
        (loss_fn(model(xs), ys) * (1 // micro)).backward()


def forwards_without_grad(model, x, y, loss_fn, micro):
    for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
        with torch.no_grad():
            loss = loss_fn(model(xs), ys) / micro
        try:
            loss.backward()
        except RuntimeError:
            pass


def assigned_not_added(model, x, y, loss_fn, micro):
    for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
        grads = torch.autograd.grad(loss_fn(model(xs), ys) / micro, list(model.parameters()))
        for p, g in zip(model.parameters(), grads):
            p.grad = g


def printed_bubble(k, m):
    print((k - 1) / (m + k - 1))


def frozen_stage(block, x):
    return checkpoint(block.requires_grad_(False), x, use_reentrant=False)


def never_returns(*_):
    while True:
        pass


def greedy_that_never_advances(costs, k):
    """A greedy cut whose loop waits for a layer it can never take (one costlier than total/K)."""
    counts, i = [], 0
    while len(counts) < k:
        stage = 0
        while i < len(costs) and sum(costs[i - stage:i + 1]) <= sum(costs) / k:
            i, stage = i + 1, stage + 1
        if stage:
            counts.append(stage)
    return counts


def no_grad_stage(block, x):
    with torch.no_grad():
        return block(x)


def drifting_recompute(block, x):
    """A checkpointed stage whose recompute runs on another input than its forward did."""
    calls = []

    def run(t):
        calls.append(t)
        return block(t if len(calls) == 1 else 1.5 * t)
    return checkpoint(run, x, use_reentrant=False)


def twice_each(model, x, y, loss_fn, micro):
    for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
        model(xs)
        (loss_fn(model(xs), ys) / micro).backward()


def raising(*_):
    raise RuntimeError("a bug in the answer")


REFERENCES = {   # check: the lab's answer
    exercises.check_training_bytes: lambda p: 16 * p,
    exercises.check_naive_bubble: lambda k: (k - 1) / k,
    exercises.check_bubble: bubble,
    exercises.check_ideal_speedup: speedup,
    exercises.check_in_flight: lambda k, s: k - s,
    exercises.check_boundary_bytes: lambda n, b: 2 * n * b,
    exercises.check_bubble_ms: lambda k, m, f, b: (k - 1) * (f + b),
    exercises.check_fill_drain: fill_drain,
    exercises.check_checkpointed_stage: lambda block, x: checkpoint(block, x, use_reentrant=False),
    exercises.check_accumulation: accumulate_right,
    exercises.check_best_cut: solve,
}

# Every reference answer mutated the ways learners get it wrong: (check, wrong answer, family).
MUTANTS = [
    (exercises.check_training_bytes, lambda p: 4 * p, "weights alone"),
    (exercises.check_training_bytes, lambda p: 8 * p, "weights and gradients"),
    (exercises.check_training_bytes, lambda p: 12 * p, "one moment"),
    (exercises.check_training_bytes, lambda p: 16 * 8 * p, "bits"),
    (exercises.check_training_bytes, lambda p: 16 * p / 2 ** 20, "mebibytes"),
    (exercises.check_training_bytes, lambda p: 16 * p / 1e6, "megabytes"),
    (exercises.check_training_bytes, lambda p: 16 * p / 1e3, "kilobytes"),
    (exercises.check_training_bytes, lambda p: 16 * p / 1024, "kibibytes"),
    (exercises.check_training_bytes, lambda p: 16 * p / 1e9, "gigabytes"),
    (exercises.check_training_bytes, lambda p: 16 * p / 2 ** 30, "gibibytes"),
    (exercises.check_training_bytes, lambda p: 4 * p / 2 ** 30, "weights alone"),   # in GiB too: both are said
    (exercises.check_training_bytes, lambda p: 4 * 4 * 4 * p, "four bytes twice"),
    (exercises.check_training_bytes, lambda p: 16 * p + p * p, "no pattern"),
    (exercises.check_training_bytes, lambda p: 17 * p, "a factor"),
    (exercises.check_training_bytes, lambda p: 16 * p + 3, "an offset"),
    (exercises.check_training_bytes, lambda p: 16, "constant"),
    (exercises.check_naive_bubble, lambda k: 1 / k, "busy share"),
    (exercises.check_naive_bubble, lambda k: (k - 1) // k, "integer division"),
    (exercises.check_naive_bubble, lambda k: 100 * (k - 1) / k, "percent"),
    (exercises.check_naive_bubble, lambda k: k - 1, "idle slots"),
    (exercises.check_naive_bubble, lambda k: 0.5, "constant"),
    (exercises.check_naive_bubble, lambda k: k - 1 / k, "precedence"),
    (exercises.check_naive_bubble, lambda k: (k - 1) / (k + 1), "no pattern"),
    (exercises.check_bubble, lambda k, m: m / (m + k - 1), "busy share"),
    (exercises.check_bubble, lambda k, m: (k - 1) / m, "divided by M"),
    (exercises.check_bubble, lambda k, m: (k - 1) / (m + k), "off by one slot"),
    (exercises.check_bubble, lambda k, m: k / (m + k - 1), "off by one slot"),
    (exercises.check_bubble, lambda k, m: (k - 1) // (m + k - 1), "integer division"),
    (exercises.check_bubble, lambda k, m: 100 * bubble(k, m), "percent"),
    (exercises.check_bubble, lambda k, m: bubble(m, k), "swapped"),
    (exercises.check_bubble, lambda k, m: 0.2, "constant"),
    (exercises.check_bubble, lambda k, m: k - 1 / (m + k - 1), "precedence"),
    (exercises.check_bubble, lambda k, m: (k - 1) / m + k - 1, "precedence"),
    (exercises.check_bubble, lambda k, m: round(bubble(k, m), 2), "rounded"),
    (exercises.check_bubble, lambda k, m: k / (m + k), "one variable off"),   # K+1 for K
    (exercises.check_bubble, lambda k, m: bubble(k, m) if m >= k else 0.5, "no pattern"),
    (exercises.check_bubble, lambda k, m: bubble(k, m) if m >= k else 0.9, "special case"),
    (exercises.check_bubble, lambda k, m: 2 * bubble(k, m), "a factor"),
    (exercises.check_ideal_speedup, lambda k, m: k, "forgets the bubble"),
    (exercises.check_ideal_speedup, lambda k, m: m / (m + k - 1), "one device's share"),
    (exercises.check_ideal_speedup, lambda k, m: k * bubble(k, m), "bubble times K"),
    (exercises.check_ideal_speedup, lambda k, m: k * m / (m + k), "off by one slot"),
    (exercises.check_ideal_speedup, lambda k, m: k * m // (m + k - 1), "integer division"),
    (exercises.check_ideal_speedup, lambda k, m: 4.0, "constant"),
    (exercises.check_ideal_speedup, lambda k, m: (m + k - 1) / (k * m), "inverse"),
    (exercises.check_ideal_speedup, lambda k, m: k * m / m + k - 1, "precedence"),
    (exercises.check_ideal_speedup, lambda k, m: speedup(k, m) if m >= k else 1, "no pattern"),
    (exercises.check_in_flight, lambda k, s: k - 1 - s, "one less held"),
    (exercises.check_in_flight, lambda k, s: s + 1, "counted from the end"),
    (exercises.check_in_flight, lambda k, s: k, "same on every stage"),
    (exercises.check_in_flight, lambda k, s: s - k, "swapped"),
    (exercises.check_in_flight, lambda k, s: 4, "constant"),
    (exercises.check_boundary_bytes, lambda n, b: n * b, "forward only"),
    (exercises.check_boundary_bytes, lambda n, b: 2 * b, "per sample"),
    (exercises.check_boundary_bytes, lambda n, b: 16 * n * b, "bits"),
    (exercises.check_boundary_bytes, lambda n, b: 2 * n * b * 4, "four bytes again"),
    (exercises.check_boundary_bytes, lambda n, b: 1024, "constant"),
    (exercises.check_bubble_ms, lambda k, m, f, b: (k - 1) * f, "fill only"),
    (exercises.check_bubble_ms, lambda k, m, f, b: (k - 1) / (m + k - 1), "share, not time"),
    (exercises.check_bubble_ms, lambda k, m, f, b: m * (f + b), "own work"),
    (exercises.check_bubble_ms, lambda k, m, f, b: (m + k - 1) * (f + b), "whole step"),
    (exercises.check_bubble_ms, lambda k, m, f, b: k * (f + b), "off by one slot"),
    (exercises.check_bubble_ms, lambda k, m, f, b: (k - 1) * (f + b) // 1, "integer division"),
    (exercises.check_bubble_ms, lambda k, m, f, b: 3.0, "constant"),
    (exercises.check_bubble_ms, lambda k, m, f, b: (k - 1) * (f + b) / 1000, "seconds"),
    (exercises.check_bubble_ms, lambda k, m, f, b: (k - 1) * (f + b) * 1000, "microseconds"),
    (exercises.check_bubble_ms, lambda k, m, f, b: (k - 1) * f / 1000, "fill only"),   # in seconds too
    (exercises.check_bubble_ms, lambda k, m, f, b: (k - 1) * f + b, "precedence"),
    (exercises.check_bubble_ms, lambda k, m, f, b: (k - 1) * (f + b) if m > 2 else 0.0, "no pattern"),
    (exercises.check_fill_drain, lambda k, m: fill_drain(k, m)[0], "flat list"),
    (exercises.check_fill_drain, lambda k, m: fill_drain(m, k), "K and M swapped"),
    (exercises.check_fill_drain, lambda k, m: [[f"F{i + 1}" for i in range(m)] +
                                               [f"B{i + 1}" for i in reversed(range(m))] for _ in range(k)],
     "numbered from 0"),
    (exercises.check_fill_drain, lambda k, m: [[(t[0], int(t[1:])) for t in s] for s in fill_drain(k, m)],
     "task names"),
    (exercises.check_fill_drain, lambda k, m: [[f"F{i}" for i in range(m)] + [f"R{i}" for i in range(m)] +
                                               [f"B{i}" for i in reversed(range(m))] for _ in range(k)],
     "no recompute"),
    (exercises.check_fill_drain, lambda k, m: [s[:-1] for s in fill_drain(k, m)], "every task once"),
    (exercises.check_fill_drain, lambda k, m: [[t for i in range(m) for t in (f"F{i}", f"B{i}")] for _ in range(k)],
     "fill before drain"),
    (exercises.check_fill_drain, lambda k, m: [[f"F{i}" for i in reversed(range(m))] +
                                               [f"B{i}" for i in reversed(range(m))] for _ in range(k)],
     "forward order"),
    (exercises.check_fill_drain, lambda k, m: [[f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]
                                               for _ in range(k)], "drain order"),
    (exercises.check_fill_drain, lambda k, m: k * m, "schedule shape"),
    (exercises.check_fill_drain, lambda k, m: [" ".join(s) for s in fill_drain(k, m)], "stage strings"),
    (exercises.check_fill_drain, lambda k, m: " ".join(fill_drain(k, m)[0]), "schedule shape"),
    (exercises.check_checkpointed_stage, lambda block, x: block(x), "kept activations"),
    (exercises.check_checkpointed_stage, no_grad_stage, "no_grad"),
    (exercises.check_checkpointed_stage, lambda block, x: block(x).detach(), "detached output"),
    (exercises.check_checkpointed_stage, lambda block, x: checkpoint(block, x.detach(), use_reentrant=True),
     "detached input"),
    (exercises.check_checkpointed_stage, lambda block, x: checkpoint(block, x.detach(), use_reentrant=False),
     "detached input"),
    (exercises.check_checkpointed_stage,
     lambda block, x: checkpoint(block, x.detach().requires_grad_(), use_reentrant=False), "detached input"),
    (exercises.check_checkpointed_stage, lambda block, x: 2 * checkpoint(block, x, use_reentrant=False),
     "different output"),
    (exercises.check_checkpointed_stage, lambda block, x: block, "not a tensor"),
    (exercises.check_checkpointed_stage, drifting_recompute, "different gradients"),
    (exercises.check_checkpointed_stage, frozen_stage, "frozen block"),
    (exercises.check_checkpointed_stage, lambda block, x: checkpoint(block, x, use_reentrant=False,
                                                                     preserve_rng_state=False), "random state"),
    (exercises.check_checkpointed_stage, kept_on_the_host, "kept, not recomputed"),
    (exercises.check_checkpointed_stage, lambda block, x: [block(x), checkpoint(block, x, use_reentrant=False)][1],
     "kept activations"),   # the plain forward's activations were held until its output went
    (exercises.check_checkpointed_stage,
     lambda block, x: checkpoint(block, x, use_reentrant=False).detach().requires_grad_(), "detached output"),
    (exercises.check_checkpointed_stage, lambda block, x: block[7](checkpoint(block[:7], x, use_reentrant=False)),
     "kept activations"),
    (exercises.check_accumulation, lambda model, x, y, loss_fn, micro: loss_fn(model(x), y).backward(), "whole batch"),
    (exercises.check_accumulation, accumulate_with(scale=lambda i, m, xs: 1), "unscaled"),
    (exercises.check_accumulation, accumulate_with(scale=lambda i, m, xs: 1 / m ** 2), "scaled twice"),
    (exercises.check_accumulation, accumulate_with(scale=lambda i, m, xs: 1 / len(xs)), "divided by its size"),
    (exercises.check_accumulation, accumulate_with(zero_inside=True), "zero_grad inside"),
    (exercises.check_accumulation, accumulate_with(scale=lambda i, m, xs: 1 / m if i == m - 1 else 1),
     "last one scaled"),
    (exercises.check_accumulation, accumulate_with(scale=lambda i, m, xs: float(m)), "wrong scale"),
    (exercises.check_accumulation, accumulate_with(cut=torch.Tensor.split), "split for chunk"),
    (exercises.check_accumulation, twice_each, "micro-batch sizes"),
    (exercises.check_accumulation, accumulate_with(scale=lambda i, m, xs: 1 / m if i % 2 else 0.5 / m),
     "uneven weights"),
    (exercises.check_accumulation, accumulate_with(scale=lambda i, m, xs: 1 / m, zero_after=True), "zeroed after"),
    (exercises.check_accumulation, doubled_inputs, "scaled inputs"),
    (exercises.check_accumulation, shifted_inputs, "different accumulation"),
    (exercises.check_accumulation, scaled_logits, "scaled logits"),
    (exercises.check_accumulation, one_backward, "graphs held"),
    (exercises.check_accumulation, gradients_not_kept, "autograd.grad"),
    (exercises.check_accumulation, scaled_by_integer_division, "scaled by zero"),
    (exercises.check_accumulation, forwards_without_grad, "forward without grad"),
    (exercises.check_accumulation, assigned_not_added, "zero_grad inside"),
    (exercises.check_bubble, printed_bubble, "printed"),
    (exercises.check_ideal_speedup, lambda k, m: 100 * speedup(k, m), "ratio as percent"),
    (exercises.check_bubble_ms, lambda k, m, f, b: (k - 1) * b, "drain only"),
    (exercises.check_accumulation, lambda model, x, y, loss_fn, micro: [loss_fn(model(xs), ys) for xs, ys in
                                                                        zip(x.chunk(micro), y.chunk(micro))],
     "no backward"),
    (exercises.check_best_cut, exercises.greedy_cut, "greedy cut"),
    (exercises.check_best_cut, exercises.variance_cut, "variance cut"),
    (exercises.check_best_cut, lambda costs, k: [len(costs) - k + 1] + [1] * (k - 1), "not the min-max"),
    (exercises.check_best_cut, lambda costs, k: [0, *accumulate(solve(costs, k))], "cut edges"),
    (exercises.check_best_cut, lambda costs, k: solve(costs, k)[:-1], "cut counts"),
    (exercises.check_best_cut, lambda costs, k: solve(costs, k) + [1], "cut counts"),
    (exercises.check_best_cut, lambda costs, k: cuts._stage_costs(costs, solve(costs, k)),
     "stage costs"),
    (exercises.check_best_cut, lambda costs, k: max(cuts._stage_costs(costs, solve(costs, k))), "cut shape"),
    (exercises.check_best_cut, lambda costs, k: [str(n) for n in solve(costs, k)], "cut shape"),
    (exercises.check_best_cut, greedy_that_never_advances, "too long"),
    (exercises.check_best_cut, lambda costs, k: exercises.greedy_cuts(costs, k)[1], "greedy cut"),   # before passing
    (exercises.check_best_cut, lambda costs, k: exercises.greedy_cuts(costs, k)[2], "greedy cut"),   # from the back
    (exercises.check_best_cut, lambda costs, k: solve([round(c) for c in costs], k), "rounded costs"),
    (exercises.check_bubble_ms, lambda k, m, f, b: (k - 1) * (2 * f + b), "recompute added"),
    (exercises.check_bubble_ms, lambda k, m, f, b: (k - 1) * (f + b) / m, "per micro-batch"),
    (exercises.check_in_flight, lambda k, s: (k - s) / k, "a share"),
    (exercises.check_naive_bubble, lambda k: k / (k - 1) if k > 1 else 0.0, "inverse"),   # guarded at K = 1
    (exercises.check_best_cut, lambda costs, k: [len(a) for a in np.array_split(costs, k)], "equal counts"),
    (exercises.check_best_cut, lambda costs, k: [len(costs) // k] * (k - 1) +
                                                [len(costs) - (k - 1) * (len(costs) // k)], "equal counts"),
    (exercises.check_bubble, never_returns, "too long"),
    (exercises.check_best_cut, lambda costs, k: itertools.count(1), "endless"),  # read within the bound, not after
    (exercises.check_fill_drain, lambda k, m: [itertools.cycle(["F0"]) for _ in range(k)], "endless"),
    (exercises.check_checkpointed_stage, lambda block, x: checkpoint(block, x, use_reentrant=True),
     "reentrant on data"),  # right while the input requires grad; the first stage's input is data
]
FORMULA_CHECKS = (exercises.check_training_bytes, exercises.check_naive_bubble, exercises.check_bubble,
                  exercises.check_ideal_speedup, exercises.check_in_flight, exercises.check_boundary_bytes,
                  exercises.check_bubble_ms)
# Every check, whatever its reference: raising; and for formulas, a number as text.
MUTANTS += [(check, raising, "raised") for check in REFERENCES]
MUTANTS += [(check, lambda *a, _right=REFERENCES[check]: str(_right(*a)), "not a number") for check in FORMULA_CHECKS]


def written(plan) -> str:
    return format(plan if isinstance(plan, Schedule) else Schedule(plan))


def same_order_everywhere(split: bool) -> str:
    """1F1B's stage 0 order on every stage (each W right after its B if `split`): legal, K held, slow."""
    first = one_f_one_b(4, 8, "never")[0]
    return written([[t for task in first for t in [task._replace(chunk=k)] +
                     ([Task("W", task.micro, k)] if split and task.op == "B" else [])] for k in range(4)])


ONE_F_ONE_B = written(one_f_one_b(4, 8, "never"))
FIXED = exercises.BROKEN.replace("stage 0: F0 B0 F1 B1 F2 B2 F3 B3", "stage 0: F0 F1 B0 B1 F2 F3 B2 B3")
WRITTEN_REFERENCES = {exercises.check_written_1f1b: ONE_F_ONE_B, exercises.check_deadlock_fix: FIXED,
                      exercises.check_split_schedule: written(zb_h1(4, 8, "never"))}
MUTANTS += [
    (exercises.check_written_1f1b, 3, "schedule text"),
    (exercises.check_written_1f1b, "stage 0: F0 X1", "schedule text"),
    (exercises.check_written_1f1b, written(one_f_one_b(3, 8, "never")), "stage count"),
    (exercises.check_written_1f1b, ONE_F_ONE_B.replace(" B7", "", 1), "engine refuses"),
    (exercises.check_written_1f1b, written(zb_h1(4, 8, "never")), "split in 1F1B"),
    (exercises.check_written_1f1b, written(gpipe(4, 8, "never")), "holds too many"),
    (exercises.check_written_1f1b, same_order_everywhere(split=False), "slower than 1F1B"),
    (exercises.check_written_1f1b, "\n".join(line.replace("B4 B5 B6 B7", "B7 B6 B5 B4")
                                             for line in ONE_F_ONE_B.splitlines()), "1F1B backward order"),
    (exercises.check_deadlock_fix, exercises.BROKEN, "still deadlocks"),
    (exercises.check_deadlock_fix, exercises.BROKEN.replace("F0 B0 F1 B1", "F0 F1 B0 B1"), "still deadlocks"),
    (exercises.check_deadlock_fix, FIXED.replace("stage 2: F0 F1 B0", "stage 2: B0 F0 F1"), "engine refuses"),
    (exercises.check_deadlock_fix, FIXED.replace(" F3 B2 B3", " B2", 1), "not a reorder"),
    (exercises.check_split_schedule, ONE_F_ONE_B, "no W"),
    (exercises.check_split_schedule, written([tasks + [Task("W", m, k) for m in range(8)]
                                              for k, tasks in enumerate(gpipe(4, 8, "never"))]),
     "holds more than 1F1B"),
    (exercises.check_split_schedule, same_order_everywhere(split=True), "bubble not smaller"),
    (exercises.check_split_schedule, written(zb_h1(4, 8, "never")).replace("B0 W0", "W0 B0"), "engine refuses"),
]


@pytest.mark.parametrize("check,right", WRITTEN_REFERENCES.items(), ids=lambda v: getattr(v, "__name__", ""))
def test_written_schedules_that_are_right_pass_as_text_or_as_a_schedule(check, right):
    assert check(right).startswith("✓"), check(right)
    assert check(parse(right)).startswith("✓"), check(parse(right))
    assert check(...).startswith("… not attempted yet") and "replace the `...`" in check(...)


@pytest.mark.parametrize("check,right", REFERENCES.items(), ids=lambda v: getattr(v, "__name__", ""))
def test_the_reference_answers_pass(check, right):
    assert check(right).startswith("✓"), check(right)


@pytest.mark.parametrize("check,wrong,family", MUTANTS,
                         ids=[f"{c.__name__[6:]}-{f}" for c, _, f in MUTANTS])
def test_every_mutation_is_rejected_with_its_familys_sentence(check, wrong, family):
    said = check(wrong)   # never raises: a raise here fails the test
    assert said.startswith("✗") and SAYS[family] in said, said


def test_every_family_of_mistakes_is_tested():
    tested = {family for _, _, family in MUTANTS}
    untested = set(SAYS) - tested - PIPE_PLAN_LAYOUT_FAMILIES - {"not a function"}
    assert not untested, untested


PIPE_PLAN_LAYOUT_FAMILIES = {"not a pipe", "not run", "forward only call", "batch too small", "batch not divisible",
                             "forward after step", "step result", "keywords", "plan shape",
                             "plan not in table", "over budget", "more stages", "more micro-batches",
                             "fewer micro-batches", "drop recompute", "add recompute", "layout shape", "layout swapped",
                             "own not sequential", "own does not run"}  # the last two: the capstone's own model


@pytest.mark.parametrize("right", [
    lambda k, m: np.float64(bubble(k, m)), lambda k, m: np.float32(bubble(k, m)),
    lambda k, m: torch.tensor(bubble(k, m)), lambda k, m: fractions.Fraction(k - 1, m + k - 1),
    lambda k, m: 1 - m / (m + k - 1), lambda k, m: np.array([bubble(k, m)])])
def test_a_number_is_a_number_whoever_made_it(right):
    assert exercises.check_bubble(right).startswith("✓")
    assert exercises.check_in_flight(lambda k, s: np.int64(k - s)).startswith("✓")
    assert exercises.check_in_flight(lambda k, s: float(k - s)).startswith("✓")
    assert exercises.check_in_flight(lambda k, s: torch.tensor(k - s)).startswith("✓")
    assert exercises.check_training_bytes(lambda p: np.int32(16) * p).startswith("✓")


def test_right_answers_in_other_shapes_pass():
    assert exercises.check_fill_drain(lambda k, m: ((t for t in s) for s in fill_drain(k, m))).startswith("✓")
    assert exercises.check_fill_drain(lambda k, m: tuple(tuple(s) for s in fill_drain(k, m))).startswith("✓")
    for shape in (np.array, torch.tensor, tuple, lambda c: [float(n) for n in c], lambda c: (n for n in c)):
        assert exercises.check_best_cut(lambda costs, k: shape(solve(costs, k))).startswith("✓")
    assert exercises.check_checkpointed_stage(lambda block, x: checkpoint(block, x.clone(), use_reentrant=False)
                                              ).startswith("✓")
    assert exercises.check_accumulation(summed_by_hand).startswith("✓")
    for schedule in (one_f_one_b(4, 8, "never"), [[str(t) for t in tasks] for tasks in one_f_one_b(4, 8, "never")]):
        assert exercises.check_written_1f1b(schedule).startswith("✓")
    assert exercises.check_split_schedule(zb_h1(4, 8, "never")).startswith("✓")


@pytest.mark.parametrize("right", [
    lambda k, m: decimal.Decimal(k - 1) / decimal.Decimal(m + k - 1),
    lambda k, m: torch.tensor(bubble(k, m), dtype=torch.float16),
    lambda k, m: torch.tensor(bubble(k, m), dtype=torch.bfloat16),
    lambda k, m: np.float16(bubble(k, m)), lambda k, m: torch.tensor([[bubble(k, m)]], dtype=torch.float64)],
    ids=["Decimal", "float16", "bfloat16", "numpy float16", "1x1 tensor"])
def test_a_number_in_any_precision_is_judged_to_its_own_precision(right):
    assert exercises.check_bubble(right).startswith("✓")


def test_lazy_answers_are_read_as_the_lists_they_yield():
    """A generator, a map or a tuple of them is a right answer where its items are: the check reads
    it inside the learner's bound (tests above: an endless one is told so, not waited on)."""
    right = REFERENCES[exercises.check_fill_drain]
    assert exercises.check_fill_drain(lambda k, m: (iter(stage) for stage in right(k, m))).startswith("✓")
    assert exercises.check_fill_drain(lambda k, m: tuple(map(iter, right(k, m)))).startswith("✓")
    assert exercises.check_best_cut(lambda costs, k: iter(solve(costs, k))).startswith("✓")


def test_a_function_that_does_not_return_is_stopped_and_told_so(monkeypatch):
    """Bounded by the learner's own CPU time (5 s in a lesson), so a busy host does not stop a slow
    right answer, and by 20 s in all for a loop that sleeps or a wait that never ends."""
    monkeypatch.setattr(sandbox, "CALL_SECONDS", 0.5)
    monkeypatch.setattr(sandbox, "WAIT_SECONDS", 2.0)
    said = exercises.check_best_cut(greedy_that_never_advances)
    assert said.startswith("✗") and "did not return within 0.5 s" in said and SAYS["too long"] in said, said

    def sleeps(k, m):
        while True:
            time.sleep(0.01)

    def waits_for_ever(k, m):   # a lock nobody releases: no bytecode runs, so it is left behind, asleep
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()
    for stuck in (sleeps, waits_for_ever):
        said = exercises.check_bubble(stuck)
        assert said.startswith("✗") and SAYS["too long"] in said, said
    assert exercises.check_bubble(bubble).startswith("✓"), "the watcher has stopped: nothing is raised later"
    time.sleep(0.3)


def test_one_wrong_weight_for_every_micro_batch_is_said_in_the_exercises_numbers():
    said = exercises.check_accumulation(accumulate_with(scale=lambda i, m, xs: float(m)))
    assert "that is micro (M), multiplied instead of divided" in said and SAYS["wrong scale"] in said, said
    said = exercises.check_accumulation(accumulate_with(scale=lambda i, m, xs: 1 / 24))
    assert "1 / the batch's size" in said, said


def test_a_wrong_formula_with_no_known_mistake_shows_every_case():
    said = exercises.check_ideal_speedup(lambda k, m: speedup(k, m) if m >= k else 1)
    rows = said.splitlines()[1:]
    assert rows[0].split() == ["K", "M", "expected", "yours"] and len(rows) == 1 + len(exercises.IDEAL_SPEEDUP.cases)
    assert [row.split()[:2] for row in rows if row.endswith("✗")] == [["4", "2"]], said


JUNK = [3, 2.5, None, "an answer", b"bytes", [1, 2], {}, (x for x in range(3)), torch.ones(3), np.arange(4),
        object(), raising, lambda: 1, lambda *a: (yield 1), lambda *a: None, lambda *a: float("nan"),
        lambda *a: torch.ones(2, 2), lambda *a: [[object()]], lambda *a: [None, None], nn.Linear]


@pytest.mark.parametrize("junk", JUNK, ids=range(len(JUNK)))
def test_no_check_raises_whatever_it_is_given(junk):
    from lab.studies.layouts import LargeRun
    checks = [*REFERENCES, *WRITTEN_REFERENCES, exercises.check_first_pipe,
              lambda a: exercises.check_plan(a, PLAN_ROWS), lambda a: exercises.check_layout(a, LargeRun())]
    for check in checks:
        said = check(junk)
        assert isinstance(said, str) and said[0] in "✗…", said


PLAN_ROWS = [{"K": k, "M": m, "checkpoint": c,
              "predicted bytes (most loaded stage)": 1000 // k * (2 if c == "never" else 1),
              "fits (predicted)": 1000 // k * (2 if c == "never" else 1) <= 500,
              "time vs one device (theory)": round(theory.time_vs_one_device(k, m, c), 3)}
             for k in (1, 2, 4) for m in (1, 2, 4, 8) for c in ("never", "always")]


def test_the_plan_check_names_what_would_be_faster():
    best = exercises.best_plan(PLAN_ROWS)
    assert best == dict(stages=4, micro_batches=8, checkpoint="never")
    assert exercises.check_plan(best, PLAN_ROWS).startswith("✓")
    as_numpy = {"stages": np.int64(4), "micro_batches": np.float64(8.0), "checkpoint": "never"}   # a DataFrame row's
    assert exercises.check_plan(as_numpy, PLAN_ROWS).startswith("✓")
    said = exercises.check_plan(dict(stages=2, micro_batches=8, checkpoint="always"), PLAN_ROWS)
    assert SAYS["more stages"] in said and SAYS["drop recompute"] in said \
        and SAYS["more micro-batches"] not in said, said
    said = exercises.check_plan(dict(stages=4, micro_batches=2, checkpoint="never"), PLAN_ROWS)
    assert SAYS["more micro-batches"] in said and SAYS["more stages"] not in said, said
    assert SAYS["over budget"] in exercises.check_plan(dict(stages=1, micro_batches=1, checkpoint="never"), PLAN_ROWS)
    assert SAYS["plan not in table"] in exercises.check_plan(dict(stages=3, micro_batches=1, checkpoint="never"),
                                                             PLAN_ROWS)
    assert SAYS["plan shape"] in exercises.check_plan(dict(stages=4), PLAN_ROWS)
    assert exercises.check_plan(dict(stages=..., micro_batches=..., checkpoint=...), PLAN_ROWS).startswith("… not")


def test_the_layout_check_weighs_memory_then_time():
    from lab.studies.layouts import LargeRun
    selective = LargeRun(selective=True)   # 2 x 4 fits and wins; with the attention's scores kept only 1 x 8 fits
    assert selective.best() == (2, 4) and LargeRun().best() == (1, 8)
    frame = pd.DataFrame(selective.table())
    row = frame[(frame["D"] == 2) & (frame["K"] == 4)].iloc[0]
    for right in ((2, 4), [2, 4], tuple(row[["D", "K"]]), np.array([2, 4]), torch.tensor([2, 4]), (2.0, 4.0),
                  {"D": 2, "K": 4}):
        assert exercises.check_layout(right, selective).startswith("✓ 2 x 4: fits"), right
    assert "4 workers, but there are 8" in exercises.check_layout((2, 2), selective)
    assert "GB per worker, more than the 80 GB" in exercises.check_layout((8, 1), selective)
    assert "but 2 x 4 also fits" in exercises.check_layout((1, 8), selective)
    assert "needs 95.0 GB per worker" in exercises.check_layout((2, 4), LargeRun())
    said = exercises.check_layout((4, 2), selective)   # a real layout that does not fit, or 2 x 4 swapped
    assert "4 x 2 needs 123.9 GB per worker" in said and SAYS["layout swapped"] in said, said
    assert SAYS["layout shape"] in exercises.check_layout("2x4", selective)
    assert SAYS["layout shape"] in exercises.check_layout((2, 4.5), selective)
    assert exercises.check_layout(..., selective).startswith("… not attempted yet")
    slow_links = LargeRun(bandwidth=1e9, selective=True)   # the all-reduce outweighs the bubble it saves
    assert slow_links.best() == (1, 8) and "costs more than the bubble it saves" in \
        exercises.check_layout((2, 4), slow_links)


def test_the_first_pipe_check_counts_the_micro_batches_that_ran():
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    pipe = GPipe(model, balance=3, chunks=6)
    assert SAYS["not run"] in exercises.check_first_pipe(pipe)
    pipe(torch.randn(12, 4))
    assert SAYS["forward only call"] in exercises.check_first_pipe(pipe)
    pipe.step(torch.randn(4, 4), torch.randint(0, 2, (4,)), nn.CrossEntropyLoss())
    said = exercises.check_first_pipe(pipe)
    assert SAYS["batch too small"] in said and "ran 4 micro-batches" in said, said
    pipe.step(torch.randn(9, 4), torch.randint(0, 2, (9,)), nn.CrossEntropyLoss())
    said = exercises.check_first_pipe(pipe)
    assert SAYS["batch not divisible"] in said and "ran 5 micro-batches" in said, said   # 9 in pieces of 2
    pipe.step(torch.randn(12, 4), torch.randint(0, 2, (12,)), nn.CrossEntropyLoss())
    # 3 x (6 F + 5 R + 6 B)
    assert exercises.check_first_pipe(pipe).startswith("✓ 51 tasks ran on 3 stages over 6 micro-batches")
    loss = pipe.step(torch.randn(12, 4), torch.randint(0, 2, (12,)), nn.CrossEntropyLoss())
    assert SAYS["step result"] in exercises.check_first_pipe(loss)         # my_pipe = my_pipe.step(...)
    pipe(torch.randn(12, 4))                                                # an evaluation after the step
    assert SAYS["forward after step"] in exercises.check_first_pipe(pipe)
    assert "2 stages" in exercises.check_first_pipe(GPipe(model, balance=2, chunks=6))
    assert "chunks=4" in exercises.check_first_pipe(GPipe(model, balance=3, chunks=4))
    assert SAYS["not a pipe"] in exercises.check_first_pipe(model)


def test_the_cut_battery_separates_the_usual_wrong_cuts():
    battery = exercises.cut_battery()
    assert len(battery) >= 300
    assert {len(c) for c, _, _ in battery} == set(range(4, 13)) and {k for _, k, _ in battery} == set(range(2, 7))

    def loses(cut, costs, k, best):
        return max(cuts._stage_costs(costs, cut(list(costs), k))) > best + 1e-9
    separating = battery[:len(exercises.SEPARATING_CUTS)]
    assert all(loses(exercises.variance_cut, *item) for item in separating[:3])
    assert all(loses(exercises.greedy_cut, *item) for item in separating[3:])
    assert sum(loses(exercises.greedy_cut, *item) for item in battery) > len(battery) / 2
    assert sum(loses(exercises.variance_cut, *item) for item in battery) >= 10
    said = exercises.check_best_cut(exercises.variance_cut)
    assert "costs [6, 5, 9, 3], K=3" in said and "gets the costliest down to 11" in said, said


def test_an_answer_not_attempted_says_so():
    def blank(*_):
        ...
    for said in [check(blank) for check in REFERENCES if check is not exercises.check_accumulation] + \
            [exercises.check_accumulation(blank), exercises.check_first_pipe(...), exercises.check_plan(..., []),
             exercises.check_layout(..., None)]:
        assert said.startswith("… not attempted yet") and "replace the `...`" in said, said


def test_the_cells_after_an_exercise_get_a_right_answer_either_way():
    def not_yet(costs, k):
        ...
    assert exercises.yours_if_right(exercises.check_best_cut, not_yet, solve) == (solve, "the lab's")
    assert exercises.yours_if_right(exercises.check_best_cut, solve, None) == (solve, "your")


def test_a_number_that_cannot_be_read_is_not_a_number():
    class Strange:   # looks like a number, breaks when read as one
        def __float__(self):
            raise ArithmeticError("no")
    said = exercises.check_bubble(lambda k, m: Strange())
    assert said.startswith("✗") and SAYS["not a number"] in said, said


def test_a_check_called_with_keywords_says_how_to_call_it():
    said = exercises.check_bubble(fn=bubble)
    assert said.startswith("✗") and SAYS["keywords"] in said, said
    said = exercises.check_layout((1, 8), large_run=None)
    assert said.startswith("✗") and SAYS["keywords"] in said, said


def test_what_a_learners_function_raises_is_feedback_whatever_it_is():
    def closes(*args):
        raise GeneratorExit()
    said = exercises.check_bubble(closes)
    assert said.startswith("✗") and "GeneratorExit" in said and SAYS["raised"] in said, said


def test_a_constant_that_a_known_mistake_also_gives_is_told_both_ways():
    said = exercises.check_bubble(lambda k, m: 0)   # a constant 0, or (K-1)//(M+K-1)
    assert SAYS["constant"] in said and SAYS["integer division"] in said, said


def test_a_whole_pandas_row_is_a_layout_too():
    from lab.studies.layouts import LargeRun
    selective = LargeRun(selective=True)
    frame = pd.DataFrame(selective.table())
    best = frame[frame["fits"]].sort_values("step s").iloc[0]
    assert exercises.check_layout(best, selective).startswith("✓ 2 x 4: fits")


def test_a_cut_family_is_named_only_when_the_cut_behaves_as_that_family():
    def never_before_last(costs, k):   # a brute force that never cuts before the last layer
        from itertools import combinations
        cuts = min(combinations(range(1, len(costs) - 1), k - 1),
                   key=lambda c: max(sum(costs[a:b]) for a, b in zip((0, *c), (*c, len(costs)))))
        return [b - a for a, b in zip((0, *cuts), (*cuts, len(costs)))]
    said = exercises.check_best_cut(never_before_last)
    assert said.startswith("✗") and SAYS["variance cut"] not in said and SAYS["greedy cut"] not in said, said
    assert SAYS["not the min-max"] in said, said


def test_an_answer_blocked_for_good_leaves_profiled_code_running():
    """A check gives up on an answer stuck on a lock; code run later under a profile function (a
    debugger, coverage, lab.engine_time.host_time's counts) must not hang (CPython 3.11 loops for ever on an
    exception left pending on a blocked thread). In a child, so that a regression fails, not hangs."""
    script = (
        "import sys, threading\n"
        "from lab.lessons import exercises, sandbox\n"
        "def waits_for_ever(k, m):\n"
        "    lock = threading.Lock(); lock.acquire(); lock.acquire()\n"
        "sandbox.WAIT_SECONDS = 0.5\n"
        "print(exercises.check_bubble(waits_for_ever).split()[0])\n"
        "calls = []\n"
        "sys.setprofile(lambda frame, event, arg: calls.append(event))\n"
        "len([1])\n"
        "(lambda: None)()\n"
        "sys.setprofile(None)\n"
        "print('profiled', len(calls) > 0)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[3])
    assert done.stdout.split() == ["✗", "profiled", "True"], done.stdout + done.stderr


def test_the_capstones_own_model_is_checked_before_it_is_pipelined():
    """The capstone's last exercise: a model of the learner's own, taken by lab.check only if it is a
    chain of layers that runs on the notebook's batch."""
    from torch import nn

    def blank():
        return ...
    assert exercises.check_own_model(blank).startswith("… not attempted yet")
    assert exercises.check_own_model(exercises.sample_model).startswith("✓ 7 layers")
    for made, family in ((lambda: nn.Linear(16, 4), "own not sequential"),
                         (lambda: nn.Sequential(nn.Linear(8, 4), nn.ReLU()), "own does not run"),
                         (lambda: nn.Sequential(nn.Linear(16, 4), nn.Flatten(0)), "own does not run")):
        said = exercises.check_own_model(made)
        assert said.startswith("✗") and SAYS[family] in said, said
