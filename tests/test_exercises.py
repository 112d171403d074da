"""The lessons' checks accept right answers and explain wrong ones specifically, and never
stop a notebook."""
import re

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import numpy as np

from lab import exercises


def test_right_answers_pass():
    assert exercises.check_training_bytes(lambda p: 16 * p).startswith("✓")
    assert exercises.check_naive_bubble(lambda k: (k - 1) / k).startswith("✓")
    assert exercises.check_bubble(lambda k, m: (k - 1) / (m + k - 1)).startswith("✓")
    assert exercises.check_ideal_speedup(lambda k, m: k * m / (m + k - 1)).startswith("✓")
    assert exercises.check_fill_drain(lambda k, m: [[f"F{i}" for i in range(m)] + [f"B{i}" for i in reversed(range(m))]
                                                    for _ in range(k)]).startswith("✓")
    assert exercises.check_checkpointed_stage(lambda block, x: checkpoint(block, x, use_reentrant=False)).startswith("✓")
    assert exercises.check_in_flight(lambda k, s: k - s).startswith("✓")
    assert exercises.check_boundary_bytes(lambda n, b: 2 * n * b).startswith("✓")

    def accumulate(model, x, y, loss_fn, micro):
        for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
            (loss_fn(model(xs), ys) / micro).backward()
    assert exercises.check_accumulation(accumulate).startswith("✓")
    from engine.balance import solve
    assert exercises.check_best_cut(solve).startswith("✓")


def no_graph(block, x):
    with torch.no_grad():
        return block(x)


def whole_batch(model, x, y, loss_fn, micro):
    loss_fn(model(x), y).backward()


@pytest.mark.parametrize("check,wrong,words", [
    (exercises.check_training_bytes, lambda p: 8 * p, "Adam adds two moments"),
    (exercises.check_naive_bubble, lambda k: 1 / k, "share of time a stage works"),
    (exercises.check_bubble, lambda k, m: m / (m + k - 1), "busy"),
    (exercises.check_bubble, lambda k, m: (k - 1) / m, "you divided by M"),
    (exercises.check_bubble, lambda k, m: (k - 1) / (m + k), "off by one"),
    (exercises.check_ideal_speedup, lambda k, m: k, "forgets the bubble"),
    (exercises.check_fill_drain, lambda k, m: [[f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]
                                               for _ in range(k)], "last micro-batch first"),
    (exercises.check_fill_drain, lambda k, m: [[t for i in range(m) for t in (f"F{i}", f"B{i}")] for _ in range(k)],
     "all forwards come before any backward"),
    (exercises.check_checkpointed_stage, lambda block, x: block(x), "use_reentrant=False"),
    (exercises.check_in_flight, lambda k, s: k - 1 - s, "one more is held"),
    (exercises.check_boundary_bytes, lambda n, b: n * b, "their gradients"),
    (exercises.check_best_cut, lambda costs, k: [len(costs) - k + 1] + [1] * (k - 1), "gets the costliest stage down"),
    (exercises.check_best_cut, lambda costs, k: [2, 1, 1, 2] if len(costs) == 6 else exercises.solve(costs, k),
     r"\[3, 1, 1, 1\] gets the costliest stage down to 19"),  # a greedy cut of [8, 1, 8, 19, 14, 14]
    (exercises.check_fill_drain, lambda k, m: [[f"F{i}" for i in reversed(range(m))] + [f"B{i}" for i in reversed(range(m))]
                                               for _ in range(k)], "forwards run in micro-batch order"),
    (exercises.check_checkpointed_stage, no_graph, "carries no graph"),
    (exercises.check_accumulation, whole_batch, r"batches of \[24\] samples"),
    (exercises.check_bubble, lambda k, m: 1 / 0, r"raised ZeroDivisionError"),
])
def test_wrong_answers_get_specific_feedback_and_never_stop_the_notebook(check, wrong, words):
    said = check(wrong)
    assert said.startswith("✗") and re.search(words, said), said


def test_an_answer_not_attempted_says_so_and_never_stops_the_notebook():
    def bubble(K, M):
        ...

    def accumulate(model, x, y, loss_fn, micro):
        ...
    for said in (exercises.check_bubble(bubble), exercises.check_accumulation(accumulate),
                 exercises.check_first_pipe(...), exercises.check_plan(..., [])):
        assert said.startswith("… not attempted yet") and "replace the `...`" in said, said


def test_a_numpy_number_is_a_number():
    assert exercises.check_training_bytes(lambda p: np.int64(16 * p)).startswith("✓")


def test_the_cells_after_an_exercise_get_a_right_answer_either_way():
    def not_yet(costs, k):
        ...
    assert exercises.yours_if_right(exercises.check_best_cut, not_yet, exercises.solve) == (exercises.solve, "the lab's")
    assert exercises.yours_if_right(exercises.check_best_cut, exercises.solve, None) == (exercises.solve, "your")


def test_forgetting_the_one_over_m_is_named():
    def unscaled(model, x, y, loss_fn, micro):
        for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
            loss_fn(model(xs), ys).backward()
    said = exercises.check_accumulation(unscaled)
    assert said.startswith("✗") and re.search("4 times too large.*1/M", said), said
    torch.manual_seed(0)


def test_first_pipe_and_plan_checks():
    from torch import nn
    from lab.api import GPipe
    from lab import fit
    from lab.experiments import RunConfig
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    pipe = GPipe(model, balance=3, chunks=6)
    assert "has not run a step" in exercises.check_first_pipe(pipe)
    pipe.step(torch.randn(12, 4), torch.randint(0, 2, (12,)), nn.CrossEntropyLoss())
    assert exercises.check_first_pipe(pipe).startswith("✓ 51 tasks ran on 3 stages over 6 micro-batches")  # 3 x (6 F + 5 R + 6 B)
    assert "2 stages" in exercises.check_first_pipe(GPipe(model, balance=2, chunks=6))
    assert "build it with GPipe" in exercises.check_first_pipe(model)

    base = RunConfig(model="transformer", blocks=2, width=16, batch=8)
    one = fit.plan(base, 0, stages=(1,), micro=(1,), checkpoints=("never",))[0]["predicted bytes (most loaded stage)"]
    rows = fit.plan(base, int(0.4 * one), stages=(1, 2, 4), micro=(1, 2, 4))
    best = min((r for r in rows if r["fits (predicted)"]), key=lambda r: r["time vs one device (theory)"])
    assert exercises.check_plan(dict(stages=best["K"], micro_batches=best["M"], checkpoint=best["checkpoint"]),
                                rows).startswith("✓")
    assert "over the budget" in exercises.check_plan(dict(stages=1, micro_batches=1, checkpoint="never"), rows)
    slow = next(r for r in rows if r["fits (predicted)"] and r["time vs one device (theory)"] > 1.05 *
                best["time vs one device (theory)"])
    assert "more micro-batches shrink the bubble" in exercises.check_plan(dict(stages=slow["K"], micro_batches=slow["M"], checkpoint=slow["checkpoint"]), rows)
    assert "keys" in exercises.check_plan(dict(stages=4), rows)


def test_the_layout_check_weighs_memory_then_time():
    from lab.replicas import Plan
    plan = Plan()
    assert exercises.check_layout((2, 4), plan).startswith("✓ 2 x 4: fits")
    assert exercises.check_layout([2, 4], plan).startswith("✓")   # a list is a pair too
    assert "4 workers, but there are 8" in exercises.check_layout((2, 2), plan)
    assert "123.9 GB per worker, more than the 80 GB" in exercises.check_layout((4, 2), plan)
    assert "but 2 x 4 also fits and takes 9.459 s" in exercises.check_layout((1, 8), plan)
    assert "a pair of whole numbers" in exercises.check_layout("2x4", plan)
    assert exercises.check_layout(..., plan).startswith("… not attempted yet")
    cheap_links = Plan(bandwidth=1e9)   # slow links: the all-reduce outweighs the bubble it saves
    assert cheap_links.best() == (1, 8) and "costs more than the bubble it saves" in \
        exercises.check_layout((2, 4), cheap_links)
