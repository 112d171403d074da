"""Schedules beyond GPipe's fill-drain, side by side, written by hand, and found by search.

Reading map:

1. `race.py`    GPipe, 1F1B, interleaved 1F1B and ZB-H1 on one configuration, with the theory beside
2. `writer.py`  a schedule written by hand: presets, the engine's verdict in one line, predictions, a run
3. `search.py`  a schedule found instead: the fastest order of tasks under a memory cap
"""
