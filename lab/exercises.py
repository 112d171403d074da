"""Checks for the lessons' "your turn" cells: each runs what the learner wrote against the lab's
own answer and, when it differs, says what is wrong and why, not just that it is.

A check never stops a notebook (Run All runs every cell, as Kaggle Learn's `q.check()` does), never
raises and never hangs, whatever it is given (a learner's function is stopped after 5 s of CPU): it
returns "✓ ..." for a right answer, "✗ ..." with the specific feedback for a wrong one, and "… not
attempted yet: ..." while the `...` is still there. Each known mistake has its own sentence in
`SAYS`, which the tests hold the checks to; a formula check also knows the ways to get any formula
wrong (upside down, an argument off by one or swapped, another unit, rounding, precedence), and
shows a table of every case when none fits. A number is a number whether Python, numpy, torch or
Decimal made it, judged to its own precision. The cells after an exercise use `yours_if_right`,
so they run the same whether or not the learner has done it.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import io
import itertools
import math
import numbers
import random
import re
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from torch import nn

from engine import GPipe
from engine.balance import solve
from engine.memory import ActivationLedger
from engine import schedule as schedules
from engine.schedule import gpipe

from . import schedule_writer, theory

# Every known mistake's sentence, by family. A check names the family it recognized in the answer.
SAYS = {
    # any exercise
    "raised": "Fix the error in your function, then run this cell again",
    "not a function": "define a function with def, as the cell above does, and pass the function itself",
    "not a number": "expected a number (an int or a float)",
    "constant": "your function returns the same value whatever its arguments: the answer depends on them",
    "too long": "does every loop move on (past each item it looks at), and end? does it wait for something "
                "that never comes?",
    "integer division": "rounding down (// or int()) drops the fraction: use / and keep it",
    "rounded": "that is the answer rounded: return it exact (the notebook rounds only what it prints)",
    "percent": "that is a percentage; expected a fraction between 0 and 1 (drop the x 100)",
    "ratio as percent": "that is the ratio as a percentage; expected the ratio itself (drop the x 100)",
    "printed": "your function printed its answer but returned None: return the value (print only shows it)",
    "swapped": "you swapped the arguments: the function is called with them in the order its signature shows",
    "inverse": "that is the answer upside down (1 divided by it): swap what is above and below the fraction bar",
    "precedence": "operator precedence: * and / are done before + and -, so k-1/m means k-(1/m) and a/b+c means "
                  "(a/b)+c: put parentheses around each sum",
    "one variable off": "check each place that argument appears: the formula uses it as it is, and K-1 or M+K-1 "
                        "only where the slots call for them",
    "no pattern": "compare your function with the expected values in the table below, case by case",
    "a factor": "a factor that does not belong in the formula (or one missing from it)",
    "an offset": "a term that does not belong in the formula (or one missing from it)",
    "special case": "the formula holds for every case as it is: no special case is needed",
    # bytes
    "weights alone": "that is 4 bytes per parameter: the weights alone, or the four tensors (weight, gradient, "
                     "Adam's two moments) at 1 byte each; each of the four takes 4 bytes",
    "weights and gradients": "that counts weights and gradients: Adam adds two moments per weight",
    "one moment": "12 bytes per parameter leaves one of the four out: the weight, its gradient and Adam's two "
                  "moments take 4 bytes each",
    "bits": "that counts bits; expected bytes (8 bits each)",
    "kilobytes": "that is in kilobytes (kB, 1000 bytes); expected bytes: leave the unit as it is",
    "kibibytes": "that is in kibibytes (KiB, 1024 bytes); expected bytes: leave the unit as it is",
    "megabytes": "that is in megabytes (MB, 10^6 bytes); expected bytes: leave the unit as it is",
    "mebibytes": "that is in mebibytes (MiB, 2^20 bytes); expected bytes: leave the unit as it is",
    "gigabytes": "that is in gigabytes (GB, 10^9 bytes); expected bytes: leave the unit as it is",
    "gibibytes": "that is in gibibytes (GiB, 2^30 bytes); expected bytes: leave the unit as it is",
    "four bytes twice": "that counts 4 bytes four times over, once more than needed: each of the 4 tensors per "
                        "parameter (weight, gradient, two moments) takes 4 bytes, 16 in all",
    # times
    "seconds": "that is in seconds; expected milliseconds, the unit f and b are given in",
    "microseconds": "that is in microseconds; expected milliseconds, the unit f and b are given in",
    # bubble and speedup
    "busy share": "that is the share of time a stage works; the bubble is the share it waits, 1 minus it",
    "idle slots": "that counts idle slots; expected their share of the step: divide by the slots in all",
    "divided by M": "you divided by M, but the step lasts M+K-1 slots: M of work plus K-1 of fill (or drain)",
    "off by one slot": "off by one: the first micro-batch needs K slots to cross the pipe and each later one 1 "
                       "more, M+K-1 in all, K-1 of them idle",
    "forgets the bubble": "K forgets the bubble: each device is busy only M/(M+K-1) of the time",
    "one device's share": "that is one device's busy share; K devices work in parallel, so multiply by K",
    "bubble times K": "that multiplies the bubble, the idle share, by K; the speedup counts the busy share",
    # the bubble in milliseconds
    "fill only": "that counts the fill only: in the drain the stage waits K-1 backward slots as well",
    "per micro-batch": "that divides by M: the K-1 forward and K-1 backward slots of waiting do not shrink as M grows",
    "a share": "that is a share of K; expected how many micro-batches the stage holds, a count",
    "recompute added": "that adds a recompute (one more forward) to each backward slot: this pipe recomputes nothing",
    "drain only": "that counts the drain only: in the fill the stage waits K-1 forward slots as well",
    "share, not time": "that is the bubble's share of the step; expected milliseconds: the K-1 forward and K-1 "
                       "backward slots the stage waits",
    "own work": "that is the stage's own work, M forwards and M backwards; the bubble is the time it waits besides",
    "whole step": "that is the whole step, work and wait; the bubble is only the K-1 forward and K-1 backward slots "
                  "of waiting",
    # fill-drain order
    "schedule shape": "expected a list of K lists of task names such as \"F0\" and \"B3\", one list per stage",
    "flat list": "that is one flat list of tasks; expected one list per stage (K lists), each with that stage's tasks",
    "stage strings": "each stage's tasks came as one string; expected a list of task names per stage, such as "
                     "[\"F0\", \"F1\", \"B1\", \"B0\"]",
    "K and M swapped": "you made one list per micro-batch; expected one list per stage: K lists, each with 2M tasks",
    "task names": "name each task as a string: \"F\" or \"B\" and the micro-batch's number, as in \"F0\" and \"B3\"",
    "numbered from 0": "micro-batches are numbered from 0 to M-1, as range(M) gives them",
    "no recompute": "this schedule runs no recompute (R): only forwards and backwards",
    "every task once": "every stage runs each micro-batch's forward and backward exactly once",
    "fill before drain": "all forwards come before any backward (the pipe fills, then drains)",
    "forward order": "forwards run in micro-batch order, the order the mini-batch was split in",
    "drain order": "the drain starts with the last micro-batch: it is the last to finish its forward, on the "
                   "last stage, so its backward can start there at once; the others follow in reverse order",
    # a checkpointed stage
    "not a tensor": "expected a tensor shaped like block(x)",
    "different output": "the output differs from block(x): checkpointing changes what is kept, not what is computed",
    "detached input": "the block ran on a detached input (x.detach(), or a tensor without requires_grad), so no "
                      "gradient reaches x, and the stage before needs it; pass x itself to "
                      "torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)",
    "no_grad": "the block ran under torch.no_grad() (or inference_mode), which keeps nothing and forgets how to go "
               "back, so the output "
               "carries no graph: checkpointing keeps the input and recomputes the forward in the backward; use "
               "torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)",
    "detached output": "the output was detached (.detach() or .data), so it carries no graph and nothing can be "
                       "differentiated: return what checkpoint returns, as it is",
    "kept activations": "autograd kept the block's activations during the forward: checkpointing keeps only the "
                        "input; wrap the block: torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)",
    "kept, not recomputed": "the backward never ran the block again: the activations were kept somewhere (save_on_cpu, "
                    "your own saved-tensor hooks), not recomputed; wrap the block in "
                    "torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)",
    "different gradients": "the gradients differ from a plain backward: the recompute must run the same block on "
                           "the same input",
    "random state": "on a block with dropout the recompute drew other random numbers than the forward, so its "
                    "gradients are not the forward's: the recompute must replay the forward's random state "
                    "(checkpoint's preserve_rng_state=True, the default; by hand, torch.get_rng_state() before "
                    "the forward and torch.set_rng_state() before the recompute)",
    "frozen block": "the block's weights were frozen (requires_grad False), so they get no gradient: leave the block "
                    "as it is; checkpointing changes what is kept, not what is trained",
    # gradient accumulation
    "whole batch": "that is the whole batch at once: run the model on each of the M micro-batches "
                   "(x.chunk(micro)), one forward and backward each, so that .grad accumulates",
    "split for chunk": "x.split(micro) cuts chunks of `micro` samples each; x.chunk(micro) cuts `micro` chunks",
    "micro-batch sizes": "run the model once on each of the M micro-batches of x.chunk(micro), one forward and "
                         "backward each",
    "no backward": "some parameters have no gradient: call .backward() on each micro-batch's loss",
    "zeroed after": "the backward ran, but the gradients were zeroed afterwards: zero them once before the loop "
                    "(here they start at zero), never after it",
    "autograd.grad": "torch.autograd.grad returns the gradients but never writes them into .grad, so nothing "
                     "accumulated there: call .backward() on each micro-batch's loss",
    "graphs held": "autograd held several micro-batches' graphs at once, as much memory as the whole batch: call "
                   ".backward() on each micro-batch's (scaled) loss right after its forward, so each graph is freed "
                   "before the next micro-batch runs",
    "scaled logits": "you scaled the model's output before the loss; the loss is not linear in it, so that does not "
                     "scale the gradient by 1/M: scale the loss itself, loss_fn(model(xs), ys) / micro",
    "scaled inputs": "you scaled the micro-batch's inputs; the model is not linear in them, so that does not scale "
                     "the gradient by 1/M: feed each micro-batch as it is and scale its loss by 1/M",
    "uneven weights": "the micro-batches did not each enter once with weight 1/M: run the loop over every "
                      "micro-batch, each once, and scale each mean loss by 1/M",
    "unscaled": "each micro-batch's loss is a mean over its own samples, so the sum of M of them is M times the "
                "batch's mean: scale each by 1/M before .backward()",
    "scaled twice": "the gradients are M times too small: scale each micro-batch's mean loss by 1/M once, not 1/M²",
    "divided by its size": "you divided each micro-batch's loss by its number of samples, len(xs), but the loss is "
                           "already a mean over them: divide by M, the number of micro-batches",
    "zero_grad inside": "only the last micro-batch's gradient is left: zero_grad() inside the loop, or p.grad = ... "
                        "instead of adding to it, replaces what the earlier ones accumulated; let backward() add into "
                        ".grad, and zero it once, before the loop (here it starts at zero)",
    "scaled by zero": "every micro-batch's loss was multiplied by 0 (1 // micro is 0: integer division): use 1 / micro",
    "forward without grad": "the forwards ran under torch.no_grad() (or inference_mode), so no graph was kept and no "
                            "gradient can flow back: run each micro-batch's forward with gradients on",
    "last one scaled": "only the last micro-batch's loss was scaled by 1/M: scale every micro-batch's loss",
    "wrong scale": "every micro-batch's gradient entered with the same weight, but not 1/M: scale each mean loss by "
                   "1/M",
    "different accumulation": "the accumulated gradients are not any weighting of the micro-batches' own: run each "
                              "micro-batch's forward and backward once, on the model as given, each micro-batch "
                              "with its own targets, and leave .grad alone in the loop (clip once, after it)",
    # the best cut
    "cut shape": "expected a list of K whole numbers, the layers of each stage, in order",
    "cut edges": "those look like the positions of the cuts; expected how many layers each stage gets (K counts)",
    "stage costs": "those look like the stages' costs; expected how many layers each stage gets",
    "cut counts": "expected K counts of at least one layer each, summing to the number of layers",
    "greedy cut": "your cut closes a stage as soon as it reaches total/K, which can leave a costlier stage later on: "
                  "try every cut (or the engine's dynamic program) and keep the one whose costliest stage is cheapest",
    "variance cut": "your cut makes the stages' costs as even as possible (least variance or least spread), but the "
                    "pipeline runs at the pace of its costliest stage: minimize the maximum instead",
    "rounded costs": "your cut is a best one for the costs rounded to whole numbers: the costs are measured, keep "
                     "their fractions",
    "equal counts": "that gives the stages equal numbers of layers, whatever each layer costs: weigh the layers by "
                    "their costs, and keep the cut whose costliest stage is cheapest",
    "not the min-max": "the pipeline runs at the pace of its costliest stage: among all cuts, keep the one whose "
                       "costliest stage is cheapest",
    # micro-batches in flight
    "one less held": "that counts the fill's forwards only; the next forward runs before the first backward frees "
                     "one, so one more is held",
    "counted from the end": "that counts stages from the wrong end: stage 0, the first, holds the most (K), the last "
                            "one only 1",
    "same on every stage": "every stage gets the same count, but a stage further down the pipe holds fewer: the "
                           "first holds K, the last 1",
    # bytes per cut
    "four bytes again": "that multiplies by 4 bytes again: the bytes per sample already count each value's bytes",
    "forward only": "that counts the activations going forward; their gradients, of the same size, come back",
    "per sample": "that is per sample: the step carries all N samples across the cut",
    # a first pipe
    "not a pipe": "build it with GPipe(model, balance=..., chunks=...)",
    "not run": "my_pipe has not run a training step yet: call my_pipe.step(inputs, targets, loss_fn)",
    "forward only call": "my_pipe ran a forward only: call my_pipe.step(inputs, targets, loss_fn), which runs the "
                         "backward too",
    "batch too small": "torch.chunk cannot cut a batch into more micro-batches than it has samples: give the step a "
                       "batch of at least 6 samples (a multiple of 6 makes them equal)",
    "batch not divisible": "torch.chunk cuts N samples into pieces of ceil(N/6), which can make fewer than 6 (9 "
                           "samples make 5 pieces of 2): give the step a batch that is a multiple of 6",
    "forward after step": "my_pipe's last call was a forward (my_pipe(x)), whose trace replaced the step's: call "
                          "my_pipe.step(inputs, targets, loss_fn) again, then run this check",
    "step result": "my_pipe.step(...) returns the loss, not the pipe: keep my_pipe = GPipe(...) and call "
                   "my_pipe.step(...) on its own line",
    # a plan
    "plan shape": "choice must be a dict with the keys stages, micro_batches and checkpoint",
    "plan not in table": "that setting is not among the table's rows: pick one of them",
    "over budget": "the prediction says it does not fit: more stages or recompute shrink the most loaded stage",
    "more stages": "more stages split the work K ways and shrink the model's share per device",
    "more micro-batches": "more micro-batches shrink the bubble",
    "fewer micro-batches": "fewer micro-batches do here (the table's time model counts a longer fill at this K)",
    "drop recompute": "a setting without recompute also fits, and skips recompute's extra forward",
    "add recompute": "recompute lets a faster setting fit",
    # a layout
    "layout shape": "MY_LAYOUT must be a pair of whole numbers (D, K)",
    "layout swapped": "you swapped them: MY_LAYOUT is (D, K), replicas first, then stages",
    # a written schedule (notebook 12)
    "schedule text": "expected the schedule as text, one line of tasks per stage, as in \"stage 0: F0 F1 B0 ...\"",
    "engine refuses": "that is the engine's own check, which names the first problem: fix it, run the cell again",
    "stage count": "expected one line of tasks per stage: K lines",
    "split in 1F1B": "that splits backwards into B and W; 1F1B runs each backward whole (W comes in the last "
                     "exercise)",
    "holds too many": "it holds more micro-batches on a stage than 1F1B (at most K): start a stage's backwards once "
                      "its fill of K-1-k forwards is done, then alternate one forward and one backward",
    "1F1B backward order": "1F1B runs each stage's backwards in micro-batch order, B0 first, each as soon as its "
                           "gradient arrives; a later micro-batch's backward makes the earlier ones wait",
    "slower than 1F1B": "it holds few enough but takes longer than 1F1B: somewhere a stage waits where 1F1B runs a "
                        "forward; fill stage k with K-1-k forwards, then alternate",
    "still deadlocks": "it still deadlocks: the engine names the cycle of waits; move one task of that cycle so the "
                       "task it waits for can run first",
    "not a reorder": "a fix reorders the given tasks: keep every stage's tasks, change only their order",
    "no W": "no backward is split off: write each backward as B (its input's gradient, sent upstream at once) and W "
            "(the weights' gradient, which can wait)",
    "holds more than 1F1B": "it holds more micro-batches on a stage than 1F1B (K): a micro-batch is held until its W "
                            "has run, so run the W's sooner",
    "bubble not smaller": "its unit-cost bubble is not below 1F1B's: put W's where 1F1B's stages wait, in the fill "
                          "and the drain",
    # any check
    "keywords": "pass your answer as the check's argument itself, as the notebook's check cell does",
}


class Feedback(Exception):
    """What is wrong with an answer, in words a learner can act on."""


class NotAttempted(Exception):
    """The answer is still the `...` the notebook was committed with."""


def _exercise(judge: Callable[..., str]) -> Callable[..., str]:
    """A check from a judge that returns "✓ ..." or raises Feedback / NotAttempted: the check
    returns the line to print instead of raising, and anything else a judge meets in a strange
    answer becomes a line too, saying what was expected."""
    @functools.wraps(judge)
    def check(*answer, **named) -> str:
        if named:
            return f"✗ got {', '.join(f'{name}=...' for name in named)}: {SAYS['keywords']}"
        try:
            return judge(*answer)
        except NotAttempted as why:
            return f"… not attempted yet: {why}"
        except Feedback as why:
            return f"✗ {why}"
        except Exception as error:  # an answer no rule foresaw: say what the check expects
            expected = (judge.__doc__ or "").strip().splitlines()[0]
            return f"✗ the check could not use this answer ({type(error).__name__}: {error}); expected {expected}"
    return check


def yours_if_right(check: Callable[[Any], str], answer: Any, reference: Any) -> tuple[Any, str]:
    """(`answer`, "your") if it passes `check`, else (the lab's `reference`, "the lab's"): the
    cells after an exercise run on a right answer either way (the check's cell said why)."""
    return (answer, "your") if check(answer).startswith("✓") else (reference, "the lab's")


def _attempted(answer, name: str):
    """`answer`, or NotAttempted while it is still `...` (or None)."""
    if answer is None or answer is Ellipsis:
        raise NotAttempted(f"replace the `...` in {name} above with your answer, run that cell, then this one")
    return answer


def _called(fn: Callable, *args, returns: bool = True, within: Callable = contextlib.nullcontext):
    """fn(*args), the learner's function (bounded in time, inside `within()`: `_bounded`): an
    exception in it becomes feedback that names it; with `returns`, a result of None or `...` means
    the answer is not written yet."""
    _attempted(fn, "the cell")
    if not callable(fn) or isinstance(fn, type):
        raise Feedback(f"expected a function, got {type(fn).__name__}: {SAYS['not a function']}")
    printed = _Printed(sys.stdout)
    try:
        with contextlib.redirect_stdout(printed):
            result = _bounded(fn, args, within)
    except KeyboardInterrupt:
        raise
    except _TookTooLong:
        raise Feedback(f"{_call_text(fn, args)} did not return within {CALL_SECONDS:g} s of computing (or "
                       f"{WAIT_SECONDS:g} s in all): {SAYS['too long']}") from None
    except BaseException as error:  # SystemExit, GeneratorExit...: whatever the learner's code raised
        raise Feedback(f"{_call_text(fn, args)} raised {type(error).__name__}: {error}. {SAYS['raised']}") from None
    if returns and result is None and printed.wrote:
        raise Feedback(f"{_call_text(fn, args)} returned None: {SAYS['printed']}")
    if returns and (result is None or result is Ellipsis):
        raise NotAttempted(f"{_call_text(fn, args)} returned {result!r}: replace the `...` in it with your answer "
                           f"(and return it), run that cell, then this one")
    return result


class _Printed(io.TextIOBase):
    """Standard output while a learner's function runs: passed on as it is, and noted, so that a
    function that prints its answer instead of returning it is told so."""

    def __init__(self, out):
        self.out, self.wrote = out, False

    def write(self, text: str) -> int:
        self.wrote = self.wrote or bool(text.strip())
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


CALL_SECONDS = 5.0    # CPU seconds a learner's function may run before it is stopped and told so
WAIT_SECONDS = 20.0   # and seconds it may take in all (a loop that sleeps, a lock that never comes)


class _TookTooLong(BaseException):
    """Raised inside a learner's function that ran past its bound (a BaseException, so that an
    `except Exception` in the learner's loop does not swallow it)."""


def _bounded(fn: Callable, args: tuple, within: Callable = contextlib.nullcontext):
    """fn(*args) in a thread of its own (inside `within()`, for what is per thread, such as saved-
    tensor hooks), given up once it has used CALL_SECONDS of its CPU time (so a busy host does not
    stop a slow right answer) or WAIT_SECONDS in all: _TookTooLong is raised in it, which stops a loop
    between two bytecodes, and a call blocked for good (a lock, a queue) is left behind, asleep."""
    outcome: list = []
    clock: list = []   # the worker's CPU clock, read by the worker itself while it lives

    def run() -> None:
        clock.append(time.pthread_getcpuclockid(threading.get_ident()))
        try:
            with within():
                outcome.append((True, fn(*args)))
        except BaseException as error:  # whatever the learner's code raised, _TookTooLong included
            outcome.append((False, error))
    worker = threading.Thread(target=run, name="gpipe-learner-answer", daemon=True)
    worker.start()
    start = time.monotonic()

    def cpu_used() -> float:
        try:
            return time.clock_gettime(clock[0]) if clock else 0.0
        except OSError:  # it ended meanwhile
            return 0.0
    try:
        while worker.is_alive() and cpu_used() < CALL_SECONDS and time.monotonic() - start < WAIT_SECONDS:
            worker.join(0.02)
    except BaseException:  # Ctrl-C (the kernel's interrupt) in the check: stop the answer too
        _stop(worker, KeyboardInterrupt)
        raise
    if worker.is_alive():
        _stop(worker, _TookTooLong)
        if not outcome:
            raise _TookTooLong()
    finished, value = outcome[0]
    if not finished:
        raise value
    return value


def _raise_in(thread: threading.Thread, error: Optional[type]) -> None:
    """Raise `error` in `thread` at its next bytecode (None: withdraw what is pending there)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                               None if error is None else ctypes.py_object(error))


class _Absorbed(BaseException):
    """Raised in a helper thread only to take the interpreter's pending-exception signal (_stop)."""


def _stop(worker: threading.Thread, error: type) -> None:
    """Raise `error` in `worker`; if it is blocked for good (no bytecode runs to receive it), withdraw
    it. An exception left pending on a blocked thread keeps the interpreter's signal up, and on
    CPython 3.11 any thread that runs under a profile or trace function (a debugger, coverage,
    lab.host_time's counts) then loops for ever on its next call. Withdrawing it leaves the signal
    up too; only a thread that receives one of its own takes it down, so a helper does."""
    _raise_in(worker, error)
    worker.join(1.0)
    if not worker.is_alive():
        return
    _raise_in(worker, None)

    inside = threading.Event()

    def absorb() -> None:
        try:
            inside.set()
            while True:
                time.sleep(0.001)
        except _Absorbed:
            pass
    helper = threading.Thread(target=absorb, name="gpipe-signal-taker", daemon=True)
    helper.start()
    inside.wait()
    _raise_in(helper, _Absorbed)
    helper.join(5.0)


def _call_text(fn: Callable, args: tuple) -> str:
    name = getattr(fn, "__name__", type(fn).__name__)
    return f"{name}({', '.join(repr(a) if isinstance(a, (int, float, list)) else type(a).__name__ for a in args)})"


def _number(value) -> Optional[float]:
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


def _whole(value) -> Optional[int]:
    """A whole number (an int, an integral float, numpy's or torch's), or None."""
    number = _number(value)
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
            result = _called(fn, *case)
            value = _number(result)
            if value is None:
                raise Feedback(f"{self.where(case)}: {_call_text(fn, case)} returned {result!r:.60} "
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
        return _exercise(judge)


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
    hint="the fill holds the last stage back K-1 forward slots, the drain the first stage K-1 backward slots",
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


def _listed(value, what: str) -> list:
    """A list from any iterable but a string (a generator, a tuple, an array); Feedback else."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise Feedback(f"got {type(value).__name__} {value!r:.60}: {what}")
    return list(value)


@_exercise
def check_fill_drain(fn: Callable[[int, int], list]) -> str:
    """fn(K, M): each stage's task list in GPipe's order, as strings like "F0" and "B3"."""
    for stages, micro in ((1, 1), (2, 3), (3, 4), (4, 2)):
        where = f"K={stages}, M={micro}"
        got = _listed(_called(fn, stages, micro), SAYS["schedule shape"])
        want = [[str(task) for task in tasks] for tasks in gpipe(stages, micro, "never")]
        if got and all(isinstance(t, str) for t in got):
            spaced = len(got) == stages and any(len(t.split()) > 1 or len(t.split(",")) > 1 for t in got)
            raise Feedback(f"{where}: {SAYS['stage strings' if spaced else 'flat list']}")
        got = [[str(t) for t in _listed(tasks, SAYS["schedule shape"])] for tasks in got]
        if len(got) != stages:
            swapped = len(got) == micro and all(len(tasks) == 2 * stages for tasks in got)
            raise Feedback(f"{where}: got {len(got)} lists: " + (SAYS["K and M swapped"] if swapped else
                                                                 f"expected one per stage ({stages})"))
        for k, (mine, right) in enumerate(zip(got, want)):
            _judge_stage_tasks(f"{where}, stage {k}", mine, right, micro)
    return "✓ the fill-drain order, as engine.schedule.gpipe builds it"


def _judge_stage_tasks(where: str, mine: list[str], right: list[str], micro: int) -> None:
    """Feedback on one stage's task names against GPipe's order."""
    names = [re.fullmatch(r"([FBRW])(\d+)", t) for t in mine]
    if not all(names):
        raise Feedback(f"{where}: got {mine[:6]}: {SAYS['task names']}")
    if any(n.group(1) == "R" for n in names):
        raise Feedback(f"{where}: got {mine}: {SAYS['no recompute']}")
    if sorted(mine) != sorted(right):
        numbers_ = sorted({int(n.group(2)) for n in names})
        family = "numbered from 0" if numbers_ == list(range(1, micro + 1)) else "every task once"
        raise Feedback(f"{where}: expected the tasks {sorted(right)}, got {sorted(mine)}: {SAYS[family]}")
    if mine != right:
        i = next(i for i, (a, b) in enumerate(zip(mine, right)) if a != b)
        family = ("fill before drain" if right[i][0] != mine[i][0] else
                  "forward order" if right[i][0] == "F" else "drain order")
        raise Feedback(f"{where}, task {i}: got {mine[i]}, expected {right[i]}: {SAYS[family]}")


@_exercise
def check_checkpointed_stage(fn: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> str:
    """fn(block, x): the block's output, keeping only x for the backward (torch.utils.checkpoint)."""
    torch.manual_seed(0)
    block = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(32, 32), nn.Tanh())])
    x = torch.randn(64, 32, requires_grad=True)
    _warm_checkpoint()
    plain_out = block(x)
    plain_out.sum().backward()
    plain = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
    block.zero_grad()
    x.grad = None
    calls: list[tuple[bool, bool]] = []   # (grad enabled, input requires grad) at each call of the block
    hook = block.register_forward_pre_hook(lambda _, inputs: calls.append(
        (torch.is_grad_enabled(), bool(inputs and getattr(inputs[0], "requires_grad", False)))))
    entering: list[torch.Tensor] = []      # what the first layer was given: x, or a copy of it (x.clone())
    first_layer = block[0].register_forward_pre_hook(lambda _, inputs: entering.append(inputs[0]))
    ledger = ActivationLedger(list(block.parameters()) + [x])
    try:
        out = _called(fn, block, x, within=ledger.saving)
    finally:
        hook.remove()
        first_layer.remove()
    if not all(p.requires_grad for p in block.parameters()):
        raise Feedback(SAYS["frozen block"])
    if not isinstance(out, torch.Tensor) or out.shape != plain_out.shape:
        got = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise Feedback(f"got {got}: {SAYS['not a tensor']}, {tuple(plain_out.shape)}")
    if not torch.allclose(out.detach(), plain_out.detach(), atol=1e-6):
        raise Feedback(SAYS["different output"])
    if calls and not calls[0][1]:
        raise Feedback(SAYS["detached input"])
    if not out.requires_grad or out.grad_fn is None:   # no graph, or a detached output marked again
        raise Feedback(SAYS["detached output" if calls and calls[0][0] else "no_grad"])
    # the block's input (x, or a copy of it) is what checkpointing keeps; anything else, even for a while, is not
    copy = entering[0] if entering and entering[0] is not x else None
    kept = ledger.peak - (copy.untyped_storage().nbytes() if copy is not None else 0)
    if kept > 0:
        raise Feedback(f"{kept:,} bytes kept: {SAYS['kept activations']}")
    again: list[int] = []   # the first layer's calls in the backward: a recompute
    recompute = block[0].register_forward_pre_hook(lambda *_: again.append(1))
    try:
        out.sum().backward()
    finally:
        recompute.remove()
    if not again:   # kept rather than recomputed, where the check's own hooks could not see it
        raise Feedback(SAYS["kept, not recomputed"])
    got = [p.grad for p in block.parameters()] + [x.grad]
    if x.grad is None and all(g is not None and torch.allclose(g, w, atol=1e-6) for g, w in zip(got[:-1], plain)):
        raise Feedback(SAYS["detached input"])  # e.g. x.detach().requires_grad_(): a new leaf, not x
    if any(g is None or not torch.allclose(g, w, atol=1e-6) for g, w in zip(got, plain)):
        raise Feedback(SAYS["different gradients"])
    if not _replays_random_numbers(fn):
        raise Feedback(SAYS["random state"])
    engine_grads, engine_peak = _engine_recompute(block, x.detach())
    if not all(torch.allclose(g, w, atol=1e-6) for g, w in zip(got, engine_grads)):
        raise Feedback("the gradients differ from the engine's checkpoint='always' on the same block")
    return (f"✓ nothing but the input kept during your forward, and the same gradients as a plain backward and as "
            f"the engine's recompute (checkpoint='always', one stage, 4 micro-batches: its activation peak "
            f"{engine_peak:,} bytes, one micro-batch's layers plus the inputs it keeps)")


def _replays_random_numbers(fn: Callable) -> bool:
    """Whether the learner's stage, on a block with dropout, gets a plain backward's gradients: its
    recompute must draw the forward's random numbers again."""
    torch.manual_seed(1)
    block, x = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 16)), torch.randn(8, 16)
    torch.manual_seed(2)
    block(x).sum().backward()
    plain = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    torch.manual_seed(2)
    _called(fn, block, x.requires_grad_()).sum().backward()
    return all(torch.allclose(p.grad, g, atol=1e-6) for p, g in zip(block.parameters(), plain))


@functools.lru_cache(maxsize=1)
def _warm_checkpoint() -> None:
    """Run torch.utils.checkpoint once before timing a learner's stage: its first call imports
    what it needs (about 2 s of CPU here), which is not the learner's time."""
    from torch.utils.checkpoint import checkpoint
    layer = nn.Linear(2, 2)
    for reentrant in (False, True):
        checkpoint(layer, torch.ones(1, 2, requires_grad=True), use_reentrant=reentrant).sum().backward()


def _engine_recompute(block: nn.Module, x: torch.Tensor) -> tuple[list[torch.Tensor], int]:
    """Weight gradients of sum(block(x)) from the engine with recompute, and its activation peak."""
    block.zero_grad()
    pipe = GPipe(block, 1, chunks=4, checkpoint="always")
    try:
        pipe.step(x, torch.zeros(len(x)), lambda out, _: out.sum() * len(x) / len(out))
        return [p.grad.clone() for p in block.parameters()], pipe.trace.memory[0].activation_peak_bytes
    finally:
        pipe.close()


SAMPLES, MICRO = 24, 4   # the accumulation exercise's batch and micro-batches,
MICRO_SIZE = SAMPLES // MICRO   # 6 samples each


class _WatchedLoss(nn.CrossEntropyLoss):
    """The loss function handed to the learner: cross-entropy that notes the logits it is given,
    to tell a scaled output from the model's own."""

    def __init__(self):
        super().__init__()
        self.logits: list[torch.Tensor] = []

    def forward(self, logits, targets):
        self.logits.append(logits)
        return super().forward(logits, targets)


_WatchedLoss.__name__ = _WatchedLoss.__qualname__ = "CrossEntropyLoss"   # how feedback names the learner's loss_fn


@_exercise
def check_accumulation(fn: Callable) -> str:
    """fn(model, x, y, loss_fn, micro): gradients of the mean loss over the batch, accumulated
    micro-batch by micro-batch into .grad."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(SAMPLES, 8), torch.randint(0, 3, (SAMPLES,))
    loss_fn = _WatchedLoss()
    loss_fn(model(x), y).backward()
    whole = torch.cat([p.grad.flatten() for p in model.parameters()])
    each = []   # each micro-batch's own gradient of its mean loss, one column each
    for xs, ys in zip(x.chunk(MICRO), y.chunk(MICRO)):
        model.zero_grad()
        loss_fn(model(xs), ys).backward()
        each.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    model.zero_grad(set_to_none=True)
    loss_fn.logits.clear()
    inputs, outputs, events = [], [], []   # events: "F" per forward, "B" per backward through the model
    accumulated = []                       # one entry each time a backward wrote into the first weight's .grad
    first = next(model.parameters())

    def ran(_, args, out) -> None:   # a forward hook returning None leaves the output as it is
        outputs.append(out)
        events.append("F" if torch.is_grad_enabled() else "F without grad")
    hooks = [model.register_forward_pre_hook(lambda _, args: inputs.append(args[0]) and None),
             model.register_forward_hook(ran),
             first.register_hook(lambda grad: events.append("B")),
             first.register_post_accumulate_grad_hook(lambda p: accumulated.append(bool(p.grad.any())))]
    try:
        _called(fn, model, x, y, loss_fn, MICRO, returns=False)  # it accumulates into .grad
    finally:
        for hook in hooks:
            hook.remove()
    sizes = [len(t) for t in inputs]
    if not sizes and all(p.grad is None for p in model.parameters()):
        raise NotAttempted(f"{getattr(fn, '__name__', 'your function')} ran no forward: replace the `...` in it "
                           f"with your answer, run that cell, then this one")
    if sizes != [MICRO_SIZE] * MICRO:
        family = ("whole batch" if sizes == [SAMPLES] else "split for chunk" if sizes == [MICRO] * MICRO_SIZE else
                  "micro-batch sizes")
        raise Feedback(f"the model ran on batches of {sizes} samples: {SAYS[family]}")
    held = _most_held(events)
    backwards = events.count("B")
    if "F without grad" in events and all(p.grad is None for p in model.parameters()):
        raise Feedback(SAYS["forward without grad"])
    if backwards and not accumulated and all(p.grad is None for p in model.parameters()):
        raise Feedback(SAYS["autograd.grad"])
    if accumulated and all(p.grad is None or not p.grad.any() for p in model.parameters()):
        raise Feedback(SAYS["zeroed after" if any(accumulated) else "scaled by zero"])
    if any(p.grad is None for p in model.parameters()):
        raise Feedback(SAYS["no backward"])
    got = torch.cat([p.grad.flatten() for p in model.parameters()]).double()
    holding = (f"the model ran {held} forwards before their backward: {SAYS['graphs held']}" if held > 1 else "")
    if torch.allclose(got, whole.double(), atol=1e-6):
        if holding:
            raise Feedback(f"the gradients are right, but {holding}")
        return "✓ the sum over micro-batches of (1/M) x mean loss gives the whole batch's gradients"
    scaled = ("scaled inputs" if _scaled(inputs, x.chunk(MICRO)) else
              "scaled logits" if _scaled(loss_fn.logits, outputs) else None)
    mistake = SAYS[scaled] if scaled else _accumulation_mistake(got, torch.stack(each, dim=1).double())
    raise Feedback(f"{mistake}; and besides, {holding}" if holding else mistake)


def _most_held(events: list[str]) -> int:
    """The most forwards run before their backward, from the "F" and "B" events of one answer."""
    held = most = 0
    for event in events:
        held = held + 1 if event.startswith("F") else max(held - 1, 0)
        most = max(most, held)
    return most


def _scaled(given: list[torch.Tensor], own: Sequence[torch.Tensor]) -> bool:
    """Whether the tensors `given` are the tensors `own` times a number other than 1 (a learner's
    1/M applied to a micro-batch's inputs, or to the model's output before the loss)."""
    if not given or len(given) != len(own):
        return False
    for a, b in zip(given, own):
        a, b = a.detach().double(), b.detach().double()
        if a.shape != b.shape or not b.any():
            return False
        factor = (a * b).sum() / (b * b).sum()
        if not torch.allclose(a, factor * b, atol=1e-6) or math.isclose(factor.item(), 1.0, abs_tol=1e-6):
            return False
    return True


def _accumulation_mistake(got: torch.Tensor, each: torch.Tensor) -> str:
    """What weights of the micro-batches' own gradients (columns of `each`) add up to `got`, and
    which known mistake those weights are."""
    weights = torch.linalg.lstsq(each, got.unsqueeze(1)).solution.squeeze(1)
    if (each @ weights - got).norm() > 1e-5 * max(1.0, got.norm().item()):
        return SAYS["different accumulation"]
    w = [round(v, 4) + 0.0 for v in weights.tolist()]   # + 0.0: no -0.0 shown
    shown = f"each micro-batch's gradient entered with weights {w}, where 1/M = {1 / MICRO:g} each is right"

    def weighted(*pattern: float) -> bool:
        return all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(w, pattern))
    last = [0.0] * (MICRO - 1)
    families = [("unscaled", [1.0] * MICRO), ("scaled twice", [MICRO ** -2] * MICRO),
                ("divided by its size", [1 / MICRO_SIZE] * MICRO), ("zero_grad inside", last + [1 / MICRO]),
                ("zero_grad inside", last + [1.0]), ("last one scaled", [1.0] * (MICRO - 1) + [1 / MICRO])]
    family = next((name for name, pattern in families if weighted(*pattern)), None)
    if family is None:
        family = "wrong scale" if max(w) - min(w) < 1e-4 else "uneven weights"
    if family == "wrong scale":   # one weight for all: say what it is in the exercise's own numbers
        named = {MICRO: "micro (M), multiplied instead of divided", SAMPLES: "the batch's size",
                 1 / SAMPLES: "1 / the batch's size", MICRO_SIZE: "the micro-batch's size",
                 MICRO_SIZE / MICRO: "len(xs) / micro",
                 1 / (MICRO - 1): "1 / (M - 1)", 1 / (MICRO + 1): "1 / (M + 1)"}
        said = next((words for value, words in named.items() if math.isclose(w[0], value, rel_tol=1e-3)), None)
        shown += f", that is {said}" if said else ""
    return f"{shown}: {SAYS[family]}"


# --- the best cut ---------------------------------------------------------------------------------

# Short cost lists on which a common wrong cut loses to the min-max cut: the cut of least variance
# on the first three, the total/K greedy cut on the last three (found by a search over random
# lists; tests/test_exercises.py checks that each still separates them).
SEPARATING_CUTS = (([6, 5, 9, 3], 3), ([3, 5, 7, 2, 5, 2], 4), ([5, 2, 7, 3, 9, 6], 3),
                   ([5, 4, 2, 6], 3), ([5, 8, 9, 7, 1], 3), ([1, 3, 7, 7, 9], 2))


def _stage_costs(costs: Sequence[float], counts: Sequence[int]) -> list[float]:
    edges = [sum(counts[:k]) for k in range(len(counts) + 1)]
    return [sum(costs[a:b]) for a, b in zip(edges, edges[1:])]


def _every_cut(layers: int, stages: int) -> Iterable[list[int]]:
    for inner in itertools.combinations(range(1, layers), stages - 1):
        edges = [0, *inner, layers]
        yield [b - a for a, b in zip(edges, edges[1:])]


def greedy_cut(costs: Sequence[float], stages: int) -> list[int]:
    """A common wrong answer: close each stage as soon as its cost reaches total/K (keeping a
    layer for every stage still to come)."""
    target, counts, running, cost = sum(costs) / stages, [], 0, 0.0
    for i, layer in enumerate(costs):
        running, cost = running + 1, cost + layer
        layers_left, stages_left = len(costs) - i - 1, stages - len(counts) - 1
        if stages_left and (layers_left == stages_left or (cost >= target and layers_left > stages_left)):
            counts.append(running)
            running, cost = 0, 0.0
    return counts + [running]


def greedy_cuts(costs: Sequence[float], stages: int) -> list[list[int]]:
    """The greedy walks a learner writes: close a stage once it reaches total/K, or just before it
    would pass it; from the first layer, or from the last."""
    target = sum(costs) / stages

    def before(costs: Sequence[float]) -> list[int]:
        counts, running, cost = [], 0, 0.0
        for i, layer in enumerate(costs):
            layers_left, stages_left = len(costs) - i, stages - len(counts) - 1
            if running and stages_left and (layers_left == stages_left or cost + layer > target):
                counts.append(running)
                running, cost = 0, 0.0
            running, cost = running + 1, cost + layer
        return counts + [running]
    return [greedy_cut(costs, stages), before(costs), greedy_cut(costs[::-1], stages)[::-1], before(costs[::-1])[::-1]]


def variance_cut(costs: Sequence[float], stages: int) -> list[int]:
    """Another wrong answer: the cut whose stage costs vary least around their mean (the same sum
    for every cut, so least variance is the least sum of squares)."""
    return min(_every_cut(len(costs), stages), key=lambda counts: sum(c * c for c in _stage_costs(costs, counts)))


@functools.lru_cache(maxsize=1)
def cut_battery() -> tuple[tuple[tuple[float, ...], int, float], ...]:
    """(costs, K, the optimal costliest stage) for the lists every cut is judged on: the separating
    lists above, then 400 seeded random lists (4 to 12 layers, K from 2 to 6, whole costs and
    measured-looking ones), shortest first so that the list a wrong cut is shown is small."""
    rng = random.Random(35)
    lists = []
    for i in range(400):
        layers = rng.randint(4, 12)
        stages = rng.randint(2, min(6, layers))
        costs = ([rng.randint(1, 20) for _ in range(layers)] if i % 4 else
                 [round(rng.uniform(0.05, 3.0), 2) for _ in range(layers)])
        lists.append((tuple(costs), stages))
    lists.sort(key=lambda item: (len(item[0]), item[1]))
    return tuple((tuple(costs), stages, max(_stage_costs(costs, solve(list(costs), stages))))
                 for costs, stages in [*((tuple(c), k) for c, k in SEPARATING_CUTS), *lists])


def _cut_counts(value, costs: Sequence[float], stages: int) -> list[int]:
    """The learner's cut as K whole counts; Feedback on anything else, naming what it looks like."""
    where = f"costs {list(costs)}, K={stages}"
    if _number(value) is not None:
        raise Feedback(f"{where}: got the number {value!r}: {SAYS['cut shape']}")
    got = _listed(value, SAYS["cut shape"])
    numbers_ = [_number(v) for v in got]
    if None in numbers_:
        raise Feedback(f"{where}: got {got!r:.80}: {SAYS['cut shape']}")
    counts, layers = [_whole(v) for v in got], len(costs)
    if len(got) == stages and math.isclose(sum(numbers_), sum(costs), rel_tol=1e-6) and sum(numbers_) != layers:
        raise Feedback(f"{where}: got {numbers_}: {SAYS['stage costs']}")
    if None in counts:
        raise Feedback(f"{where}: got {got!r:.80}: {SAYS['cut shape']}")
    increasing = all(a < b for a, b in zip(counts, counts[1:]))
    if increasing and ((len(counts) == stages + 1 and counts[0] == 0 and counts[-1] == layers) or
                       (len(counts) in (stages - 1, stages) and counts[-1] <= layers and sum(counts) != layers)):
        raise Feedback(f"{where}: got {counts}: {SAYS['cut edges']}")
    if len(counts) != stages or sum(counts) != layers or min(counts) < 1:
        raise Feedback(f"{where}: got {counts}: {SAYS['cut counts']} ({stages} counts summing to {layers})")
    return counts


@_exercise
def check_best_cut(fn: Callable[[list, int], list]) -> str:
    """fn(costs, K): layers per stage, consecutive, making the costliest stage as cheap as possible."""
    battery = cut_battery()
    for costs, stages, best in battery:
        got = _cut_counts(_called(fn, list(costs), stages), costs, stages)
        worst = max(_stage_costs(costs, got))
        if worst > best * (1 + 1e-9) + 1e-12:
            raise Feedback(f"costs {list(costs)}, K={stages}: your cut {got} has stages costing "
                           f"{[round(c, 4) for c in _stage_costs(costs, got)]}, the costliest {worst:g}; "
                           f"{solve(list(costs), stages)} gets the costliest down to {best:g}: {SAYS[_cut_family(fn)]}")
    return (f"✓ on {len(battery)} cost lists (4 to 12 layers, K from 2 to 6) your cut's costliest stage is the "
            f"cheapest possible, as balance_by_time's solver finds it")


def _cut_family(fn: Callable) -> str:
    """The family of wrong cuts the learner's cut behaves as on every list of SEPARATING_CUTS and
    the battery's first lists (a family is named only when the cut behaves as that family does, not
    on one list), else "not the min-max"."""
    lists = [*SEPARATING_CUTS, *((list(c), k) for c, k, _ in cut_battery()[:20])]
    try:
        cuts = [(_cut_counts(_called(fn, list(c), k), c, k), c, k) for c, k in lists]
    except Feedback:
        return "not the min-max"
    families = (("variance cut", _as(variance_cut)), ("greedy cut", lambda cut, c, k: cut in greedy_cuts(c, k)),
                ("equal counts", _even), ("rounded costs", _rounded))
    return next((name for name, alike in families if all(alike(*cut) for cut in cuts)), "not the min-max")


def _as(rule: Callable[[Sequence[float], int], list[int]]) -> Callable[[list[int], Sequence[float], int], bool]:
    """The family of cuts that `rule` makes."""
    return lambda cut, costs, stages: cut == rule(costs, stages)


def _rounded(cut: list[int], costs: Sequence[float], stages: int) -> bool:
    """The family of cuts made for the costs rounded to whole numbers."""
    whole = [round(c) for c in costs]
    return max(_stage_costs(whole, cut)) <= max(_stage_costs(whole, solve(whole, stages)))


def _even(cut: list[int], costs: Sequence[float], stages: int) -> bool:
    """The family of cuts by layer count alone: stages of as many layers as can be, the remainder
    spread over some of them or left to the first or the last."""
    base = len(costs) // stages
    rest = len(costs) - (stages - 1) * base
    return max(cut) - min(cut) <= 1 or cut in ([rest] + [base] * (stages - 1), [base] * (stages - 1) + [rest])


# --- pipes, plans and layouts ---------------------------------------------------------------------

@_exercise
def check_first_pipe(pipe) -> str:
    """A pipe of 3 stages and 6 micro-batches over the learner's own model, after one step."""
    _attempted(pipe, "my_pipe = ...")
    if isinstance(pipe, torch.Tensor):
        raise Feedback(f"my_pipe is a Tensor: {SAYS['step result']}")
    if not isinstance(pipe, GPipe):
        raise Feedback(f"my_pipe is {type(pipe).__name__}: {SAYS['not a pipe']}")
    if pipe.stages != 3:
        raise Feedback(f"my_pipe has {pipe.stages} stages: balance=3 cuts the model into 3 (or give 3 layer counts)")
    if pipe.micro_batches != 6:
        raise Feedback(f"my_pipe cuts each mini-batch into chunks={pipe.micro_batches}: ask for 6 micro-batches")
    if not pipe.trace.events:
        raise Feedback(SAYS["not run"])
    if not any(e.op == "B" for e in pipe.trace.events):
        raise Feedback(SAYS["forward after step" if pipe.steps_done else "forward only call"])
    ran = len({e.micro for e in pipe.trace.events})
    if ran < 6:
        batch = pipe.trace.batch_size
        raise Feedback(f"its last step ran {ran} micro-batches, not 6, on a batch of {batch}: "
                       f"{SAYS['batch too small' if batch < 6 else 'batch not divisible']}")
    return (f"✓ {len(pipe.trace.events)} tasks ran on 3 stages over {ran} micro-batches; bubble "
            f"{pipe.trace.bubble:.0%} measured (theory {theory.bubble(3, ran):.0%} for equal stages)")


PLAN_KEYS = ("stages", "micro_batches", "checkpoint")


def _plan_setting(choice) -> tuple:
    """(K, M, checkpoint) from the learner's choice; Feedback for anything else."""
    if not isinstance(choice, Mapping) or set(choice) != set(PLAN_KEYS):
        raise Feedback(f"got {choice!r:.80}: {SAYS['plan shape']}")
    stages, micro = _whole(choice["stages"]), _whole(choice["micro_batches"])
    if stages is None or micro is None or not isinstance(choice["checkpoint"], str):
        raise Feedback(f"got {dict(choice)!r:.100}: stages and micro_batches are whole numbers, checkpoint a string "
                       f"such as \"never\" or \"always\"")
    return stages, micro, choice["checkpoint"]


@_exercise
def check_plan(choice: dict, rows: list[dict]) -> str:
    """choice = dict(stages=K, micro_batches=M, checkpoint=...): a setting the prediction says
    fits, and among those the fastest in the unit-cost model (within 5%)."""
    _attempted(choice, "choice = ...")
    if isinstance(choice, Mapping) and any(v is Ellipsis for v in choice.values()):
        raise NotAttempted("replace each `...` in choice = dict(...) above with your setting, run that cell, then this one")
    setting = _plan_setting(choice)
    row = next((r for r in rows if (r["K"], r["M"], r["checkpoint"]) == setting), None)
    if row is None:
        raise Feedback(f"{dict(zip(PLAN_KEYS, setting))}: {SAYS['plan not in table']}")
    time = "time vs one device (theory)"
    if not row["fits (predicted)"]:
        raise Feedback(f"{dict(zip(PLAN_KEYS, setting))} is predicted at "
                       f"{row['predicted bytes (most loaded stage)']:,} bytes on its most loaded stage: {SAYS['over budget']}")
    best = min((r for r in rows if r["fits (predicted)"]), key=lambda r: r[time])
    if row[time] > 1.05 * best[time]:
        reasons = [SAYS["more stages"]] if best["K"] > row["K"] else []
        if best["M"] != row["M"]:
            reasons.append(SAYS["more micro-batches" if best["M"] > row["M"] else "fewer micro-batches"])
        if best["checkpoint"] != row["checkpoint"]:
            reasons.append(SAYS["drop recompute" if best["checkpoint"] == "never" else "add recompute"])
        raise Feedback(f"{dict(zip(PLAN_KEYS, setting))} fits, but is predicted at {row[time]} of one device's time, "
                       f"where K={best['K']}, M={best['M']}, checkpoint '{best['checkpoint']}' also fits and gets "
                       f"{best[time]}: " + "; ".join(reasons))
    return f"✓ fits the budget by prediction and is among the fastest settings that do ({row[time]})"


def best_plan(rows: list[dict]) -> dict:
    """The lab's answer to check_plan: among the settings predicted to fit, the fastest in the
    unit-cost model."""
    best = min((r for r in rows if r["fits (predicted)"]), key=lambda r: r["time vs one device (theory)"])
    return dict(stages=best["K"], micro_batches=best["M"], checkpoint=best["checkpoint"])


def _layout(choice) -> tuple[int, int]:
    """(D, K) from a pair of whole numbers in any container (a tuple, a list, a numpy array, a
    pandas row); Feedback for anything else."""
    if not isinstance(choice, Mapping) and callable(getattr(choice, "to_dict", None)):
        choice = choice.to_dict()  # a pandas row (a Series) picked whole out of the table
    if isinstance(choice, Mapping) and {"D", "K"} <= set(choice):
        choice = (choice["D"], choice["K"])
    pair = _listed(choice, SAYS["layout shape"]) if not isinstance(choice, torch.Tensor) else choice.flatten().tolist()
    whole = [_whole(n) for n in pair]
    if len(whole) != 2 or None in whole:
        raise Feedback(f"got {choice!r:.80}: {SAYS['layout shape']}")
    return whole[0], whole[1]


@_exercise
def check_layout(choice: tuple, large_run) -> str:
    """choice = (D, K) for a lab.replicas.LargeRun: a layout of its workers that fits the memory and,
    among those, the fastest step."""
    _attempted(choice, "MY_LAYOUT = ...")
    replicas, stages = _layout(choice)
    if replicas * stages != large_run.workers:
        raise Feedback(f"{replicas} x {stages} = {replicas * stages} workers, but there are {large_run.workers}: "
                       f"every worker runs one stage of one replica, so D x K = {large_run.workers}")
    rows = {(r["D"], r["K"]): r for r in large_run.table()}
    if (replicas, stages) not in rows:
        raise Feedback(f"{(replicas, stages)} cannot split the global batch of {large_run.global_batch} into whole "
                       f"micro-batches of {large_run.micro_size} per replica, or has more stages than the model's "
                       f"{large_run.layers} layers")
    row, best = rows[(replicas, stages)], rows[large_run.best()]
    swapped = (f" (if you meant {stages} x {replicas}: {SAYS['layout swapped']})"
               if (stages, replicas) == large_run.best() and replicas != stages else "")
    if not row["fits"]:
        states = 16 * large_run.params / stages / 1e9
        raise Feedback(f"{replicas} x {stages} needs {row['GB per worker']} GB per worker, more than the "
                       f"{large_run.memory / 1e9:.0f} GB each has: {states:.1f} GB of model states (16 bytes per parameter "
                       f"over {stages} stage(s)) and {row['GB per worker'] - states:.1f} GB of activations and kept "
                       f"inputs{swapped}")
    if row["step s"] > best["step s"] + 1e-9:
        why = (f"more replicas at this global batch leave each fewer micro-batches, but fewer stages too: the "
               f"fill and drain shrink by more than the all-reduce ({best['all-reduce s']} s) costs"
               if best["D"] > replicas else
               f"here the all-reduce of {replicas} replicas ({row['all-reduce s']} s) costs more than the bubble it "
               f"saves")
        raise Feedback(f"{replicas} x {stages} fits ({row['GB per worker']} GB) and takes {row['step s']} s a step, "
                       f"but {best['D']} x {best['K']} also fits and takes {best['step s']} s: {why}{swapped}")
    return (f"✓ {replicas} x {stages}: fits ({row['GB per worker']} GB per worker) and is the fastest layout that "
            f"does ({row['step s']} s a step, bubble {row['bubble']})")


WRITTEN = dict(stages=4, micro_batches=8, checkpoint="never")  # notebook 12's setting for its schedules
BROKEN = ("stage 0: F0 B0 F1 B1 F2 B2 F3 B3\n"   # notebook 12's deadlock, K=3, M=4, no recompute: stage 0
          "stage 1: F0 F1 B0 B1 F2 F3 B2 B3\n"   # tries to hold one micro-batch at a time
          "stage 2: F0 F1 B0 B1 F2 F3 B2 B3")


def _written(text, name: str, stages: int, micro_batches: int, checkpoint: str = "never"):
    """The schedule and the engine's report of a text answer; Feedback with the engine's words if it
    refuses it (or its text is not a schedule)."""
    _attempted(text, name)
    text = _as_text(text)
    if not isinstance(text, str):
        raise Feedback(f"got {type(text).__name__} {text!r:.60}: {SAYS['schedule text']}")
    try:
        written = schedule_writer.parse(text)
    except ValueError as error:
        raise Feedback(f"{error}: {SAYS['schedule text']}") from None
    if len(written) != stages:
        raise Feedback(f"got {len(written)} lines of tasks for K={stages} stages: {SAYS['stage count']}")
    try:
        return written, schedules.check(written, micro_batches, checkpoint)
    except ValueError as error:
        family = "still deadlocks" if "deadlocks" in str(error) and name == "FIXED" else "engine refuses"
        raise Feedback(f"{error}: {SAYS[family]}") from None


def _as_text(answer):
    """A schedule given as the engine builds it (a Schedule, or one list of Tasks per stage, as
    engine.schedule.one_f_one_b returns) or as lists of task names per stage, in the text `parse`
    reads; anything else as it is."""
    if isinstance(answer, str) or not isinstance(answer, (list, tuple)) or not answer:
        return answer
    if not all(isinstance(stage, (list, tuple)) for stage in answer):
        return answer
    if all(isinstance(task, schedules.Task) for stage in answer for task in stage):
        return schedule_writer.format(answer)
    if all(isinstance(task, str) for stage in answer for task in stage):
        return "\n".join(f"stage {k}: {' '.join(stage)}" for k, stage in enumerate(answer))
    return answer


def _unit_cost(report) -> str:
    return f"unit-cost makespan {report.makespan:g}, bubble {report.bubble:.0%}, at most {report.held:g} held"


@_exercise
def check_written_1f1b(text) -> str:
    """MY_1F1B: 1F1B for K=4, M=8, no recompute, as text, one line of tasks per stage."""
    written, report = _written(text, "MY_1F1B", WRITTEN["stages"], WRITTEN["micro_batches"])
    best = schedules.check(schedules.one_f_one_b(**WRITTEN), WRITTEN["micro_batches"], "never")
    if any(t.op == "W" for tasks in written for t in tasks):
        raise Feedback(SAYS["split in 1F1B"])
    if report.held > best.held:
        raise Feedback(f"{_unit_cost(report)}: {SAYS['holds too many']}")
    if report.makespan > best.makespan:
        backwards = [[t.micro for t in tasks if t.op == "B"] for tasks in written]
        if any(order != sorted(order) for order in backwards):
            k = next(k for k, order in enumerate(backwards) if order != sorted(order))
            raise Feedback(f"{_unit_cost(report)}, 1F1B's is {best.makespan:g}: stage {k} runs its backwards in the "
                           f"order {backwards[k]}: {SAYS['1F1B backward order']}")
        raise Feedback(f"{_unit_cost(report)}, 1F1B's is {best.makespan:g}: {SAYS['slower than 1F1B']}")
    return f"✓ legal, 1F1B's {_unit_cost(report)}"


@_exercise
def check_deadlock_fix(text) -> str:
    """FIXED: the schedule BROKEN (K=3, M=4, no recompute) reordered so that it runs, as text."""
    _attempted(text, "FIXED")
    text = _as_text(text)
    given = schedule_writer.parse(BROKEN)
    if isinstance(text, str):
        try:
            tasks = schedule_writer.parse(text)
        except ValueError:
            tasks = None
        if tasks is not None and len(tasks) == len(given) and any(sorted(a) != sorted(b) for a, b in zip(tasks, given)):
            k = next(k for k, (a, b) in enumerate(zip(tasks, given)) if sorted(a) != sorted(b))
            raise Feedback(f"stage {k}'s tasks are not BROKEN's stage {k}'s: {SAYS['not a reorder']}")
    _, report = _written(text, "FIXED", len(given), 4)
    return f"✓ it runs: {_unit_cost(report)}"


@_exercise
def check_split_schedule(text) -> str:
    """MY_SPLIT: a schedule for K=4, M=8, no recompute, with W split off, as text."""
    written, report = _written(text, "MY_SPLIT", WRITTEN["stages"], WRITTEN["micro_batches"])
    best = schedules.check(schedules.one_f_one_b(**WRITTEN), WRITTEN["micro_batches"], "never")
    if not any(t.op == "W" for tasks in written for t in tasks):
        raise Feedback(f"{_unit_cost(report)}: {SAYS['no W']}")
    if report.held > best.held:
        raise Feedback(f"{_unit_cost(report)}: {SAYS['holds more than 1F1B']}")
    if report.bubble >= best.bubble - 1e-9:
        raise Feedback(f"{_unit_cost(report)}, 1F1B's bubble is {best.bubble:.0%}: {SAYS['bubble not smaller']}")
    return f"✓ {_unit_cost(report)}, against 1F1B's bubble of {best.bubble:.0%}"
