"""Every notebook runs end to end (small sizes, GPIPE_LAB_QUICK=1) both ways a learner meets it:
as committed, every "your turn" cell still blank (Run All runs every cell, and each check says
"not attempted yet"), then, in the same kernel, each folded answer with its check (every check
passes). The notebooks whose claims depend on the host's size also run as if the host had
1, 8 or 16 parallel devices, where that takes them down another branch than this host does.
They are committed without outputs."""
import json
import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from lab.config import RunConfig
from lab.lessons import grading
from lab.lessons.grading import tagged
from lab.runs.experiments import parallel_devices

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
DECIDING_K = {"03_micro_batches_fill_the_pipe": (4,), "04_speedup_table": (2, 4, 8), "08_what_came_next": (4,)}
# (notebook, parallel devices it runs as if the host had): each notebook above measures a K that is
# an ideal replay where K exceeds the host's devices and a measurement where it does not; a host
# size runs where it takes a branch this host never takes (on 2 devices: 03 and 08 at 16)
OTHER_HOSTS = [("03_micro_batches_fill_the_pipe", 1), ("03_micro_batches_fill_the_pipe", 16),
               ("04_speedup_table", 1), ("04_speedup_table", 8), ("08_what_came_next", 16)]


def runs_other_branches(stem: str, devices: int) -> bool:
    """Whether a host of `devices` takes a branch (replay or measurement) that this host takes at no
    K the notebook measures: the claims code is the same at every K, so a host size whose branches
    this host's run as committed already took somewhere repeats what that run checked."""
    here = parallel_devices(RunConfig())
    return bool({k <= devices for k in DECIDING_K[stem]} - {k <= here for k in DECIDING_K[stem]})


HOST_SIZES = [(stem, str(devices)) for stem, devices in OTHER_HOSTS
              if "GPIPE_LAB_DEVICES" in os.environ or runs_other_branches(stem, devices)]


def answered(notebook):
    """The notebook with each "your-turn" cell replaced by the code of the folded answer after it."""
    cells = notebook.cells
    for i, cell in enumerate(cells):
        if tagged(cell, "your-turn"):
            answer = next(c for c in cells[i + 1:] if tagged(c, "answer"))
            cell.source = re.search(r"```python\n(.*?)\n```", answer.source, re.S).group(1)
    return notebook


def execute(path: Path, monkeypatch, devices: str = None):
    monkeypatch.setenv("GPIPE_LAB_QUICK", "1")
    if devices:
        monkeypatch.setenv("GPIPE_LAB_DEVICES", devices)
    notebook = answered(nbformat.read(path, as_version=4))
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    return notebook


def test_the_numbered_notebooks():
    assert [p.name[:3] for p in NOTEBOOKS] == [f"{i:02d}_" for i in range(0, 13)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs_and_shaped_as_a_lesson(path):
    notebook = json.loads(path.read_text())
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None
    cells = nbformat.reads(path.read_text(), as_version=4).cells
    assert cells[1].source == "from lab_setup import *  # the project on the path, QUICK for CI, display helpers " \
                              "(notebooks/lab_setup.py)"
    text = "".join(c.source for c in cells if c.cell_type == "markdown")
    assert "After this notebook you can" in text and "Check your understanding" in text
    assert text.count("<details>") >= 4, "predict prompts and questions carry folded answers"
    assert any("assert" in c.source and "Claims of this notebook" in c.source for c in cells if c.cell_type == "code")
    for i, cell in enumerate(cells):
        if tagged(cell, "your-turn"):
            answer = next((c for c in cells[i + 1:] if tagged(c, "answer")), None)
            assert answer is not None and "<details>" in answer.source and "```python" in answer.source
            assert "check_" in cells[cells.index(answer) + 1].source, "a check cell follows every answer"
            hint = cells[cells.index(answer) - 1]  # first a hint, which points the way without the answer
            assert tagged(hint, "hint") and hint.source.startswith("<details><summary>Show a hint</summary>")
            assert "```" not in hint.source, "a hint holds no code"


def test_most_notebooks_are_labs():
    turns = [p.stem for p in NOTEBOOKS if any(tagged(c, "your-turn") for c in nbformat.read(p, as_version=4).cells)]
    assert len(turns) >= 8, turns


@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_run_all_as_committed_then_each_answer(path, monkeypatch):
    """What a learner gets from Run All before doing any exercise: every cell runs (an error in any
    cell fails the test), and each check says that its exercise is not attempted yet. Then, in the
    same kernel, as a learner who fills them in: each folded answer, then its check again, passes.
    (The cells after an exercise run on the lab's reference until then, and on the answer once it
    passes: the same values, so Run All as committed covers them; the host-size runs below execute
    answered notebooks top to bottom.)"""
    monkeypatch.setenv("GPIPE_LAB_QUICK", "1")
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    with client.setup_kernel():
        for index, cell in enumerate(notebook.cells):
            client.execute_cell(cell, index)
        for grade in grading.grades_of(path.stem, notebook):  # as `python -m lab.grade` reads them
            assert grade.status == "not attempted" and "replace" in grade.said and "`...`" in grade.said, grade
        cells = notebook.cells
        for turn, check, _ in grading.exercises(notebook):  # the learner fills in each "your turn" cell
            cells[turn].source = re.search(r"```python\n(.*?)\n```", cells[check - 1].source, re.S).group(1)
            client.execute_cell(cells[turn], turn)
            client.execute_cell(cells[check], check)
        for grade in grading.grades_of(path.stem, notebook):
            assert grade.status == "done", f"the folded answer should pass its check: {grade}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("stem,devices", HOST_SIZES, ids=[f"{s[:2]}-{d}-devices" for s, d in HOST_SIZES])
def test_runs_on_other_host_sizes(stem, devices, monkeypatch):
    execute(next(p for p in NOTEBOOKS if p.stem == stem), monkeypatch, devices)
