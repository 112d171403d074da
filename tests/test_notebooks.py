"""Every notebook runs end to end (small sizes, GPIPE_LAB_QUICK=1) and is committed without outputs."""
import json
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_eight_numbered_notebooks():
    assert [p.name[:3] for p in NOTEBOOKS] == [f"{i:02d}_" for i in range(1, 9)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    notebook = json.loads(path.read_text())
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None


@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_runs_end_to_end(path, monkeypatch):
    monkeypatch.setenv("GPIPE_LAB_QUICK", "1")
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    text = "".join(c.source for c in notebook.cells if c.cell_type == "markdown")
    assert "<details>" in text and "After this notebook you can" in text
    assert any("assert" in c.source for c in notebook.cells if c.cell_type == "code")
