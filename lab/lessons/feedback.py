"""What a check says: every known mistake's sentence, by family (`SAYS`, which the tests hold the
checks to), and how a judge's verdict becomes the one line a check prints."""
from __future__ import annotations

import functools
from typing import Any, Callable

# Every known mistake's sentence, by family. A check names the family it recognized in the answer.

SAYS = {
    # any exercise
    "raised": "Fix the error in your function, then run this cell again",
    "not a function": "define a function with def, as the cell above does, and pass the function itself",
    "not a number": "expected a number (an int or a float)",
    "constant": "your function returns the same value whatever its arguments: the answer depends on them",
    "too long": "does every loop move on (past each item it looks at), and end? does it wait for something "
                "that never comes?",
    "endless": "does your generator end? return a list of what it yields",
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
    "fill only": "that counts the fill only: a stage waits K-1 backward slots as well (the last stage after its "
                 "backwards, the first before them)",
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
    "reentrant on data": "on a stage whose input is data (it requires no grad, as the first stage's), your stage "
                         "gave the weights no gradient: the reentrant checkpoint (use_reentrant=True) "
                         "differentiates only through inputs that require grad; use use_reentrant=False",
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
    "variance cut": "your cut makes the stages' costs as even as possible (least variance, the paper's own rule in "
                    "§2.2, or least spread); on this list it leaves a costlier stage than the min-max cut, and a "
                    "pipeline runs at its costliest stage's pace: this exercise asks for the cut whose costliest stage "
                    "is cheapest",
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
    # the capstone's own model
    "own not sequential": "return the layers as an nn.Sequential (a block with a skip connection as one module "
                          "inside it): the pipeline cuts between its entries",
    "own does not run": "its first layer must take 16 features a sample (a batch of shape (32, 16)), and it must "
                        "end in one score per class",
    # any check
    "keywords": "pass your answer as the check's argument itself, as the notebook's check cell does",
}


class Feedback(Exception):
    """What is wrong with an answer, in words a learner can act on."""


class NotAttempted(Exception):
    """The answer is still the `...` the notebook was committed with."""


def exercise(judge: Callable[..., str]) -> Callable[..., str]:
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


def attempted(answer, name: str):
    """`answer`, or NotAttempted while it is still `...` (or None)."""
    if answer is None or answer is Ellipsis:
        raise NotAttempted(f"replace the `...` in {name} above with your answer, run that cell, then this one")
    return answer


