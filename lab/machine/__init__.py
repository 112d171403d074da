"""The machine the lab runs on: what it has, and how processes on it meet and are found.

Reading map (nothing here imports the rest of the lab):

1. `host.py`          the host in one line beside every figure, its memory, its GPUs and how they may be shared
2. `gpus.py`          how many GPUs this process may use, counted without torch (the app asks before it loads)
3. `loopback.py`      how the processes one process starts meet, with no socket beyond loopback
4. `process_tree.py`  this host's processes from /proc: which ones a process started, and stopping them
5. `torchrun.py`      two torchrun agents ("nodes") of `python -m lab.train` meeting on loopback
"""
