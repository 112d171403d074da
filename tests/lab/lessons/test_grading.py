"""`python -m lab.grade`: learners' copies of a lesson graded on the CPU, each exercise read off its
check (tests/notebooks/test_notebooks.py reads every committed notebook, as committed and answered,
the same way)."""
import csv

import nbformat
import pytest

from lab import grade as command
from lab.lessons import exercises, grading

ANSWER = "<details><summary>Show an answer</summary>\n\n```python\n{}\n```\n\n</details>"


def lesson(*turns: str) -> nbformat.NotebookNode:
    """A lesson of the lab's shape: its setup cell, then per exercise a "your turn" cell holding `turn`,
    the folded answer, and the check (notebook 03's bubble formula each time)."""
    cells = [nbformat.v4.new_markdown_cell("# A lesson"),
             nbformat.v4.new_code_cell("from lab_setup import *\nfrom lab.lessons import exercises")]
    for turn in turns:
        cells += [nbformat.v4.new_code_cell(turn, metadata={"tags": ["your-turn"]}),
                  nbformat.v4.new_markdown_cell(ANSWER.format("def bubble(K, M):\n    return (K - 1) / (M + K - 1)"),
                                                metadata={"tags": ["answer"]}),
                  nbformat.v4.new_code_cell("print(exercises.check_bubble(bubble))")]
    return nbformat.v4.new_notebook(cells=cells)


BLANK = "# Your turn\ndef bubble(K, M):\n    ..."
RIGHT = "def bubble(K, M):\n    return (K - 1) / (M + K - 1)"
WRONG = "def bubble(K, M):\n    return (K - 1) / M"
BROKEN = "def bubble(K, M)\n    return 0"


@pytest.mark.timeout(180)
def test_a_learners_copy_is_graded_exercise_by_exercise_and_written_as_csv(tmp_path, capsys):
    copy = tmp_path / "alice" / "03_copy.ipynb"  # anywhere: it runs in the lab's notebooks/ folder
    copy.parent.mkdir()
    nbformat.write(lesson(BLANK, RIGHT, WRONG, BROKEN), copy)
    assert command.main([str(copy), "--csv", str(tmp_path / "grades.csv"), "--seconds", "120"]) == 0
    printed = capsys.readouterr().out
    with open(tmp_path / "grades.csv") as f:
        rows = list(csv.DictReader(f))
    assert [row["status"] for row in rows] == ["not attempted", "done", "wrong", "wrong"]
    assert all(row["notebook"] == "03_copy" and row["exercise"] == "check_bubble" for row in rows)
    assert "replace the `...`" in rows[0]["said"]
    wrong = {}
    exec(WRONG, wrong)  # the check's own sentence for that answer, as a learner running it would read it
    assert "✗ " + rows[2]["said"] == exercises.check_bubble(wrong["bubble"]).splitlines()[0]
    assert rows[3]["said"].startswith("your cell raised SyntaxError"), rows[3]
    assert "1 done, 1 not attempted, 2 wrong, 0 not run" in printed


@pytest.mark.timeout(120)
def test_a_notebook_that_runs_past_its_bound_has_the_rest_not_run(tmp_path):
    copy = tmp_path / "endless.ipynb"
    notebook = lesson(RIGHT, RIGHT)
    notebook.cells.insert(5, nbformat.v4.new_code_cell("while True:\n    pass"))  # after the first check
    nbformat.write(notebook, copy)
    grades = grading.grade(copy.stem, grading.read_lesson(copy), seconds=20)
    assert [g.status for g in grades] == ["done", "not run"]
    assert grades[1].said.startswith("the notebook ran past its 20 s at cell 5")


def test_what_is_not_a_lesson_is_refused_in_one_line(tmp_path, capsys):
    plain = tmp_path / "plain.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1")]), plain)
    (tmp_path / "garbled.ipynb").write_text("{ not json")
    for path, says in ((tmp_path / "missing.ipynb", "no such file"), (plain, "no exercises (cells tagged "
                                                                             "'your-turn')"),
                       (tmp_path / "garbled.ipynb", "not a notebook")):
        assert command.main([str(path)]) == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert line.startswith("python -m lab.grade: error: ") and says in line, line
    assert command.main([str(plain), "--seconds", "0"]) == 2
    assert "--seconds 0: expected more than 0" in capsys.readouterr().err
