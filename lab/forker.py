"""A warm process that forks child processes with torch already imported: `python -m lab.forker FD`.

Starting `python -m lab.child` costs an import of torch, about 2 s of CPU on a small host, for every
stage process of every pool. The forker pays it once per parent: started like any child (it never
imports the parent's main module), it imports torch and the stage server, then waits; each child is
forked from it in a few milliseconds and runs lab.child from there on. The forker has no thread of
its own making and never touches CUDA, so a forked child starts as clean as a fresh interpreter.

A child gets what a `subprocess.Popen` child would: the parent's environment, working directory,
stdout and stderr at the moment it is asked for, and /dev/null as stdin. The forker reaps its
children and reports each exit code to the parent; it ends when the parent does (its socket closes),
and its children end soon after it (lab/child.py watches the process that started it).

    forked = forker().start(connection_fd, "stage-0", env)   # Popen-like: pid, poll, wait, kill
"""
from __future__ import annotations

import atexit
import importlib
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Optional

PROJECT_ROOT = str(Path(__file__).resolve().parents[1])
REAP_SECONDS = 0.05  # how often the forker reaps its children and reports their exit codes
PRELOADED = ("torch", "lab.child", "lab.stage_server")  # imported once in the forker, for every child
LOST = -1  # the exit code of a child whose forker was killed before it could report one


def available() -> bool:
    """Whether children are forked (Linux with pidfds, unless GPIPE_WARM_FORK=0) or started afresh."""
    return (sys.platform == "linux" and hasattr(os, "pidfd_open") and hasattr(socket, "send_fds")
            and os.environ.get("GPIPE_WARM_FORK", "1") != "0")


class Forked:
    """A forked child, handled as a `subprocess.Popen` is: pid, returncode, poll(), wait(), kill()."""

    def __init__(self, pid: int, pidfd: int, forker: "Forker"):
        self.pid, self._pidfd, self._forker = pid, pidfd, forker
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            code = self._forker.exit_code(self.pid)
            if code is None and not self._forker.running() and select.select([self._pidfd], [], [], 0)[0]:
                code = LOST  # the forker was killed first: this child ended, with a code nobody saw
            if code is not None:
                self.returncode = code
                os.close(self._pidfd)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked child {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def kill(self) -> None:
        """SIGKILL through the pidfd: never another process that took this pid after it was reaped."""
        if self.poll() is None:
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Forker:
    """The parent's end: asks the forker for children, collects the exit codes it reports."""

    def __init__(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [PROJECT_ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
        self.process = subprocess.Popen([sys.executable, "-m", "lab.forker", str(theirs.fileno())],
                                        pass_fds=[theirs.fileno()], env=environment, stdin=subprocess.DEVNULL)
        theirs.close()
        self.owner, self._ended = os.getpid(), False
        self._socket, self._lock, self._exits = ours, threading.Lock(), {}

    def running(self) -> bool:
        return not self._ended and self.process.poll() is None

    def start(self, connection_fd: int, name: str, env: dict) -> Forked:
        """Fork a child that runs lab.child on `connection_fd` (the parent keeps its own end)."""
        with self._lock:
            socket.send_fds(self._socket, [pickle.dumps((name, env, os.getcwd()))], [connection_fd, 1, 2])
            while True:
                message, fds = self._receive()
                if message[0] == "forked":
                    return Forked(message[1], fds[0], self)

    def exit_code(self, pid: int) -> Optional[int]:
        """The child's exit code once the forker has reaped it (negative: the signal that ended it)."""
        with self._lock:
            while not self._ended and select.select([self._socket], [], [], 0)[0]:
                try:
                    self._receive()
                except OSError:
                    self._ended = True  # the forker is gone: nothing more will come
            return self._exits.get(pid)

    def _receive(self) -> tuple:
        """One message from the forker; exit codes are kept as they come."""
        data, fds, _, _ = socket.recv_fds(self._socket, 1 << 16, 1)
        if not data:
            raise OSError(f"the forker (pid {self.process.pid}) ended: exit code {self.process.wait(timeout=5)}")
        message = pickle.loads(data)
        if message[0] == "exit":
            self._exits[message[1]] = message[2]
        return message, fds


_forker: Optional[Forker] = None
_forker_lock = threading.Lock()


def forker() -> Forker:
    """This process's forker, started on first use (again if it died, or if this process is a fork)."""
    global _forker
    with _forker_lock:
        if _forker is None or _forker.owner != os.getpid() or not _forker.running():
            _forker = Forker()
        return _forker


# --- in the forker --------------------------------------------------------------------------------

def serve(sock: socket.socket) -> None:
    """Fork a child per request until the parent is gone; reap the children and report their ends."""
    for module in PRELOADED:
        importlib.import_module(module)
    child_main = sys.modules["lab.child"].main

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a notebook's interrupt is for the stages, not for us
    me = os.getpid()
    while True:
        ready = select.select([sock], [], [], REAP_SECONDS)[0]
        _reap(sock)
        if not ready:
            continue
        data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
        if not data:
            return  # the parent is gone
        name, env, cwd = pickle.loads(data)
        pid = os.fork()
        if pid == 0:
            sock.close()
            _run_child(child_main, fds, name, env, cwd, me)
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        socket.send_fds(sock, [pickle.dumps(("forked", pid))], [pidfd])
        os.close(pidfd)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(pickle.dumps(("exit", pid, os.waitstatus_to_exitcode(status))))


def _run_child(main, fds: list[int], name: str, env: dict, cwd: str, forker_pid: int) -> None:
    """In the forked child: become what `python -m lab.child` would be, run it, and never return."""
    code = 0
    try:
        connection_fd, stdout, stderr = fds
        null = os.open(os.devnull, os.O_RDONLY)
        for fd, target in ((null, 0), (stdout, 1), (stderr, 2)):
            os.dup2(fd, target)
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with open("/proc/self/comm", "w") as comm:  # what top and `ps -o comm` show: "stage-0", not the forker
            comm.write(name[:15])
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.argv = ["lab.child", str(connection_fd), name]
        main(watch=forker_pid)
        atexit._run_exitfuncs()  # what a fresh interpreter's exit would run (weakref finalizers among them)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


if __name__ == "__main__":
    try:
        serve(socket.socket(fileno=int(sys.argv[1])))
    except (ConnectionError, OSError):
        pass  # the parent went away mid-message
