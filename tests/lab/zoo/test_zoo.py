"""The zoo: a model is one file with its card, read without torch; a card that lacks a field is
refused with the field named; a model added by one file appears in the app's picker, in runs, in
`python -m lab.reproduce --model` and in the notebooks' table of the zoo, touching nothing else."""
import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import asdict
from pathlib import Path

import pytest

from lab import zoo
from lab.zoo.cards import Card, read_card

ROOT = Path(__file__).resolve().parents[3]
TOY_CARD = ('CARD = Card(name="toy", description="a throwaway stack of Linear+Tanh blocks", extra_layers=0,\n'
            '            page_blocks=4, page_widths=(8, 16), page_batches=(8, 32), page_width=8, page_batch=32,\n'
            '            test_width=8, cpu_table=((8, 8), (8, 16)), gpu_table=((8, 8), (8, 16)), sequence=0)\n')
TOY = '"""A throwaway model, written as a contributor would add one."""\n' + textwrap.dedent('''\
    import torch
    import torch.nn.functional as F
    from torch import nn

    from lab.zoo.cards import Card

    ''') + TOY_CARD + textwrap.dedent('''\


    def build(blocks, width, seed=0):
        torch.manual_seed(seed)
        return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(blocks)])


    def batch(size, width, seed=0):
        x = torch.randn(size, width, generator=torch.Generator().manual_seed(seed))
        return x, x.flip(1)


    loss = F.mse_loss
    ''')
# What a learner or a contributor meets, in the copy with the toy: the app's picker and a page on
# the toy, a run with stages as processes, the reproduction command's check, the notebooks' table.
USE_IT = textwrap.dedent('''\
    from streamlit.testing.v1 import AppTest
    import lab.config
    from lab import reproduce
    from lab.config import RunConfig
    from lab.runs import experiments
    from lab.views import tables
    lab.config.APP_DEFAULT = lab.config.APP_DEFAULT.but(model="mlp", blocks=2, width=128, batch=16, stages=2,
                                                        micro_batches=2, transport="threads")
    at = AppTest.from_file("app.py", default_timeout=120).run()
    print("picker", any(option.startswith("toy") for option in at.selectbox(key="model").options))
    at.selectbox(key="model").set_value("toy").run()
    print("page", not at.exception and not at.error)
    record = experiments.run(RunConfig(model="toy", blocks=4, width=8, batch=8, stages=2, micro_batches=2,
                                       transport="processes"))
    print("run", record.balance, len(record.events) > 0)
    reproduce.check(reproduce.parser().parse_args(["speedup", "--model", "toy", "--quick"]))
    print("reproduce", True)
    print("notebooks", "toy" in set(tables.zoo()["model"]))
    ''')


def copy_with(folder: Path, toy: str) -> Path:
    """engine/, lab/ and app.py copied, caches left out, and lab/zoo/toy.py added."""
    for part in ("engine", "lab"):
        shutil.copytree(ROOT / part, folder / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "app.py", folder / "app.py")
    (folder / "lab" / "zoo" / "toy.py").write_text(toy)
    return folder


def test_the_cards_are_read_without_torch():
    code = "import sys, lab.zoo; print(sorted(lab.zoo.CARDS), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.stdout.split()[-1] == "False", out.stdout + out.stderr
    assert set(zoo.CARDS) >= {"mlp", "transformer", "cnn", "resnet"}


@pytest.mark.parametrize("card, said", [
    ('CARD = Card(name="toy", description="x", extra_layers=0)', "its CARD lacks page_blocks, page_widths"),
    (TOY_CARD.replace('name="toy"', 'name="other"'), "its CARD is named 'other'; expected the file's name, 'toy'"),
    ("CARD = Card(name=NAME)", "its CARD must be written in plain values"),
    ("CARDS = []", "a zoo model file opens with CARD = Card(name=..., ...), keywords only"),
])
def test_a_card_that_is_incomplete_or_not_plain_is_refused_naming_what_it_lacks(tmp_path, card, said):
    path = tmp_path / "toy.py"
    path.write_text(f"from lab.zoo.cards import Card\n{card}")
    with pytest.raises(ValueError, match=re.escape(f"toy.py: {said}")):
        read_card(path)


def test_a_card_whose_first_setting_its_page_does_not_offer_is_refused(tmp_path):
    (tmp_path / "toy.py").write_text(TOY)
    with pytest.raises(ValueError, match=re.escape("the toy's card: page_width=64 is not among (8, 16)")):
        Card(**{**asdict(read_card(tmp_path / "toy.py")), "page_width": 64})


@pytest.mark.timeout(240)
def test_a_model_added_by_one_file_appears_everywhere_a_model_is_chosen(tmp_path):
    project = copy_with(tmp_path, TOY)
    done = subprocess.run([sys.executable, "-c", USE_IT], capture_output=True, text=True, timeout=200, cwd=project,
                          env={**os.environ, "GPIPE_LAB_ROUNDS": "1", "PYTHONPATH": str(project)})
    said = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    assert said == {"picker": "True", "page": "True", "run": "[2, 2] True", "reproduce": "True",
                    "notebooks": "True"}, done.stdout + done.stderr[-3000:]


def test_a_model_file_without_its_functions_is_refused_naming_them(tmp_path):
    project = copy_with(tmp_path, TOY.replace("loss = F.mse_loss\n", ""))
    code = "from lab import zoo\ntry:\n    zoo.get('toy')\nexcept ValueError as error:\n    print(error)\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=project)
    assert done.stdout.strip().endswith("toy.py: a zoo model file defines build, batch and loss; it lacks loss"), \
        done.stdout + done.stderr
