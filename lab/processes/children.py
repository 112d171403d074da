"""Child processes that run only the function they are asked to, whatever the parent is.

multiprocessing's "spawn" re-imports the parent's main module in each child (a script without a
main guard starts children forever; `streamlit run app.py` re-runs the page). So a child here is
`python -m lab.processes.child` with the parent's `sys.path`, importing only the function it is asked to run,
by name; on Linux it is forked from a warm process that has imported torch already (forker.py), so
it starts in milliseconds instead of seconds:

    children = Children(allreduce.member, [(rank, 2, port) for rank in range(2)])
    answers = children.ask([("time", 1 << 20)] * 2)   # one command each, one answer each
    children.close()                                    # or let the parent exit: none stays behind

In the child, `function(*args)` makes a server: a callable answering each command (optionally with
`close()`, and a `tell` attribute that becomes a way to send the parent notes). Its exceptions reach
the parent with their own type; a child that dies or stays silent past the timeout raises
ChildFailed; children end with their parent. Parent and child talk pickle over an inherited socket
pair with no name or address; ranks talk to each other without pickle (engine/distributed/wire.py).
"""
from __future__ import annotations

import importlib
import os
import pickle
import subprocess
import sys
import time
import traceback
import weakref
from multiprocessing.connection import Connection, Pipe, wait
from typing import Callable, Optional, Sequence, Union

from engine.transport import StageFailed
from lab.processes import child, forker

ECHO_SECONDS = 15.0  # after one child's error, how long the others may take to answer (a stage's
                     # failure reaches every rank within 5 s, a lost rank within 15 s)
Target = Union[str, Callable]


class ChildFailed(RuntimeError):
    """A child process died, or did not answer in time; the children were stopped."""


def resolve(target: Target) -> Callable:
    """The function named by "package.module:function" (or the function itself)."""
    if callable(target):
        return target
    if not isinstance(target, str) or ":" not in target:
        raise ValueError(f"recipe={target!r}: expected 'package.module:function', a function importable by name")
    module, _, name = target.partition(":")
    try:
        function = importlib.import_module(module)
        for part in name.split("."):
            function = getattr(function, part)
        return function
    except (ImportError, AttributeError) as error:
        raise ValueError(f"recipe={target!r} cannot be imported: {error}") from None


def name_of(function: Callable) -> str:
    """"module:qualname" of a function a child can import, or a ValueError saying why it cannot."""
    module = getattr(function, "__module__", None)
    qualname = getattr(function, "__qualname__", "<locals>")
    if module in (None, "__main__") or "<locals>" in qualname:
        raise ValueError(f"{function!r} is defined in {module or 'no module'}: stage processes cannot import it. "
                         f"Put it in a module (or name it as 'package.module:function')")
    return f"{module}:{qualname}"


def send(connection: Connection, message) -> None:
    """Send a message by value (plain pickle: tensors copied, never left in the sender's shared memory)."""
    connection.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(connection: Connection):
    return pickle.loads(connection.recv_bytes())


class Children:
    """`len(args)` child processes, child i running the server `target(*args[i])`."""

    def __init__(self, target: Target, args: Sequence[tuple], name: str = "child",
                 env: Optional[dict] = None, timeout: float = 300.0):
        target = target if isinstance(target, str) else name_of(target)
        self.name, self.timeout = name, timeout
        environment = forker.child_environment(env)
        self._connections: list[Connection] = []
        self._processes: list[subprocess.Popen] = []
        self._finalizer = weakref.finalize(self, _stop, self._processes, self._connections)
        for index, child_args in enumerate(args):
            ours, theirs = Pipe()
            process = _start(theirs.fileno(), f"{name}-{index}", environment)
            theirs.close()
            self._connections.append(ours)
            self._processes.append(process)
            send(ours, (sys.path, os.getpid()))
            send(ours, (target, tuple(child_args)))

    def __len__(self) -> int:
        return len(self._processes)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes]

    @property
    def open(self) -> bool:
        return self._finalizer.alive

    def dead(self) -> dict[int, int]:
        """{index: exit code} of the children that have ended."""
        return {i: p.returncode for i, p in enumerate(self._processes) if p.poll() is not None}

    def ask(self, commands: Sequence, timeout: Optional[float] = None,
            on_note: Optional[Callable[[int, object], None]] = None) -> list:
        """Send child i `commands[i]` and return the answers in order; notes go to `on_note(i, note)`.
        A child's failure is raised with its own type (the cause before StageFailed echoes); a child
        that dies or stays silent past the timeout stops them all: ChildFailed."""
        if not self.open:
            raise ChildFailed(f"the {self.name} processes were stopped (after close(), or after one died); "
                              f"start new ones")
        # the last child first: of a pool's stages the first, which starts each call and times it, hears
        # last, so it does not wait for the others to hear of the call (the parent's own hand-over)
        for index, (connection, command) in reversed(list(enumerate(zip(self._connections, commands)))):
            try:
                send(connection, command)
            except OSError:
                self._fail(index)
        try:
            answers, interrupted = self._collect(len(commands), timeout or self.timeout, on_note)
        except KeyboardInterrupt:  # the answers still due are unknown now: stop the children, hand out nothing stale
            self.close()
            raise
        if interrupted is not None:
            raise interrupted
        errors = [answers[i][1] for i in sorted(answers) if answers[i][0] == "error"]
        if errors:
            raise min(errors, key=lambda error: isinstance(error, StageFailed))  # the first that is no echo
        return [answers[i][1] for i in range(len(commands))]

    def _collect(self, count: int, timeout: float, on_note) -> tuple[dict, Optional[BaseException]]:
        """The first `count` children's answers, all of them, and what `on_note` raised, if it did."""
        answers: dict[int, tuple] = {}
        interrupted: Optional[BaseException] = None
        deadline = time.monotonic() + timeout
        while len(answers) < count:
            if any(answer[0] == "error" for answer in answers.values()):
                deadline = min(deadline, time.monotonic() + ECHO_SECONDS)  # the others should follow soon
            waiting = {c: i for i, c in enumerate(self._connections[:count]) if i not in answers}
            for connection in wait(list(waiting), timeout=0.1):
                try:
                    message = receive(connection)
                except (EOFError, OSError):
                    self._fail(waiting[connection])
                if message[0] != "note":
                    answers[waiting[connection]] = message
                elif on_note is not None and interrupted is None:
                    try:
                        on_note(waiting[connection], message[1])
                    except BaseException as error:
                        interrupted = error
            gone = [i for i in self.dead() if i not in answers and i < count]
            if gone:
                self._fail(gone[0])
            if time.monotonic() > deadline:
                self.close()
                errors = [answer[1] for answer in answers.values() if answer[0] == "error"]
                if errors:  # one failed and the others are stuck (say, waiting for it to connect)
                    raise errors[0]
                raise ChildFailed(f"the {self.name} processes did not answer within {timeout:.0f} s; they were "
                                  f"stopped")
        return answers, interrupted

    def kill(self, index: int) -> None:
        """Kill one child at once (SIGKILL), as a crash would: for tests and lessons."""
        self._processes[index].kill()

    def close(self) -> None:
        """Ask every child to stop, kill what is still there after 5 s, and reap them all."""
        self._finalizer()

    def _fail(self, index: int):
        self._processes[index].wait(timeout=5)
        codes = self.dead()
        self.close()
        raise ChildFailed(f"{self.name} {index}'s process died (exit codes {codes or 'unknown'}); the others "
                          f"were stopped, none is left")


def _start(fd: int, name: str, environment: dict):
    """A child serving on `fd`: forked from the warm forker where it can be (lab/processes/forker.py), else
    a fresh `python -m lab.processes.child`."""
    if forker.available():
        return forker.forker().start(fd, name, environment)
    return subprocess.Popen([sys.executable, "-m", child.__name__, str(fd), name], pass_fds=[fd], env=environment,
                            stdin=subprocess.DEVNULL)


def _stop(processes: list, connections: list) -> None:
    for connection in connections:
        try:
            send(connection, "stop")
        except OSError:
            pass
    deadline = time.monotonic() + 5
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    for connection in connections:
        connection.close()


# --- in the child ---------------------------------------------------------------------------------

def portable(error: BaseException) -> BaseException:
    """`error` if it pickles as itself, else a RuntimeError saying it; its traceback attached as a note."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        error = RuntimeError(f"{type(error).__name__}: {error}")
    lines = traceback.format_exception(type(error), error, error.__traceback__)
    error.__traceback__ = None
    if lines and hasattr(error, "add_note"):
        error.add_note("in a child process:\n" + "".join(lines[-6:]).rstrip())
    return error


def serve(connection: Connection, server: Callable) -> None:
    """Answer the parent's commands with `server(command)` until it says stop or is gone."""
    if hasattr(server, "tell"):
        server.tell = lambda note: send(connection, ("note", note))
    try:
        while True:
            try:
                command = receive(connection)
            except (EOFError, OSError):
                return
            if command == "stop":
                return
            try:
                answer = ("ok", server(command))
            except Exception as error:
                answer = ("error", portable(error))
            try:
                send(connection, answer)
            except Exception as error:  # an answer that cannot be pickled: say so instead
                send(connection, ("error", portable(error)))
    finally:
        close = getattr(server, "close", None)
        if close is not None:
            close()
