"""Stage processes start clean from any parent: each kind of parent a user has runs a K=2 step
with the stages as processes, and no stage process imports or re-runs the parent's main module
(the parent prints a marker once; a child that re-ran it would print it again)."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from lab.machine.process_tree import children

ROOT = Path(__file__).resolve().parents[3]
MARKER = "main module ran"
STEP = textwrap.dedent(f"""\
    import json
    print({MARKER!r}, flush=True)
    from lab.config import RunConfig
    from lab.runs.experiments import run
    record = run(RunConfig(model="mlp", blocks=4, width=128, batch=32, stages=2, micro_batches=4,
                           transport="processes"))
    print(json.dumps({{"loss": record.loss, "transport": record.transport,
                      "stages": sorted({{e["stage"] for e in record.events}})}}), flush=True)
    """)
GUARDED = "def main():\n" + textwrap.indent(STEP, "    ") + "\n\nif __name__ == '__main__':\n    main()\n"
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def check_output(output: str) -> None:
    assert output.count(MARKER) == 1, f"the parent's main module ran more than once:\n{output[-2000:]}"
    result = json.loads(output.strip().splitlines()[-1])
    assert result["transport"] == "processes" and result["stages"] == [0, 1] and result["loss"] > 0


def run_parent(command, tmp_path, stdin=None, env=ENV):
    before = set(children(os.getpid()))  # an earlier test's shared stage pool may live on, by design
    done = subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=150, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Error" not in done.stderr, done.stderr[-3000:]
    check_output(done.stdout)
    assert not set(children(os.getpid())) - before, "no process is left behind"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("parent", ["guarded script", "unguarded script", "unguarded, children not forked",
                                    "standard input", "python -c", "torchrun worker"])
def test_a_step_with_stage_processes_runs_from_any_parent(tmp_path, parent):
    """"children not forked": each stage process a fresh `python -m lab.processes.child` (GPIPE_WARM_FORK=0, as
    on a host without fork and pidfds), instead of forked from the warm forker (lab/processes/forker.py)."""
    script = tmp_path / "train.py"
    script.write_text(GUARDED if parent == "guarded script" else STEP)
    command = {"guarded script": [sys.executable, str(script)],
               "unguarded script": [sys.executable, str(script)],
               "unguarded, children not forked": [sys.executable, str(script)],
               "standard input": [sys.executable, "-"],
               "python -c": [sys.executable, "-c", STEP],
               "torchrun worker": [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   "--nproc-per-node", "1", str(script)]}[parent]
    run_parent(command, tmp_path, stdin=STEP if parent == "standard input" else None,
               env={**ENV, "GPIPE_WARM_FORK": "0"} if "not forked" in parent else ENV)


@pytest.mark.timeout(180)
def test_a_step_with_stage_processes_runs_from_a_jupyter_kernel(tmp_path):
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        f"import sys; sys.path.insert(0, {str(ROOT)!r})\n" + STEP)])
    NotebookClient(notebook, timeout=150, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
                   ).execute()
    outputs = notebook.cells[0].outputs
    assert not [o for o in outputs if o.output_type == "error"], outputs
    check_output("".join(o.get("text", "") for o in outputs if o.output_type == "stream" and o.name == "stdout"))
