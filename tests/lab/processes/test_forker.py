"""The warm forker (lab/processes/forker.py): a forked child is what a fresh `python -m lab.processes.child` would be
(the environment, folder and stdout of the moment it is asked for, its own exit code), and the
forker and its children end with their parent."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab.machine.process_tree import descendants, running
from lab.processes import forker
from lab.processes.children import ChildFailed, Children

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(not forker.available(), reason="children are forked on Linux with pidfds only")


class Probe:
    """A child's server: says where it stands, prints, or exits with a code."""

    def __call__(self, command):
        what, value = command
        if what == "where":
            return os.environ.get("GPIPE_TEST_MARK"), os.getcwd(), sys.modules.get("torch") is not None
        if what == "print":
            print(value, flush=True)
            return None
        os._exit(value)


def test_a_forked_child_starts_from_the_parent_as_it_is_at_that_moment(tmp_path, monkeypatch, capfd):
    Children(Probe, [()]).close()  # the forker is up before the parent changes
    monkeypatch.setenv("GPIPE_TEST_MARK", "set after the forker started")
    monkeypatch.chdir(tmp_path)
    children = Children(Probe, [()])
    try:
        assert isinstance(children._processes[0], forker.Forked)
        assert children.ask([("where", None)]) == [("set after the forker started", str(tmp_path), True)]
        children.ask([("print", "a line from the forked child")])
    finally:
        children.close()
    assert "a line from the forked child" in capfd.readouterr().out


@pytest.mark.parametrize("how, code", [("exits with 3", 3), ("is killed", -9)])
def test_a_forked_childs_end_is_reported_with_its_exit_code(how, code):
    children = Children(Probe, [(), ()])
    pid = children.pids[1]
    if how == "is killed":
        children.kill(1)
    with pytest.raises(ChildFailed, match=rf"child 1's process died \(exit codes \{{1: {code}\}}\)"):
        children.ask([("where", None), ("exit", 3)])
    assert not running(pid) and not children.open


def test_the_forker_and_its_children_end_with_their_parent():
    script = (f"import sys, time; sys.path[:0] = [{str(ROOT)!r}]\n"
              "from lab.processes.children import Children\n"
              "from test_forker import Probe\n"
              "children = Children(Probe, [(), ()])\n"
              "print(*children.pids, flush=True)\n"
              "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent)})
    try:
        forked = [int(p) for p in parent.stdout.readline().split()]
        started = descendants(parent.pid)
        assert len(started) == 3 and set(forked) < set(started), "the forker and its two children"
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while [p for p in started if running(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in started if running(p)]


def test_without_warm_forks_each_child_is_a_fresh_interpreter(monkeypatch):
    monkeypatch.setenv("GPIPE_WARM_FORK", "0")
    children = Children(Probe, [()])
    try:
        assert isinstance(children._processes[0], subprocess.Popen)
        imported_torch = children.ask([("where", None)])[0][2]
        # read once it has answered: right after Popen, a loaded host may not have run its exec yet
        assert b"lab.processes.child" in Path(f"/proc/{children.pids[0]}/cmdline").read_bytes()
        assert imported_torch  # it imported torch itself
    finally:
        children.close()


def test_an_interrupted_request_leaves_no_child_and_the_next_gets_its_own(monkeypatch):
    """A request interrupted before its answer came (a notebook's stop button while the forker is
    still importing torch): its child is killed when the answer comes, never handed to the next."""
    from multiprocessing.connection import Pipe

    from lab.machine.process_tree import children as children_of
    warm = forker.forker()
    Children(Probe, [()]).close()
    before = set(children_of(warm.process.pid))
    ours, theirs = Pipe()
    drain = warm._drain

    def interrupted(timeout):
        raise KeyboardInterrupt
    monkeypatch.setattr(warm, "_drain", interrupted)
    with pytest.raises(KeyboardInterrupt):
        warm.start(theirs.fileno(), "interrupted", dict(os.environ))
    monkeypatch.setattr(warm, "_drain", drain)
    children = Children(Probe, [()])
    try:
        assert children.ask([("where", None)])[0][2]
        deadline = time.monotonic() + 10
        while set(children_of(warm.process.pid)) - before - set(children.pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not set(children_of(warm.process.pid)) - before - set(children.pids), "the interrupted one was killed"
    finally:
        children.close()
        ours.close()
        theirs.close()
