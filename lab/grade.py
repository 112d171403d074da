"""Grade learners' copies of the lessons on a CPU: each notebook runs top to bottom in a fresh
kernel, and each exercise is read off its check: done, not attempted, or wrong with the check's
sentence. Prints a table; --csv writes the same rows for a gradebook.

    python -m lab.grade submissions/*/03_micro_batches_fill_the_pipe.ipynb --csv grades.csv
"""
from __future__ import annotations

import argparse
import csv
import sys
from collections import Counter
from pathlib import Path

from lab.lessons.grading import STATUSES, Grade, grade, read_lesson


def table(grades: list[Grade]) -> str:
    """The grades as aligned text, one row per exercise, then a count per status."""
    width = max([len("notebook")] + [len(g.notebook) for g in grades])
    named = max([len("exercise")] + [len(g.exercise) for g in grades])
    rows = [f"{'notebook':<{width}}  {'exercise':<{named}}  {'status':<13}  what its check said"]
    rows += [f"{g.notebook:<{width}}  {g.exercise:<{named}}  {g.status:<13}  {g.said}" for g in grades]
    counts = Counter(g.status for g in grades)
    return "\n".join(rows + ["", ", ".join(f"{counts[s]} {s}" for s in STATUSES)])


def main(argv=None) -> int:
    """Grade every notebook named; exit status 2 with one line for a path that is not a lesson."""
    options = argparse.ArgumentParser(prog="python -m lab.grade", description=__doc__.splitlines()[0])
    options.add_argument("notebooks", nargs="+", type=Path, help="learners' copies of the lessons (.ipynb)")
    options.add_argument("--csv", type=Path, help="also write the grades to this CSV file")
    options.add_argument("--seconds", type=float, default=600.0, help="the most one notebook may run (default 600)")
    options.add_argument("--full", action="store_true", help="run at the lessons' own sizes, not CI's small ones")
    args = options.parse_args(argv)
    if not args.seconds > 0:
        print(f"python -m lab.grade: error: --seconds {args.seconds:g}: expected more than 0", file=sys.stderr)
        return 2
    try:  # every path is read before any runs: a bad one is refused at once
        lessons = [(path, read_lesson(path)) for path in args.notebooks]
    except ValueError as error:
        print(f"python -m lab.grade: error: {error}", file=sys.stderr)
        return 2
    grades = []
    for path, notebook in lessons:
        grades += grade(path.stem, notebook, args.seconds, quick=not args.full)
        print(f"graded {path}", file=sys.stderr, flush=True)
    print(table(grades))
    if args.csv:
        with args.csv.open("w", newline="") as out:
            writer = csv.writer(out)
            writer.writerow(["notebook", "exercise", "status", "said"])
            writer.writerows([g.notebook, g.exercise, g.status, g.said] for g in grades)
    return 0


if __name__ == "__main__":
    sys.exit(main())
