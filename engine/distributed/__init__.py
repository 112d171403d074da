"""Stages as processes: a plug-in to the thread engine, imported only by what uses it.

- wire.py: the frames stage processes exchange (header, then payload);
- transport.py: `ProcessTransport`, the thread transport's calls over torch.distributed;
- runner.py: `RankRunner`, one rank's share of a call (GPipe(..., group=...) uses it);
- children.py, child.py: child processes that run engine code only, whatever the parent is;
- local.py: how the processes one process starts on this host meet, with no socket beyond loopback;
- pool.py: `ProcessPool`, K local stage processes driven from one process (the lab, notebooks).
"""
