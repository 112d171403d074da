"""The task exercises: fill-drain orders, a checkpointed stage, gradient accumulation over
micro-batches, each judged against the engine's own."""
from __future__ import annotations

import functools
import math
import re
import warnings
from collections.abc import Iterable, Mapping
from typing import Callable, Sequence

import torch
from torch import nn

from engine import GPipe
from engine.memory import ActivationLedger
from engine.schedule import gpipe
from lab.lessons.feedback import SAYS, Feedback, NotAttempted, exercise
from lab.lessons.sandbox import called


def listed(value, what: str) -> list:
    """A list from any iterable but a string (a generator, a tuple, an array); Feedback else."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise Feedback(f"got {type(value).__name__} {value!r:.60}: {what}")
    return list(value)


@exercise
def check_fill_drain(fn: Callable[[int, int], list]) -> str:
    """fn(K, M): each stage's task list in GPipe's order, as strings like "F0" and "B3"."""
    for stages, micro in ((1, 1), (2, 3), (3, 4), (4, 2)):
        where = f"K={stages}, M={micro}"
        got = listed(called(fn, stages, micro), SAYS["schedule shape"])
        want = [[str(task) for task in tasks] for tasks in gpipe(stages, micro, "never")]
        if got and all(isinstance(t, str) for t in got):
            spaced = len(got) == stages and any(len(t.split()) > 1 or len(t.split(",")) > 1 for t in got)
            raise Feedback(f"{where}: {SAYS['stage strings' if spaced else 'flat list']}")
        got = [[str(t) for t in listed(tasks, SAYS["schedule shape"])] for tasks in got]
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


@exercise
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
        out = called(fn, block, x, within=ledger.saving)
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
    if not _trains_on_data(fn):
        raise Feedback(SAYS["reentrant on data"])
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
    block = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 16))
    return _plain_gradients(fn, block, torch.randn(8, 16), input_grad=True, seed=2)


def _trains_on_data(fn: Callable) -> bool:
    """Whether the learner's stage gives its weights a plain backward's gradients when its input is
    data, which requires no grad (the first stage's, every micro-batch): the reentrant checkpoint
    then gives them none."""
    torch.manual_seed(3)
    block = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    return _plain_gradients(fn, block, torch.randn(8, 16), input_grad=False, seed=3)


def _plain_gradients(fn: Callable, block: nn.Module, x: torch.Tensor, input_grad: bool, seed: int) -> bool:
    """Whether fn(block, x), its input requiring grad or not, gives the block's weights the gradients
    of a plain backward, both run from the random state `seed`."""
    torch.manual_seed(seed)
    block(x).sum().backward()
    plain = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    torch.manual_seed(seed)
    with warnings.catch_warnings():  # the reentrant checkpoint warns that no input requires grad: this is the test
        warnings.simplefilter("ignore")
        out = called(fn, block, x.requires_grad_(input_grad))
    if not isinstance(out, torch.Tensor) or not out.requires_grad:
        return False
    out.sum().backward()
    return all(p.grad is not None and torch.allclose(p.grad, g, atol=1e-6) for p, g in zip(block.parameters(), plain))


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


@exercise
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
        called(fn, model, x, y, loss_fn, MICRO, returns=False)  # it accumulates into .grad
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


