"""`python -m lab.train`: the same training with stage threads, and with one process per stage
launched by two torchrun agents ("nodes") meeting on loopback."""
import re
import subprocess
import sys

import pytest

from lab.launch import ROOT, two_nodes

ARGS = ["--steps", "12", "--log-every", "4", "--blocks", "2", "--width", "32", "--batch", "16"]


def losses(output: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step +\d+ +loss ([\d.]+) +samples/s +[\d.]+$", output, re.M)]


@pytest.mark.timeout(180)
def test_threads_and_two_nodes_train_the_same_model():
    plain = subprocess.run([sys.executable, "-m", "lab.train", *ARGS], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
    assert plain.returncode == 0, plain.stderr
    assert "threads: 2 stage threads" in plain.stdout
    expected = losses(plain.stdout)
    assert len(expected) == 3 and expected[-1] < expected[0]

    outputs = two_nodes(["-m", "lab.train", *ARGS], "train-test", timeout=150, done=lambda: False)
    printed = next(out for out in outputs if "# lab.train" in out)  # rank 0's agent
    assert "processes: 2 ranks over torch.distributed (gloo)" in printed
    assert losses(printed) == expected  # bit for bit the same losses
    assert re.search(r"each boundary carried [\d.]+ kB forward and [\d.]+ kB back", printed)


def test_bad_arguments_exit_with_one_line():
    result = subprocess.run([sys.executable, "-m", "lab.train", "--steps", "0"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and "--steps 0: expected >= 1" in result.stderr
