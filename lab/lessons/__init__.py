"""Lessons: the checks of the notebooks' "your turn" cells.

Reading map:

1. `exercises.py`  every check, in one place for the notebooks to import
2. `feedback.py`   every known mistake's sentence, and how a verdict becomes the line a check prints
3. `sandbox.py`    running the learner's code: bounded in time, its prints kept, never left running
4. `formulas.py`   formula exercises, and the ways to get any formula wrong
5. `tasks.py`      fill-drain orders, a checkpointed stage, gradient accumulation
6. `cuts.py`       the best cut: the paper's least variance beside the least maximum and a greedy fill
7. `plans.py`      the first pipe, the capstone's plan, the layout of workers
8. `written.py`    schedules written by hand (notebook 12)
9. `grading.py`    a learner's copy run top to bottom, each exercise read off its check (lab.grade)
"""
