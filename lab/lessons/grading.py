"""Grading learners' notebooks on a CPU: each notebook run top to bottom as Jupyter's Run All runs
it (nbclient), within a bound, and each exercise read off the line its check printed: done, not
attempted, or wrong with the check's own sentence (`python -m lab.grade`)."""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"  # where lab_setup.py is: every copy runs there
EXERCISE, ANSWER = "your-turn", "answer"                         # the cells' tags
STATUSES = ("done", "not attempted", "wrong", "not run")


@dataclass(frozen=True)
class Grade:
    """One exercise of one notebook: its check's name, its status (STATUSES) and what was said."""

    notebook: str
    exercise: str
    status: str
    said: str


def tagged(cell, tag: str) -> bool:
    return tag in cell.metadata.get("tags", [])


def exercises(notebook) -> list[tuple[int, int, str]]:
    """Each exercise as (its "your turn" cell, its check cell, the check's name): the check cell is
    the one after the exercise's folded answer."""
    cells, found = notebook.cells, []
    for i, cell in enumerate(cells):
        if tagged(cell, EXERCISE):
            answer = next(j for j in range(i + 1, len(cells)) if tagged(cells[j], ANSWER))
            named = re.search(r"\b(check_\w+)\(", cells[answer + 1].source)
            found.append((i, answer + 1, named[1] if named else f"exercise at cell {i}"))
    return found


def _printed(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.output_type == "stream").strip()


def _raised(cell) -> Optional[str]:
    errors = [o for o in cell.get("outputs", []) if o.output_type == "error"]
    return f"{errors[0].ename}: {errors[0].evalue}" if errors else None


def grades_of(name: str, notebook, stopped: Optional[str] = None, ran: Optional[int] = None) -> list[Grade]:
    """The grades read off `notebook` as executed: its cells up to `ran` (all, if None) have run, and
    `stopped` says why the rest did not."""
    grades, cells = [], notebook.cells
    for turn, check, exercise in exercises(notebook):
        if ran is not None and check >= ran:
            grades.append(Grade(name, exercise, "not run", stopped or "the notebook stopped before this check"))
        elif _raised(cells[turn]):
            grades.append(Grade(name, exercise, "wrong", f"your cell raised {_raised(cells[turn])}"))
        elif _raised(cells[check]):
            grades.append(Grade(name, exercise, "wrong", f"the check raised {_raised(cells[check])}"))
        else:
            line = (_printed(cells[check]).splitlines() or [""])[0]
            status = {"✓": "done", "…": "not attempted", "✗": "wrong"}.get(line[:1], "wrong")
            said = line.lstrip("✓…✗ ").removeprefix("not attempted yet: ")
            grades.append(Grade(name, exercise, status, said or "its check printed nothing"))
    return grades


def read_lesson(path: Path):
    """The notebook at `path`; ValueError, saying what is wrong, if it is not one of the lessons."""
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    try:
        notebook = nbformat.read(path, as_version=4)
    except Exception as error:  # nbformat's errors name a JSON or schema fault: said, not raised
        raise ValueError(f"{path}: not a notebook ({type(error).__name__}: "
                         f"{str(error).splitlines()[0][:120]})") from None
    if not any(tagged(cell, EXERCISE) for cell in notebook.cells):
        raise ValueError(f"{path}: no exercises (cells tagged {EXERCISE!r}): not one of the lab's lessons")
    return notebook


def grade(name: str, notebook, seconds: float, quick: bool = True) -> list[Grade]:
    """Run `notebook` (a lesson `read_lesson` read, graded as `name`) top to bottom in a fresh kernel,
    in the lab's notebooks/ folder (where a lesson finds lab_setup.py, wherever its copy lives), at
    CI's small sizes unless not `quick`. A cell that raises does not stop the run, as a learner's Run
    All would not if every check is to be read; past `seconds` in all the kernel is stopped and the
    rest is not run."""
    client = NotebookClient(notebook, timeout=seconds, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    deadline, stopped, ran = time.monotonic() + seconds, None, None
    env = {**os.environ, **({"GPIPE_LAB_QUICK": "1"} if quick else {})}
    with client.setup_kernel(env=env):
        for index, cell in enumerate(notebook.cells):
            client.timeout = max(1, int(deadline - time.monotonic()))
            try:
                client.execute_cell(cell, index)
            except CellTimeoutError:
                stopped, ran = f"the notebook ran past its {seconds:g} s at cell {index}", index
                break
    return grades_of(name, notebook, stopped, ran)
