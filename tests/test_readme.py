"""The README's promises that a test can check: CI runs its test command verbatim."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands():
    block = re.search(r"## Set-up: two commands.*?```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_ci_runs_the_readme_test_command_verbatim():
    main_job, tests = readme_commands()
    assert main_job.endswith("streamlit run app.py")
    assert tests.endswith("python -m pytest")
    ci_lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci_lines[-1] == tests


def test_requirements_pin_cpu_friendly_torch():
    assert "torch==2.13.0" in (ROOT / "requirements.txt").read_text().splitlines()


def test_ui_layers_only_call_lab_and_engine_knows_no_ui():
    import json
    sources = {"app.py": (ROOT / "app.py").read_text()}
    for path in (ROOT / "notebooks").glob("*.ipynb"):
        cells = json.loads(path.read_text())["cells"]
        sources[path.name] = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    for name, source in sources.items():
        assert not re.search(r"^\s*(from|import) engine", source, re.M), name
    for path in list((ROOT / "engine").glob("*.py")) + list((ROOT / "lab").glob("*.py")):
        assert not re.search(r"^\s*(from|import) (streamlit|ipywidgets|IPython)", path.read_text(), re.M), path.name
