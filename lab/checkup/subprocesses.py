"""The doctor's commands in processes of their own: bounded in time, stopped with everything they
started, Ctrl-C passed on."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager
from typing import Optional

from lab.machine.loopback import loopback_interface
from lab.machine.process_tree import descendants, kill
from lab.machine.torchrun import ROOT

NCCL_ON_LOOPBACK = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT",  # says when NCCL makes a communicator
                    **dict.fromkeys(("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"), loopback_interface())}


@contextmanager
def ctrl_c_passed_on():
    """Children started inside get Ctrl-C's default action even where this process ignores it, as a
    shell's background job (`python -m lab.doctor --report &`) does: an ignored signal stays ignored
    across exec, a handled one does not, so the doctor handles it while it starts them."""
    ignored = (signal.getsignal(signal.SIGINT) is signal.SIG_IGN
               and threading.current_thread() is threading.main_thread())
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def bounded(args: list[str], seconds: float, env: Optional[dict] = None,
            grace: float = 0.0) -> tuple[Optional[int], str]:
    """Run `python args...` in the project for at most `seconds`, then stop it and everything it
    started (torchrun's workers, stage processes); its exit code (None if it ran out of time) and
    its output, stdout and stderr together. With `grace`, the last `grace` of those seconds begin
    with a Ctrl-C (SIGINT) to the command alone, so that it can write what it finished
    (lab.reproduce writes its finished rows)."""
    with tempfile.TemporaryFile("w+") as log, ctrl_c_passed_on():
        process = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                                   start_new_session=True,  # unbuffered: a stopped command's last lines are kept
                                   env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        tree: list[int] = []
        try:
            code = process.wait(timeout=max(seconds - grace, 0.0))
        except subprocess.TimeoutExpired:
            code = None
            if grace > 0:
                tree = descendants(process.pid)  # as it was when interrupted: it may exit and orphan them
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            tree = [*tree, *descendants(process.pid)]  # torchrun's workers run in sessions of their own
            try:
                os.killpg(process.pid, signal.SIGKILL)  # whatever is left of it
            except ProcessLookupError:
                pass
            kill(tree)
            process.wait()
        log.seek(0)
        return code, log.read()


def run_module(args: list[str], timeout: float, env: Optional[dict] = None) -> str:
    """Run `python args...` (a torchrun or lab command) in the project; its output, or an error with it."""
    code, output = bounded(args, timeout, env)
    if code != 0:
        ended = f"ran out of its {timeout:.0f} s" if code is None else f"exited with {code}"
        raise RuntimeError(f"`python {' '.join(args)}` {ended}: {output.strip().splitlines()[-1:]}")
    return output

