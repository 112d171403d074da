"""The app on a host with GPUs, faked: the GPU count the app reads without torch, CUDA's presence for
the configuration's checks, and runs that compute on the CPU while the page believes they ran on GPUs."""
from dataclasses import replace

import pytest
from test_app import app, shipped_app  # noqa: F401  (the fixtures: a fresh server, three measured rounds)

import lab.config
import lab.machine.gpus
import lab.machine.host
import lab.runs.experiments
import lab.timelines.breakdown


@pytest.fixture
def two_gpus(monkeypatch):
    """A host with two GPUs in Default compute mode as the page sees it; every run computes on the CPU."""
    real = lab.runs.experiments.run

    def on_the_cpu(config, **options):
        record = real(config.but(device="cpu"), **options)
        record.config["device"] = config.device
        return record
    monkeypatch.setattr(lab.machine.gpus, "visible_gpus", lambda: 2)
    monkeypatch.setattr(lab.config, "_cuda_available", lambda: True)
    monkeypatch.setattr(lab.machine.host, "exclusive_gpus", lambda: False)
    monkeypatch.setattr(lab.runs.experiments, "run", on_the_cpu)
    alone = lab.timelines.breakdown.alone_events  # the serial step behind "where the time went" computes on the CPU too
    monkeypatch.setattr(lab.timelines.breakdown, "alone_events",
                        lambda record: alone(replace(record, config={**record.config, "device": "cpu"})))


def test_stages_on_gpus_are_measured_as_processes_too_and_k1_runs_on_one_gpu(app, two_gpus):  # noqa: F811
    app.run()
    app.selectbox(key="model").set_value("mlp").run()
    app.radio(key="device").set_value("cuda")
    for key, value in (("stages", 2), ("micro", 4), ("batch-mlp", 16), ("width-mlp", 128)):
        (app.slider if key in ("stages", "micro") else app.select_slider)(key=key).set_value(value)
    app.run()
    assert not app.exception and not app.error
    captions = [c.value for c in app.caption]
    assert any("one stage on one GPU" in c for c in captions) and not any("on one core" in c for c in captions)
    app.button(key="other_transport").click().run()     # one process per GPU: it used to crash the page
    assert not app.exception and not app.error
    compared = app.dataframe[0].value
    assert list(compared["stages run as"]) == ["threads", "processes"] and (compared["step (ms)"] > 0).all()


def test_on_exclusive_gpus_stages_as_processes_are_not_offered_and_say_why(app, two_gpus, monkeypatch):  # noqa: F811
    """EXCLUSIVE_PROCESS GPUs serve one process each: once this server holds a CUDA context (its
    threads ran there), a stage process cannot meet it on its GPU. The button is not offered; the
    caption names the mode (the pool's refusal used to reach the page as a traceback)."""
    import torch
    monkeypatch.setattr(lab.machine.host, "exclusive_gpus", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    app.run()
    app.selectbox(key="model").set_value("mlp").run()
    app.radio(key="device").set_value("cuda").run()
    assert not app.exception and not app.error
    assert not [b for b in app.button if b.key == "other_transport"]
    assert any("not offered" in c.value and "EXCLUSIVE_PROCESS" in c.value for c in app.caption)
