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
