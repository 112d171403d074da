"""`python -m lab.check` on four models the project did not write for it (tests/helpers/own_models.py):
the exactness table right for each, a plan under a budget that the model then runs within, the page
with its charts in Chromium, and every bad input one line naming what was wrong and what was expected."""
import shutil
from pathlib import Path

import pytest

from lab import check
from lab.yours.model import take

HELPERS = Path(__file__).resolve().parents[1] / "helpers" / "own_models.py"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def report(name: str, shape, budget=None, stages=(1, 2, 4), micro=(1, 4)):
    made = check.made_by(f"{HELPERS}:{name}")
    return check.Report(take(made, name, shape), list(stages), list(micro), budget)


@pytest.fixture(scope="module")
def reports():
    return {"resnet": report("resnet", (16, 3, 8, 8)), "tied_transformer": report("tied_transformer", (8, 12)),
            "dropout_mlp": report("dropout_mlp", (32, 64), budget=2 ** 20),
            "batch_centered": report("batch_centered", (32, 32))}


def rows(found, m):
    return {r.stages: r for r in found.exactness if r.micro_batches == m}


def test_batch_norm_and_a_layer_that_sees_the_batch_are_explained_and_do_not_depend_on_k(reports):
    for name, why in (("resnet", "batch norm: in training each micro-batch is normalized with its own statistics"),
                      ("batch_centered", "a layer depends on the batch as a whole")):
        assert all(r.largest_abs == 0 for r in rows(reports[name], 1).values()), name  # M=1: the whole batch
        split = rows(reports[name], 4)
        assert all(r.same_bits_as_k1 and r.cause.startswith(why) and r.largest_rel > 1e-3 for r in split.values())
    assert "with deferred_batch_norm=True" in reports["resnet"].statistics
    assert reports["batch_centered"].statistics is None


def test_dropout_streams_are_the_same_bits_for_every_k_and_the_difference_from_one_device_is_named(reports):
    for m in (1, 4):
        for r in rows(reports["dropout_mlp"], m).values():
            assert r.same_bits_as_k1 and r.cause.startswith("dropout: the pipeline draws each micro-batch's masks")


def test_tied_weights_are_refused_across_stages_naming_the_layers(reports):
    found = rows(reports["tied_transformer"], 4)
    assert found[2].refused.startswith("layer '0' (stage 0) and layer '5' (stage 1) share a parameter")
    assert found[1].same_bits_as_k1 and not found[1].refused
    assert set(reports["tied_transformer"].best) == {1}, "no plan cuts the tied layers apart"


def test_the_plan_fits_the_budget_and_the_model_then_runs_within_it(reports):
    found = reports["dropout_mlp"]
    assert found.chosen.peak_bytes <= 2 ** 20 and max(found.ran) <= 2 ** 20
    assert all(p.peak_bytes <= 2 ** 20 for p in found.best.values())
    assert found.chosen.step_seconds == min(p.step_seconds for p in found.best.values())
    assert sorted(e.stage for e in found.trace.events) == sorted(
        k for k in range(found.chosen.stages) for _ in range(len([e for e in found.trace.events if e.stage == k])))
    lines = "\n".join(found.lines())
    assert "within the budget of 1.0 MiB" in lines and "## Memory per stage" in lines


def test_every_stage_is_counted_beside_the_allocator(reports):
    for found in reports.values():
        assert len(found.allocator) == found.chosen.stages
        assert all(m.allocator > 0 and m.total > 0 for m in found.allocator)


def test_the_page_opens_in_chromium_with_its_charts(reports, tmp_path):
    playwright = pytest.importorskip("playwright.sync_api")
    page_file = tmp_path / "check.html"
    page_file.write_text(reports["resnet"].page())
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        try:
            page = browser.new_page()
            page.goto(page_file.as_uri())
            page.wait_for_function("document.querySelectorAll('.js-plotly-plot .main-svg').length >= 5",
                                   timeout=60_000)
            titles = page.evaluate("[...document.querySelectorAll('.gtitle')].map(title => title.textContent)")
        finally:
            browser.close()
    assert any("Gradients against one device" in t for t in titles) and any("measured here" in t for t in titles)


@pytest.mark.parametrize("argv, said", [
    (["no_such_module_anywhere:build"], "no_such_module_anywhere does not import (ModuleNotFoundError"),
    (["build"], "'build': expected MODULE:FUNCTION"),
    ([f"{HELPERS}:nothing_here"], "has no function 'nothing_here'"),
    ([f"{HELPERS}:a_number"], "returned int; expected an nn.Sequential, or (model, inputs), or (model, (inputs,"),
    ([f"{HELPERS}:dropout_mlp"], "returned a model without a batch: give --shape"),
    ([f"{HELPERS}:dropout_mlp", "--shape", "8,16"], "--shape 8,16 does not fit layer 0 (0: Sequential)"),
    ([f"{HELPERS}:skipping", "--shape", "8,8"], "Skipping's forward does more after 'third' than return its output"),
    ([f"{HELPERS}:batch_centered", "--shape", "16,32", "--budget", "1KiB", "--stages", "1", "2",
      "--micro-batches", "1"], "--budget 1.0 KiB: no plan fits; the smallest budget one fits is"),
    ([f"{HELPERS}:batch_centered", "--shape", "16,32", "--device", "cuda"], "--device 'cuda': the check runs"),
])
def test_bad_input_gets_one_line_naming_what_was_wrong_and_what_was_expected(argv, said, capsys):
    assert check.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("python -m lab.check: error: ") and said in err, err


def test_a_module_whose_forward_is_a_chain_of_its_children_is_taken_as_one(tmp_path, capsys):
    assert check.main([f"{HELPERS}:chained", "--shape", "16,8", "--stages", "1", "2", "--micro-batches", "1", "2",
                       "--out", str(tmp_path / "chained.html")]) == 0
    out = capsys.readouterr().out
    assert "Chained taken as the chain of its children (first, second, third)" in out
    assert (tmp_path / "chained.html").read_text().startswith("<!doctype html>")
