"""The app in a real headless Chromium: it renders the Gantt chart and reacts to the M slider."""
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from launch import children

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
GANTT = "document.querySelector('.js-plotly-plot')"
FINAL_GANTT_READY = f"() => {{ const p = {GANTT}; return p && p.layout && p.layout.title && " \
                    "p.layout.title.text.includes('measured ('); }"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    log = open(log_path, "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", str(ROOT / "app.py"), "--server.headless", "true",
         "--server.address", "127.0.0.1", "--server.port", str(port), "--browser.gatherUsageStats", "false"],
        cwd=ROOT, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).read() == b"ok":
                    break
            except OSError:
                pass
            assert process.poll() is None, "streamlit exited during start-up"
            assert time.monotonic() < deadline, "streamlit did not become healthy within 90 s"
            time.sleep(0.5)
        yield url, log_path
    finally:
        stage_processes = children(process.pid)  # the app's shared stage processes, if it made them
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()
        deadline = time.monotonic() + 10
        while [p for p in stage_processes if alive(p)] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in stage_processes if alive(p)], "stage processes outlived the server"


def problems_in(log_path: Path) -> list[str]:
    """Lines of the server's output that a user would take for trouble: warnings, errors, tracebacks
    (from the server itself or from a stage process, which shares its terminal)."""
    words = ("warning", "error", "traceback", "scriptruncontext", "no runtime found")
    return [line for line in log_path.read_text().splitlines() if any(w in line.lower() for w in words)]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(240)
def test_app_renders_and_the_m_slider_redraws_the_gantt(server, tmp_path):
    server, log_path = server
    playwright = pytest.importorskip("playwright.sync_api")
    assert Path(CHROMIUM).exists(), "Debian chromium is missing: apt-get install -y chromium"
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            page.goto(server)
            page.wait_for_function(FINAL_GANTT_READY, timeout=120_000)
            counts = page.evaluate(f"() => Object.fromEntries({GANTT}.data.map(t => [t.name, t.x.length]))")
            assert {op: counts[op] for op in ("forward", "recompute", "backward")} == \
                {"forward": 16, "recompute": 14, "backward": 16}  # defaults: K=2, M=8
            assert counts.get("sending") == counts.get("receiving") == 16  # by default stages are processes
            assert not problems_in(log_path), "the page load left this in the server's terminal:\n" + \
                "\n".join(problems_in(log_path)[:20])
            page.screenshot(path=str(tmp_path / "app.png"))

            slider = page.locator("[data-testid='stSlider'] input[type='range'][aria-label='micro-batches M']")
            assert slider.input_value() == "8"
            slider.focus()
            for _ in range(3):  # M = 11: torch.chunk cuts N=32 into 11 pieces (8 and 9 would too; 10 would not)
                page.keyboard.press("ArrowRight")
            page.wait_for_function(
                f"() => {{ const p = {GANTT}; return p && p.layout.title.text.includes('measured (') && "
                "p.data[0].x.length === 22; }", timeout=120_000)  # K=2 stages x M=11 forwards
            assert slider.input_value() == "11"
            page.locator("[data-testid='stStatusWidget']").wait_for(state="detached", timeout=120_000)
            assert page.locator("[data-testid='stException']").count() == 0
            page.screenshot(path=str(tmp_path / "app-m11.png"))
            if os.environ.get("GPIPE_LAB_SCREENSHOT"):  # how docs/app.png was made
                shutil.copy(tmp_path / "app-m11.png", os.environ["GPIPE_LAB_SCREENSHOT"])
        finally:
            browser.close()


@pytest.mark.timeout(300)
def test_three_sessions_at_once_share_the_stage_processes_without_errors(server):
    server, log_path = server
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        try:
            pages = [browser.new_context(viewport={"width": 1300, "height": 900}).new_page() for _ in range(3)]
            for page in pages:  # all three at once: do not wait for one page to load before the next
                page.goto(server, wait_until="commit")
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and not all(page.evaluate(FINAL_GANTT_READY) for page in pages):
                time.sleep(0.2)
            for page in pages:
                assert page.evaluate(FINAL_GANTT_READY), "every session draws its measured Gantt"
                title = page.evaluate(f"() => {GANTT}.layout.title.text")
                assert "measured (processes)" in title, title
                assert page.locator("[data-testid='stException']").count() == 0
                assert page.locator("[data-testid='stAlertContentError']").count() == 0
            assert not problems_in(log_path), "\n".join(problems_in(log_path)[:20])
        finally:
            browser.close()
