"""Timelines: what a measured step did, replayed, taken apart, and compared.

Reading map:

1. `replay.py`     the timelines to draw: measured, an ideal replay, and the textbook diagram (no torch)
2. `breakdown.py`  a step's makespan as named parts that add up to it, and its critical path
3. `verdict.py`    which of several alternatives measured in the same rounds is faster, said only when clear
"""
