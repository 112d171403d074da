"""`python -m lab.train`: the same training with stage threads, and with one process per stage
launched by two torchrun agents ("nodes") meeting on loopback."""
import re
import subprocess
import sys

import pytest

from lab import train
from lab.machine.torchrun import ROOT, two_nodes

ARGS = ["--steps", "12", "--log-every", "4", "--blocks", "2", "--width", "32", "--batch", "16"]


def losses(output: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step +\d+ +loss ([\d.]+) +samples/s +[\d.]+$", output, re.M)]


@pytest.mark.timeout(180)
def test_threads_and_two_nodes_train_the_same_model(capsys):
    """The threads' run in this process (the command line's parsing is the same function), then
    two torchrun agents: the same losses bit for bit."""
    assert train.main(ARGS) == 0
    plain = capsys.readouterr().out
    assert "threads: 2 stage threads" in plain
    expected = losses(plain)
    assert len(expected) == 3 and expected[-1] < expected[0]

    outputs = two_nodes(["-m", "lab.train", *ARGS], "train-test", timeout=150, done=lambda: False)
    printed = next(out for out in outputs if "# lab.train" in out)  # rank 0's agent
    assert "processes: 1 pipeline(s) of 2 ranks over torch.distributed (gloo)" in printed
    assert losses(printed) == expected  # bit for bit the same losses
    assert re.search(r"each boundary carried [\d.]+ kB forward and [\d.]+ kB back", printed)


@pytest.mark.timeout(180)
def test_two_pipelines_as_replicas_train_as_one_pipeline_does(capsys):
    """torchrun --nproc-per-node 4 -m lab.train --stages 2 --data-parallel 2: a 2 x 2 mesh. Each
    replica takes half of every batch in M micro-batches numbered globally; the losses follow one
    pipeline of 2M micro-batches (the same dropout masks) up to float32 rounding. The mesh runs ZB-V,
    whose last chunk sits on the first stage's rank: that rank takes the inputs and the targets."""
    assert train.main([*ARGS, "--micro-batches", "16"]) == 0
    plain = capsys.readouterr().out
    mesh = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                           "-m", "lab.train", *ARGS, "--stages", "2", "--data-parallel", "2", "--micro-batches", "8",
                           "--schedule", "zb-v"], cwd=ROOT,
                          capture_output=True, text=True, timeout=150)
    assert mesh.returncode == 0, mesh.stderr[-3000:]
    assert "processes: 2 pipeline(s) of 2 ranks over torch.distributed (gloo)" in mesh.stdout
    assert "zb-v (v=2)" in mesh.stdout
    assert losses(mesh.stdout) == pytest.approx(losses(plain), rel=1e-4)
    assert re.search(r"each stage all-reduced [\d.]+ kB, [\d.]+ kB of gradients with its 1 replica", mesh.stdout)


def test_bad_arguments_exit_with_one_line(capsys):
    assert train.main(["--steps", "0"]) == 2
    assert capsys.readouterr().err.strip() == "python -m lab.train: error: --steps 0: expected >= 1"
    assert train.main(["--data-parallel", "2"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "needs one process per stage and replica: torchrun" in line


def test_every_schedule_trains_with_the_chunks_per_stage_it_needs(capsys):
    """`--schedule interleaved` places two chunks per stage unless told (it crashed without an option
    for them); chunks per stage a schedule refuses are one line naming the rule."""
    small = ["--steps", "1", "--blocks", "2", "--width", "16", "--batch", "8", "--micro-batches", "4"]
    assert train.main([*small, "--schedule", "interleaved"]) == 0
    assert "interleaved (v=2)" in capsys.readouterr().out
    assert train.main([*small, "--schedule", "interleaved", "--virtual-stages", "3", "--blocks", "4"]) == 0
    assert train.main([*small, "--schedule", "1f1b", "--virtual-stages", "2"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "python -m lab.train: error: virtual_stages=2: schedule='1f1b' places 1 chunk on a stage; several chunks per "
        "stage: schedule='interleaved', 'zb-v'"]


def test_recompute_chosen_per_stage_trains_as_without_it(capsys):
    """`--checkpoint always,never`: stage 0 alone recomputes; the losses are those of no recompute,
    bit for bit. A count of modes that is not K, or "as_written" (for hand-written schedules), is one line."""
    small = ["--steps", "2", "--log-every", "1", "--blocks", "2", "--width", "16", "--batch", "8"]
    assert train.main([*small, "--checkpoint", "never"]) == 0
    plain = losses(capsys.readouterr().out)
    assert train.main([*small, "--checkpoint", "always,never"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint always,never;" in out and losses(out) == plain
    assert train.main([*small, "--checkpoint", "always,never,never"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "python -m lab.train: error: checkpoint=('always', 'never', 'never') names 3 modes for 2 stages: expected "
        "one mode, or one per stage"]
    with pytest.raises(SystemExit):
        train.main([*small, "--checkpoint", "as_written"])
    assert "'as_written' is for a schedule written by hand" in capsys.readouterr().err
