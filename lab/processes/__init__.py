"""Stage processes: K processes on this host, each running one stage of a GPipe, driven from one.

Reading map, from the pool down to the process that starts children:

1. `pool.py`      `ProcessPool`: the parent's side (build a pipe in every stage process, step it, read it back)
2. `server.py`    `StageServer`: a stage process's side, answering the pool's commands
3. `sources.py`   where a run's stage processes come from: a pool of its own, or the shared one
4. `shared.py`    the lab's one shared pool, kept up between runs (the app's sessions, the tables)
5. `children.py`  child processes that run only the function they are given, whatever the parent is
6. `child.py`     a child's entry point (`python -m lab.processes.child`)
7. `forker.py`    a warm process, torch imported once, that forks those children in milliseconds

A child is given functions (named by `children.name_of`), never module paths written as strings.
"""
