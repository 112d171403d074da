"""The first pipe, the capstone's plan and the layout of workers: a learner's choices judged
against measured rows."""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from engine import GPipe
from lab import theory
from lab.lessons.feedback import SAYS, Feedback, NotAttempted, attempted, exercise
from lab.lessons.formulas import as_whole
from lab.lessons.sandbox import called
from lab.lessons.tasks import listed


@exercise
def check_first_pipe(pipe) -> str:
    """A pipe of 3 stages and 6 micro-batches over the learner's own model, after one step."""
    attempted(pipe, "my_pipe = ...")
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
    stages, micro = as_whole(choice["stages"]), as_whole(choice["micro_batches"])
    if stages is None or micro is None or not isinstance(choice["checkpoint"], str):
        raise Feedback(f"got {dict(choice)!r:.100}: stages and micro_batches are whole numbers, checkpoint a string "
                       f"such as \"never\" or \"always\"")
    return stages, micro, choice["checkpoint"]


@exercise
def check_plan(choice: dict, rows: list[dict]) -> str:
    """choice = dict(stages=K, micro_batches=M, checkpoint=...): a setting the prediction says
    fits, and among those the fastest in the unit-cost model (within 5%)."""
    attempted(choice, "choice = ...")
    if isinstance(choice, Mapping) and any(v is Ellipsis for v in choice.values()):
        raise NotAttempted("replace each `...` in choice = dict(...) above with your setting, run that cell, "
                           "then this one")
    setting = _plan_setting(choice)
    row = next((r for r in rows if (r["K"], r["M"], r["checkpoint"]) == setting), None)
    if row is None:
        raise Feedback(f"{dict(zip(PLAN_KEYS, setting))}: {SAYS['plan not in table']}")
    time = "time vs one device (theory)"
    if not row["fits (predicted)"]:
        raise Feedback(f"{dict(zip(PLAN_KEYS, setting))} is predicted at "
                       f"{row['predicted bytes (most loaded stage)']:,} bytes on its most loaded stage: "
                       f"{SAYS['over budget']}")
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
    pair = listed(choice, SAYS["layout shape"]) if not isinstance(choice, torch.Tensor) else choice.flatten().tolist()
    whole = [as_whole(n) for n in pair]
    if len(whole) != 2 or None in whole:
        raise Feedback(f"got {choice!r:.80}: {SAYS['layout shape']}")
    return whole[0], whole[1]


@exercise
def check_layout(choice: tuple, large_run) -> str:
    """choice = (D, K) for a lab.studies.layouts.LargeRun: a layout of its workers that fits the memory and,
    among those, the fastest step."""
    attempted(choice, "MY_LAYOUT = ...")
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
                       f"{large_run.memory / 1e9:.0f} GB each has: {states:.1f} GB of model states (16 bytes per "
                       f"parameter over {stages} stage(s)) and {row['GB per worker'] - states:.1f} GB of activations "
                       f"and kept inputs{swapped}")
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


def sample_model() -> nn.Sequential:
    """The lab's own answer to the capstone's last exercise: batch norm and dropout included."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 64),
                         nn.ReLU(), nn.Linear(64, 4))


@exercise
def check_own_model(fn) -> str:
    """fn(): a model of your own, an nn.Sequential of at least 2 layers taking batches of (32, 16)."""
    attempted(fn, "def my_model(): ...")
    model = called(fn)
    attempted(model, "my_model's return ...")
    if not isinstance(model, nn.Sequential):
        raise Feedback(f"my_model() returned {type(model).__name__}: {SAYS['own not sequential']}")
    if len(model) < 2:
        raise Feedback(f"my_model() has {len(model)} layer: two stages need at least two")
    try:
        with torch.no_grad():
            out = model.eval()(torch.randn(32, 16))
    except Exception as error:
        raise Feedback(f"my_model() fails on a batch of (32, 16) ({type(error).__name__}): "
                       f"{SAYS['own does not run']}") from None
    finally:
        model.train()
    if not torch.is_tensor(out) or out.dim() != 2:
        raise Feedback(f"my_model() gives {getattr(out, 'shape', type(out).__name__)}: {SAYS['own does not run']}")
    return f"✓ {len(model)} layers, {sum(p.numel() for p in model.parameters()):,} parameters: the report is of yours"
