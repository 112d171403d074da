"""The checks of the lessons' "your turn" cells, in one place for the notebooks to import.

Each check runs what the learner wrote against the lab's own answer and, when it differs, says
what is wrong and why, not just that it is. A check never stops a notebook (Run All runs every
cell, as Kaggle Learn's `q.check()` does), never raises and never hangs, whatever it is given (a
learner's function is stopped after 5 s of CPU, lab.lessons.sandbox): it returns "✓ ..." for a
right answer, "✗ ..." with the specific feedback for a wrong one, and "… not attempted yet: ..."
while the `...` is still there. Each known mistake has its own sentence in `SAYS`
(lab.lessons.feedback), which the tests hold the checks to. The cells after an exercise use
`yours_if_right`, so they run the same whether or not the learner has done it.
"""
from engine.balance import solve  # the lab's own answer to the best-cut exercise
from lab.lessons.cuts import SEPARATING_CUTS, check_best_cut, cut_battery, greedy_cut, greedy_cuts, variance_cut
from lab.lessons.feedback import SAYS, yours_if_right
from lab.lessons.formulas import (
                                  IDEAL_SPEEDUP,
                                  check_boundary_bytes,
                                  check_bubble,
                                  check_bubble_ms,
                                  check_ideal_speedup,
                                  check_in_flight,
                                  check_naive_bubble,
                                  check_training_bytes,
)
from lab.lessons.plans import best_plan, check_first_pipe, check_layout, check_own_model, check_plan, sample_model
from lab.lessons.tasks import check_accumulation, check_checkpointed_stage, check_fill_drain
from lab.lessons.written import BROKEN, WRITTEN, check_deadlock_fix, check_split_schedule, check_written_1f1b

__all__ = ["BROKEN", "IDEAL_SPEEDUP", "SAYS", "SEPARATING_CUTS", "WRITTEN", "best_plan", "check_accumulation",
           "check_best_cut", "check_boundary_bytes", "check_bubble", "check_bubble_ms", "check_checkpointed_stage",
           "check_deadlock_fix", "check_fill_drain", "check_first_pipe", "check_ideal_speedup", "check_in_flight",
           "check_layout", "check_naive_bubble", "check_own_model", "check_plan", "check_split_schedule",
           "check_training_bytes", "check_written_1f1b", "cut_battery", "greedy_cut", "greedy_cuts", "sample_model",
           "solve", "variance_cut", "yours_if_right"]
