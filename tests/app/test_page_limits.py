"""What a page may ask for: every control is bounded, and neither a query string nor a session
edited by hand starts work beyond the bounds (lab.config.check_page)."""
import pytest
from test_app import app, shipped_app  # noqa: F401  (the fixtures: a fresh server's page, nothing cached)

from lab import config
from lab.config import APP_DEFAULT, check_page
from lab.processes import shared as processes
from lab.runs import experiments


@pytest.fixture
def started(monkeypatch):
    """What the page starts, recorded instead of run: the settings of each run and of each pool."""
    asked = []

    def run(config, **options):
        asked.append(config)
        raise RuntimeError("not run by this test")
    monkeypatch.setattr(experiments, "run", run)
    monkeypatch.setattr(processes, "start_ahead", lambda stages, *rest: asked.append(APP_DEFAULT.but(stages=stages)))
    return asked


@pytest.mark.parametrize("key,value", [("stages", 100), ("micro", 10 ** 6), ("blocks-transformer", 500),
                                       ("micro", "16"), ("width-transformer", 4096), ("batch-transformer", 10 ** 6),
                                       ("seed", -5), ("model", "gpt-5")])
def test_a_session_edited_by_hand_runs_nothing_beyond_the_controls(shipped_app, started, key, value):  # noqa: F811
    app = shipped_app  # the shipped default: its Transformer's controls are the ones edited  # noqa: F811
    app.session_state[key] = value
    app.run()
    assert not app.exception, app.exception
    assert started, "the page ran its default setting instead"
    for asked in started:
        check_page(asked)
    if key in ("stages", "micro", "blocks-transformer"):
        assert any(f"{value!r} is not one of" in w.value for w in app.sidebar.warning)


def test_a_query_string_changes_nothing(shipped_app, started):  # noqa: F811
    app = shipped_app  # noqa: F811
    for key, value in {"stages": "100", "micro": "100000", "width": "65536", "model": "x"}.items():
        app.query_params[key] = value
    app.run()
    assert not app.exception and {c.stages for c in started} == {APP_DEFAULT.stages}


def test_every_setting_beyond_a_control_is_refused(monkeypatch):
    check_page(APP_DEFAULT)
    for changes in (dict(stages=9), dict(micro_batches=65), dict(width=4096), dict(batch=128), dict(blocks=7),
                    dict(seed=10_001), dict(schedule="interleaved", virtual_stages=5), dict(virtual_stages=2),
                    dict(threads_per_stage=2)):
        with pytest.raises(ValueError, match="beyond what this page offers"):
            check_page(APP_DEFAULT.but(**changes))
    monkeypatch.setenv("GPIPE_LAB_ROUNDS", str(config.MAX_ROUNDS + 1))
    with pytest.raises(ValueError, match=f"from 1 to {config.MAX_ROUNDS}"):
        config.measure_rounds()


def test_a_session_keeps_the_last_pins_only(app):  # noqa: F811
    for key, value in dict(model="mlp", stages=3, micro=2, transport="threads").items():
        app.session_state[key] = value  # a small setting from the first run on
    app.run()
    app.button(key="pin").click().run()
    app.session_state["pinned"] = app.session_state["pinned"] * (config.PAGE_PINS + 4)
    app.button(key="pin").click().run()
    assert len(app.session_state["pinned"]) == config.PAGE_PINS and not app.exception
