"""A warm process that forks child processes with torch already imported: `python -m lab.processes.forker FD`.

Starting `python -m lab.processes.child` costs an import of torch, about 2 s of CPU on a small host, for every
stage process of every pool. The forker pays it once per parent: started like any child (it never
imports the parent's main module), it imports torch and the stage server, then waits; each child is
forked from it in a few milliseconds and runs lab.processes.child from there on. The forker has no thread of
its own making and never touches CUDA, so a forked child starts as clean as a fresh interpreter.

A child gets what a `subprocess.Popen` child would: the parent's environment, working directory,
stdout and stderr at the moment it is asked for, and /dev/null as stdin. The forker reaps its
children and reports each exit code to the parent; it ends when the parent does (its socket closes),
and its children end soon after it (lab/processes/child.py watches the process that started it).

    forked = forker().start(connection_fd, "stage-0", env)   # Popen-like: pid, poll, wait, kill
"""
from __future__ import annotations

import atexit
import importlib
import itertools
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
from functools import lru_cache
from pathlib import Path
from typing import Optional

from lab.processes import child

PROJECT_ROOT = str(Path(__file__).resolve().parents[2])  # the folder that holds the engine and lab packages
REAP_SECONDS = 0.05  # how often the forker reaps its children, reports their exit codes and looks for its parent
# Imported once in the forker for every child (the lab's own code is not: a notebook that edits it gets
# the new code in its next pool, as with fresh processes). torch imports torch._dynamo on a process's
# first optimizer and symbolic_shapes (sympy) on its first backward given gradients, about 1.5 s of CPU
# together (torch._dynamo brings both): every stage process does both.
PRELOADED = ("torch", "torch._dynamo")
LOST = -1  # the exit code of a child whose forker was killed before it could report one


def child_environment(changes: Optional[dict] = None) -> dict:
    """This process's environment with `changes`, and the project first on PYTHONPATH: what a child
    process (the forker, or a fresh `python -m lab.processes.child`) is started with."""
    return {**os.environ, **(changes or {}), "PYTHONPATH": os.pathsep.join(
        [PROJECT_ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}


def available() -> bool:
    """Whether children are forked (Linux, where this kernel gives pidfds, unless GPIPE_WARM_FORK=0)
    or started as fresh interpreters."""
    return os.environ.get("GPIPE_WARM_FORK", "1") != "0" and _pidfds()


@lru_cache(maxsize=1)
def _pidfds() -> bool:
    if sys.platform != "linux" or not hasattr(os, "pidfd_open") or not hasattr(socket, "send_fds"):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))  # kernels before 5.3, or a seccomp profile, refuse it
        return True
    except OSError:
        return False


class Forked:
    """A forked child, handled as a `subprocess.Popen` is: pid, returncode, poll(), wait(), kill()."""

    def __init__(self, pid: int, pidfd: int, forker: "Forker"):
        self.pid, self._pidfd, self._forker = pid, pidfd, forker
        self.returncode: Optional[int] = None
        self._lock = threading.RLock()  # poll and kill from several threads (and finalizers) close the pidfd once

    def poll(self) -> Optional[int]:
        with self._lock:
            if self.returncode is None:
                code = self._forker.exit_code(self.pid)
                if code is None and not self._forker.running() and select.select([self._pidfd], [], [], 0)[0]:
                    code = LOST  # the forker was killed first: this child ended, with a code nobody saw
                if code is not None:
                    self.returncode = code
                    os.close(self._pidfd)
                    self._pidfd = -1
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
        with self._lock:
            if self.poll() is None:
                try:
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass


class Forker:
    """The parent's end: asks the forker for children, collects the exit codes it reports. Each
    request carries a number and its answer comes back with it, so an answer is never taken for
    another's, even when a request was interrupted (a notebook's stop button) before its answer came."""

    def __init__(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.process = self._start(theirs)
        theirs.close()
        self.owner, self._ended, self._requests = os.getpid(), False, itertools.count()
        self._socket, self._exits, self._answers, self._abandoned = ours, {}, {}, set()
        self._lock = threading.RLock()  # re-entrant: a finalizer may poll a child while this thread waits here

    def _start(self, theirs: socket.socket):
        """The forker process, serving on `theirs` (this process keeps the other end): a fresh
        `python -m lab.processes.forker`, held as a Popen (pid, poll)."""
        return subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())],
                                pass_fds=[theirs.fileno()], env=child_environment(), stdin=subprocess.DEVNULL)

    def running(self) -> bool:
        return not self._ended and self.process.poll() is None

    def start(self, connection_fd: int, name: str, env: dict) -> Forked:
        """Fork a child that runs lab.processes.child on `connection_fd` (the parent keeps its own end)."""
        try:
            folder = os.getcwd()
        except OSError:  # the parent's folder was deleted: the child stays in the forker's
            folder = None
        with self._lock:
            number = next(self._requests)
            socket.send_fds(self._socket, [pickle.dumps((number, name, env, folder))], [connection_fd, 1, 2])
            try:
                self._drain(timeout=0.1)
                while number not in self._answers:
                    if not self.running():
                        raise OSError(f"the forker (pid {self.process.pid}) ended: exit code {self.process.poll()}")
                    self._drain(timeout=0.1)
            except BaseException:
                self._abandoned.add(number)  # its child, if it comes, is killed: nobody holds it
                raise
            answer = self._answers.pop(number)
        if isinstance(answer, str):
            raise OSError(f"the forker could not start {name}: {answer}")
        return Forked(*answer, self)

    def exit_code(self, pid: int) -> Optional[int]:
        """The child's exit code once the forker has reaped it (negative: the signal that ended it)."""
        with self._lock:
            self._drain(timeout=0)
            return self._exits.get(pid)

    def _drain(self, timeout: float) -> None:
        """Read what the forker has said, waiting up to `timeout` for the first message."""
        while not self._ended and select.select([self._socket], [], [], timeout)[0]:
            timeout = 0
            data, fds, _, _ = socket.recv_fds(self._socket, 1 << 16, 1)
            if not data:
                self._ended = True  # the forker is gone: nothing more will come
                return
            kind, number, value = pickle.loads(data)
            if kind == "exit":
                self._exits[number] = value  # here `number` is the pid
            elif number in self._abandoned:
                self._abandoned.discard(number)
                for fd in fds:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                    os.close(fd)
            elif kind == "forked":
                self._exits.pop(value, None)  # a pid seen before, reused: its old exit is not this child's
                self._answers[number] = (value, fds[0])
            else:
                self._answers[number] = value  # why the forker could not fork


_forker: Optional[Forker] = None
_forker_lock = threading.Lock()


def forker() -> Forker:
    """This process's forker, started on first use (again if it died, or if this process is a fork)."""
    global _forker
    with _forker_lock:
        if _forker is None or _forker.owner != os.getpid() or not _forker.running():
            _forker = Forker()
        return _forker


def _forget_forker() -> None:
    """In a fork of the parent (a DataLoader worker, say): drop the parent's socket to the forker, so
    that the forker still ends with the parent and never answers this process instead."""
    global _forker
    if _forker is not None:
        _forker._socket.close()
        _forker = None


os.register_at_fork(after_in_child=_forget_forker)


# --- in the forker --------------------------------------------------------------------------------

def serve(sock: socket.socket) -> None:
    """Fork a child per request until the parent is gone; reap the children and report their ends."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # reaped here, with their codes, whatever the parent set
    for module in PRELOADED:
        importlib.import_module(module)
    child_main = child.main
    me, parent = os.getpid(), os.getppid()
    while os.getppid() == parent:
        ready = select.select([sock], [], [], REAP_SECONDS)[0]
        _reap(sock)
        if not ready:
            continue
        data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
        if not data:
            return  # the parent is gone
        number, name, env, folder = pickle.loads(data)
        try:
            pid = os.fork()
        except OSError as error:  # no memory, or the pids limit: say so, and serve on
            sock.send(pickle.dumps(("error", number, f"{type(error).__name__}: {error}")))
            pid = None
        if pid == 0:
            sock.close()
            _run_child(child_main, fds, name, env, folder, me)
        for fd in fds:
            os.close(fd)
        if pid is not None:
            pidfd = os.pidfd_open(pid)  # before the next _reap: the child cannot be reaped yet
            socket.send_fds(sock, [pickle.dumps(("forked", number, pid))], [pidfd])
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


def _run_child(main, fds: list[int], name: str, env: dict, folder: Optional[str], forker_pid: int) -> None:
    """In the forked child: become what `python -m lab.processes.child` would be, run it, and never return."""
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
        if folder is not None:
            os.chdir(folder)
        sys.argv = [child.__name__, str(connection_fd), name]
        main(watch=forker_pid)
        atexit._run_exitfuncs()  # what a fresh interpreter's exit would run (weakref finalizers among them)
    except SystemExit as end:
        code = end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
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


def main(sock: socket.socket) -> None:
    """Be the forker on `sock` until the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a notebook's interrupt is for the stages, not for the forker
    try:
        serve(sock)
    except (ConnectionError, OSError):
        pass  # the parent went away mid-message


if __name__ == "__main__":
    main(socket.socket(fileno=int(sys.argv[1])))
