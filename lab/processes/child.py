"""The entry point of a child process: `python -m lab.processes.child FD NAME`.

It reads, on the connection whose file descriptor is FD, the parent's `sys.path`, the parent's pid
and what to run ("package.module:function" and its arguments), then serves the parent's commands
(lab/processes/children.py). It never imports the parent's main module.
"""
import os
import sys
import threading
import time
from multiprocessing.connection import Connection


def _die_with(parent: int) -> None:
    """End this process soon after `parent` is gone (then this one's parent changes). A thread
    watches, rather than Linux's parent-death signal, which fires when the parent's *thread* that
    started us ends: the app starts stage processes from short-lived script threads."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)
    threading.Thread(target=watch, name="gpipe-parent-watch", daemon=True).start()


def main(watch: int = None) -> None:
    """Serve the parent on the connection named in argv; end soon after the process that started
    this one (`watch`: the forker's pid, lab/processes/forker.py; by default the parent's)."""
    connection = Connection(int(sys.argv[1]))
    from lab.processes.children import portable, receive, resolve, serve

    try:
        path, parent = receive(connection)
        _die_with(watch or parent)
        sys.path[:] = path + [p for p in sys.path if p not in path]
        target, args = receive(connection)  # after the path is set: the arguments may be the parent's classes
    except (EOFError, OSError):
        return
    try:
        server = resolve(target)(*args)
    except Exception as error:  # e.g. a recipe that cannot be imported: every command answers with it
        failure = portable(error)

        def server(command):
            raise failure
    serve(connection, server)


if __name__ == "__main__":
    main()
