"""Checks for the lessons' "your turn" cells: each runs what the learner wrote against the lab's
own answer and, when it differs, says what is wrong and why, not just that it is.

A check never stops a notebook (Run All runs every cell, as Kaggle Learn's `q.check()` does): it
returns one line, "✓ ..." for a right answer, "✗ ..." with the specific feedback for a wrong one,
and "… not attempted yet: ..." while the `...` is still there. The cells after an exercise use
`yours_if_right`, so they run the same whether or not the learner has done it.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch
from torch import nn

from engine import GPipe
from engine.balance import solve
from engine.memory import ActivationLedger
from engine.schedule import gpipe

from . import theory


class Feedback(Exception):
    """What is wrong with an answer, in words a learner can act on."""


class NotAttempted(Exception):
    """The answer is still the `...` the notebook was committed with."""


def _exercise(judge: Callable[..., str]) -> Callable[..., str]:
    """A check from a judge that returns "✓ ..." or raises Feedback / NotAttempted: the check
    returns the line to print instead of raising."""
    @functools.wraps(judge)
    def check(*answer) -> str:
        try:
            return judge(*answer)
        except NotAttempted as why:
            return f"… not attempted yet: {why}"
        except Feedback as why:
            return f"✗ {why}"
    return check


def yours_if_right(check: Callable[[Any], str], answer: Any, reference: Any) -> tuple[Any, str]:
    """(`answer`, "your") if it passes `check`, else (the lab's `reference`, "the lab's"): the
    cells after an exercise run on a right answer either way (the check's cell said why)."""
    return (answer, "your") if check(answer).startswith("✓") else (reference, "the lab's")


def _attempted(answer, name: str):
    if answer is None or answer is Ellipsis:
        raise NotAttempted(f"replace the `...` in {name} above with your answer, run that cell, then this one")
    return answer


def _called(fn: Callable, *args, returns: bool = True):
    """fn(*args), the learner's function: an exception in it becomes feedback that names it; with
    `returns`, a result of None or `...` means the answer is not written yet."""
    _attempted(fn, "the cell")
    if not callable(fn):
        raise Feedback(f"expected a function, got {type(fn).__name__}: define it with def, as the cell above does")
    try:
        result = fn(*args)
    except Exception as error:
        raise Feedback(f"{_call_text(fn, args)} raised {type(error).__name__}: {error}") from error
    if returns and (result is None or result is Ellipsis):
        raise NotAttempted(f"{_call_text(fn, args)} returned {result!r}: replace the `...` in it with your answer "
                           f"(and return it), run that cell, then this one")
    return result


def _call_text(fn: Callable, args: tuple) -> str:
    return f"{fn.__name__}({', '.join(repr(a) if isinstance(a, (int, float, list)) else type(a).__name__ for a in args)})"


def _close(a, b) -> bool:
    """a is a number (Python's, numpy's, a one-element tensor) equal to b up to rounding."""
    if isinstance(a, (bool, str)):
        return False
    try:
        return math.isclose(float(a), b, rel_tol=1e-9, abs_tol=1e-12)
    except (TypeError, ValueError, RuntimeError):
        return False


@_exercise
def check_training_bytes(fn: Callable[[int], float]) -> str:
    """fn(parameters): bytes a float32 model with Adam keeps besides activations."""
    for params in (1, 1000, 123_456):
        got, want = _called(fn, params), 16 * params
        if _close(got, 4 * params):
            raise Feedback(f"{params} parameters: {got} counts the weights alone; training also keeps a gradient "
                           f"per weight and Adam's two moments")
        if _close(got, 8 * params):
            raise Feedback(f"{params} parameters: {got} counts weights and gradients; Adam adds two moments per weight")
        if not _close(got, want):
            raise Feedback(f"{params} parameters: got {got}, expected {want} (4 bytes each for the weight, its "
                           f"gradient and Adam's two moments)")
    return "✓ 16 bytes per parameter: weights, gradients and Adam's two moments, 4 bytes each"


@_exercise
def check_naive_bubble(fn: Callable[[int], float]) -> str:
    """fn(K): the idle share of K stages running one micro-batch (M = 1)."""
    for stages in (2, 4, 8, 1):
        got, want = _called(fn, stages), theory.bubble(stages, 1)
        if _close(got, 1 / stages) and not _close(got, want):
            raise Feedback(f"K={stages}: {got} is the share of time a stage works; the bubble is the share it waits")
        if not _close(got, want):
            raise Feedback(f"K={stages}: got {got}, expected {want:.4f}: with one micro-batch the step is a chain "
                           f"of K stages, and each stage works during 1 of its K slots")
    return "✓ (K-1)/K: with M = 1 only one stage works at a time"


@_exercise
def check_bubble(fn: Callable[[int, int], float]) -> str:
    """fn(K, M): the bubble of GPipe's fill-drain schedule."""
    for stages, micro in ((2, 1), (4, 4), (4, 16), (8, 32), (1, 4)):
        got, want = _called(fn, stages, micro), theory.bubble(stages, micro)
        if _close(got, micro / (micro + stages - 1)) and not _close(got, want):
            raise Feedback(f"K={stages}, M={micro}: {got} is the share of time a stage is busy; the bubble is the "
                           f"idle share, 1 minus it")
        if _close(got, (stages - 1) / micro) and not _close(got, want):
            raise Feedback(f"K={stages}, M={micro}: you divided by M, but the step lasts M+K-1 slots: M of work "
                           f"plus K-1 of fill (or drain)")
        if _close(got, (stages - 1) / (micro + stages)) and not _close(got, want):
            raise Feedback(f"K={stages}, M={micro}: off by one: the first micro-batch needs K slots to cross the "
                           f"pipe and each later one 1 more, M+K-1 in all")
        if not _close(got, want):
            raise Feedback(f"K={stages}, M={micro}: got {got}, expected {want:.4f} = (K-1)/(M+K-1)")
    return "✓ (K-1)/(M+K-1): K-1 idle slots of fill and drain out of M+K-1"


@_exercise
def check_fill_drain(fn: Callable[[int, int], list]) -> str:
    """fn(K, M): each stage's task list in GPipe's order, as strings like "F0" and "B3"."""
    for stages, micro in ((1, 1), (2, 3), (3, 4)):
        got = _called(fn, stages, micro)
        want = [[str(task) for task in tasks] for tasks in gpipe(stages, micro, "never")]
        if len(got) != stages:
            raise Feedback(f"K={stages}, M={micro}: got {len(got)} lists, expected one per stage ({stages})")
        for k, (mine, right) in enumerate(zip(got, want)):
            mine = [str(t) for t in mine]
            if sorted(mine) != sorted(right):
                raise Feedback(f"K={stages}, M={micro}, stage {k}: every stage runs each micro-batch's forward and "
                               f"backward once: expected the tasks {sorted(right)}, got {sorted(mine)}")
            if mine != right:
                i = next(i for i, (a, b) in enumerate(zip(mine, right)) if a != b)
                why = ("all forwards come before any backward (the pipe fills, then drains)" if right[i][0] != mine[i][0]
                       else "forwards run in micro-batch order, the order the mini-batch was split in"
                       if right[i][0] == "F"
                       else "the drain runs the last micro-batch first: it is the first to finish its forward")
                raise Feedback(f"K={stages}, M={micro}, stage {k}, task {i}: got {mine[i]}, expected {right[i]}: {why}")
    return "✓ the fill-drain order, as engine.schedule.gpipe builds it"


@_exercise
def check_ideal_speedup(fn: Callable[[int, int], float]) -> str:
    """fn(K, M): throughput over one device with equal stages and free transfers."""
    for stages, micro in ((1, 1), (2, 1), (4, 4), (8, 32)):
        got, want = _called(fn, stages, micro), theory.ideal_speedup(stages, micro)
        if _close(got, stages) and not _close(got, want):
            raise Feedback(f"K={stages}, M={micro}: {got} = K forgets the bubble: only M/(M+K-1) of the time is work")
        if not _close(got, want):
            raise Feedback(f"K={stages}, M={micro}: got {got}, expected {want:.4f} = K x M/(M+K-1): K devices, each "
                           f"busy M/(M+K-1) of the time")
    return "✓ K·M/(M+K-1): K devices times the busy share"


@_exercise
def check_checkpointed_stage(fn: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> str:
    """fn(block, x): the block's output, keeping only x for the backward (torch.utils.checkpoint)."""
    torch.manual_seed(0)
    block = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(32, 32), nn.Tanh())])
    x = torch.randn(64, 32, requires_grad=True)
    plain_out = block(x)
    plain_out.sum().backward()
    plain = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
    block.zero_grad()
    x.grad = None
    ledger = ActivationLedger(list(block.parameters()) + [x])
    with ledger.saving():
        out = _called(fn, block, x)
    if not isinstance(out, torch.Tensor) or out.shape != plain_out.shape:
        raise Feedback(f"expected a tensor shaped like block(x), {tuple(plain_out.shape)}: got {out!r:.80}")
    if not torch.allclose(out, plain_out, atol=1e-6):
        raise Feedback("the output differs from block(x): checkpointing changes what is kept, not what is computed")
    if not out.requires_grad:
        raise Feedback("the output carries no graph, so nothing can be differentiated (torch.no_grad() keeps nothing "
                       "and forgets how to go back): checkpointing keeps the input and recomputes the forward in the "
                       "backward; use torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)")
    if ledger.peak > 0:
        raise Feedback(f"autograd kept {ledger.peak:,} bytes of activations during the forward: checkpointing keeps "
                       f"only the input; wrap the block: torch.utils.checkpoint.checkpoint(block, x, "
                       f"use_reentrant=False)")
    out.sum().backward()
    got = [p.grad.clone() for p in block.parameters()] + [x.grad]
    if any(g is None or not torch.allclose(g, w, atol=1e-6) for g, w in zip(got, plain)):
        raise Feedback("the gradients differ from a plain backward: the recompute must redo the same forward")
    engine_grads, engine_peak = _engine_recompute(block, x.detach())
    if not all(torch.allclose(g, w, atol=1e-6) for g, w in zip(got, engine_grads)):
        raise Feedback("the gradients differ from the engine's checkpoint='always' on the same block")
    return (f"✓ nothing but the input kept during your forward, and the same gradients as a plain backward and as "
            f"the engine's recompute (checkpoint='always', one stage, 4 micro-batches: its activation peak "
            f"{engine_peak:,} bytes, one micro-batch's layers plus the inputs it keeps)")


def _engine_recompute(block: nn.Module, x: torch.Tensor) -> tuple[list[torch.Tensor], int]:
    """Weight gradients of sum(block(x)) from the engine with recompute, and its activation peak."""
    block.zero_grad()
    pipe = GPipe(block, 1, chunks=4, checkpoint="always")
    try:
        pipe.step(x, torch.zeros(len(x)), lambda out, _: out.sum() * len(x) / len(out))
        return [p.grad.clone() for p in block.parameters()], pipe.trace.memory[0].activation_peak_bytes
    finally:
        pipe.close()


@_exercise
def check_accumulation(fn: Callable) -> str:
    """fn(model, x, y, loss_fn, micro): gradients of the mean loss over the batch, accumulated
    micro-batch by micro-batch into .grad."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(24, 8), torch.randint(0, 3, (24,))
    loss_fn = nn.CrossEntropyLoss()
    loss_fn(model(x), y).backward()
    whole = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    sizes: list[int] = []
    hook = model.register_forward_pre_hook(lambda _, inputs: sizes.append(len(inputs[0])))
    try:
        _called(fn, model, x, y, loss_fn, 4, returns=False)  # it accumulates into .grad
    finally:
        hook.remove()
    if not sizes and all(p.grad is None for p in model.parameters()):
        raise NotAttempted(f"{fn.__name__} ran no forward: replace the `...` in it with your answer, run that cell, "
                           f"then this one")
    if sizes != [6] * 4:
        raise Feedback(f"the model ran on batches of {sizes} samples: run it on each of the 4 micro-batches of 6 "
                       f"samples (x.chunk(micro)), one forward and backward each, so that .grad accumulates")
    got = [p.grad for p in model.parameters()]
    if any(g is None for g in got):
        raise Feedback("some parameters have no gradient: call .backward() on each micro-batch's loss")
    ratio = (got[0].norm() / whole[0].norm()).item()
    if math.isclose(ratio, 4, rel_tol=1e-3):
        raise Feedback("the gradients are 4 times too large: each micro-batch's loss is a mean over its own 6 "
                       "samples; scale it by its share of the batch, 1/M here, before .backward()")
    if math.isclose(ratio, 1 / 4, rel_tol=1e-3):
        raise Feedback("the gradients are 4 times too small: scale each micro-batch's mean loss by 1/M, not 1/M²")
    if not all(torch.allclose(g, w, atol=1e-6) for g, w in zip(got, whole)):
        raise Feedback(f"the accumulated gradients differ from the whole batch's (norm ratio {ratio:.3f})")
    return "✓ the sum over micro-batches of (1/M) x mean loss gives the whole batch's gradients"


@_exercise
def check_best_cut(fn: Callable[[list, int], list]) -> str:
    """fn(costs, K): layers per stage, consecutive, making the costliest stage as cheap as possible."""
    for costs, stages in (([4, 1, 1, 1, 1], 2), ([16, 16, 4, 4, 1, 1, 1], 3), ([1, 1, 1, 1], 4),
                          ([8, 1, 8, 19, 14, 14], 4)):  # the last beats a greedy cut: [2, 1, 1, 2] vs [3, 1, 1, 1]
        got = [int(n) for n in _called(fn, costs, stages)]
        if len(got) != stages or sum(got) != len(costs) or min(got) < 1:
            raise Feedback(f"costs {costs}, K={stages}: got {got}; expected {stages} counts of at least one layer, "
                           f"summing to {len(costs)}")
        best = solve(costs, stages)

        def worst(counts):
            edges = [sum(counts[:k]) for k in range(len(counts) + 1)]
            return max(sum(costs[a:b]) for a, b in zip(edges, edges[1:]))
        if worst(got) > worst(best):
            raise Feedback(f"costs {costs}, K={stages}: your cut {got} has a stage of cost {worst(got)}; {best} "
                           f"gets the costliest stage down to {worst(best)}")
    return "✓ the cut minimizes the costliest stage, as balance_by_time's solver does"


@_exercise
def check_in_flight(fn: Callable[[int, int], int]) -> str:
    """fn(K, k): micro-batches stage k holds at most under 1F1B (M >= K)."""
    for stages in (1, 2, 4, 8):
        for stage in range(stages):
            got, want = _called(fn, stages, stage), theory.peak_in_flight("1f1b", stages, 64, stage)
            if _close(got, stages - 1 - stage) and not _close(got, want):
                raise Feedback(f"K={stages}, stage {stage}: {got} counts the fill's forwards only; the next forward "
                               f"runs before the first backward frees one, so one more is held")
            if not _close(got, want):
                raise Feedback(f"K={stages}, stage {stage}: got {got}, expected {want:g}: the fill takes K-1-k "
                               f"forwards, then one forward and one backward alternate")
    return "✓ K-k: the first stage holds K micro-batches, the last one only one (GPipe holds all M)"


@_exercise
def check_boundary_bytes(fn: Callable[[int, float], float]) -> str:
    """fn(N, bytes_per_sample): bytes crossing one cut between stages in one training step."""
    for batch, per_sample in ((1, 4.0), (32, 256.0), (64, 4096.0)):
        got, want = _called(fn, batch, per_sample), 2 * batch * per_sample
        if _close(got, batch * per_sample):
            raise Feedback(f"N={batch}: {got} counts the activations going forward; their gradients, of the same "
                           f"size, come back")
        if not _close(got, want):
            raise Feedback(f"N={batch}, {per_sample} bytes per sample: got {got}, expected {want:g}")
    return "✓ 2·N·(bytes per sample): activations forward, gradients back, whatever M is"


@_exercise
def check_first_pipe(pipe) -> str:
    """A pipe of 3 stages and 6 micro-batches over the learner's own model, after one step."""
    _attempted(pipe, "my_pipe = ...")
    if not isinstance(pipe, GPipe):
        raise Feedback(f"my_pipe is {type(pipe).__name__}: build it with GPipe(model, balance=..., chunks=...)")
    if pipe.stages != 3:
        raise Feedback(f"my_pipe has {pipe.stages} stages: balance=3 cuts the model into 3 (or give 3 layer counts)")
    if pipe.chunks != 6:
        raise Feedback(f"my_pipe cuts each mini-batch into chunks={pipe.chunks}: ask for 6 micro-batches")
    if not pipe.trace.events:
        raise Feedback("my_pipe has not run a step yet: call my_pipe.step(inputs, targets, loss_fn)")
    ran = pipe.trace.micro_batches
    return (f"✓ {len(pipe.trace.events)} tasks ran on 3 stages over {ran} micro-batches; bubble "
            f"{pipe.trace.bubble:.0%} measured (theory {theory.bubble(3, ran):.0%} for equal stages)")


@_exercise
def check_plan(choice: dict, rows: list[dict]) -> str:
    """choice = dict(stages=K, micro_batches=M, checkpoint=...): a setting the prediction says
    fits, and among those the fastest in the unit-cost model (within 5%)."""
    keys = ("stages", "micro_batches", "checkpoint")
    _attempted(choice, "choice = ...")
    if isinstance(choice, dict) and Ellipsis in choice.values():
        raise NotAttempted("replace each `...` in choice = dict(...) above with your setting, run that cell, then this one")
    if not isinstance(choice, dict) or set(choice) != set(keys):
        raise Feedback(f"choice must be a dict with the keys {keys}, got {choice!r}")
    row = next((r for r in rows if (r["K"], r["M"], r["checkpoint"]) == tuple(choice[k] for k in keys)), None)
    if row is None:
        raise Feedback(f"{choice} is not among the settings in the table: pick one of its rows")
    fitting = [r for r in rows if r["fits (predicted)"]]
    if not row["fits (predicted)"]:
        raise Feedback(f"the prediction for {choice} is {row['predicted bytes (most loaded stage)']:,} bytes on its "
                       f"most loaded stage, over the budget: more stages or recompute shrink it")
    best = min(r["time vs one device (theory)"] for r in fitting)
    if row["time vs one device (theory)"] > 1.05 * best:
        raise Feedback(f"{choice} fits, but is predicted at {row['time vs one device (theory)']} of one device's time "
                       f"where another setting that fits gets {best}: more micro-batches shrink the bubble")
    return f"✓ fits the budget by prediction and is among the fastest settings that do ({row['time vs one device (theory)']})"


def best_plan(rows: list[dict]) -> dict:
    """The lab's answer to check_plan: among the settings predicted to fit, the fastest in the
    unit-cost model."""
    best = min((r for r in rows if r["fits (predicted)"]), key=lambda r: r["time vs one device (theory)"])
    return dict(stages=best["K"], micro_batches=best["M"], checkpoint=best["checkpoint"])


@_exercise
def check_layout(choice: tuple, plan) -> str:
    """choice = (D, K) for a lab.replicas.Plan: a layout of its workers that fits the memory and,
    among those, the fastest step."""
    _attempted(choice, "MY_LAYOUT = ...")
    choice = tuple(choice) if isinstance(choice, list) else choice
    if not (isinstance(choice, tuple) and len(choice) == 2 and all(isinstance(n, int) for n in choice)):
        raise Feedback(f"MY_LAYOUT must be a pair of whole numbers (D, K), got {choice!r}")
    replicas, stages = choice
    if replicas * stages != plan.workers:
        raise Feedback(f"{replicas} x {stages} = {replicas * stages} workers, but there are {plan.workers}: "
                       f"every worker runs one stage of one replica, so D x K = {plan.workers}")
    rows = {(r["D"], r["K"]): r for r in plan.table()}
    if choice not in rows:
        raise Feedback(f"{choice} cannot split the global batch of {plan.global_batch} into whole micro-batches of "
                       f"{plan.micro_size} per replica, or has more stages than the model's {plan.layers} layers")
    row, best = rows[choice], rows[plan.best()]
    if not row["fits"]:
        raise Feedback(f"{replicas} x {stages} needs {row['GB per worker']} GB per worker, more than the "
                       f"{plan.memory / 1e9:.0f} GB each has: the model's states alone are 16 bytes x "
                       f"{plan.params / 1e9:.0f}B parameters over {stages} stage(s)")
    if row["step s"] > best["step s"] + 1e-9:
        more = best["D"] > replicas
        why = (f"more replicas at this global batch leave each fewer micro-batches, but fewer stages too: the "
               f"fill and drain shrink by more than the all-reduce ({best['all-reduce s']} s) costs") if more else \
            (f"here the all-reduce of {replicas} replicas ({row['all-reduce s']} s) costs more than the bubble it saves")
        raise Feedback(f"{replicas} x {stages} fits ({row['GB per worker']} GB) and takes {row['step s']} s a step, "
                       f"but {best['D']} x {best['K']} also fits and takes {best['step s']} s: {why}")
    return (f"✓ {replicas} x {stages}: fits ({row['GB per worker']} GB per worker) and is the fastest layout that "
            f"does ({row['step s']} s a step, bubble {row['bubble']})")
