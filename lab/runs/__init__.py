"""Runs: one configuration in, one plain record out, and what a run measures beside its times.

Reading map:

1. `experiments.py`      `run(config)`: build, step, measure, predict, and the record the views draw
2. `stepper.py`          `Stepper`: the one way the lab makes a training step, on threads or stage processes
3. `exactness.py`        pipelined against unpipelined gradients, as tables
4. `schedule_memory.py`  a schedule's activation peak per stage, predicted from where its tasks sit
5. `counts.py`           what a task does, counted instead of timed (FLOPs, operator calls)
"""
