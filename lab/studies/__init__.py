"""Studies: the paper's tables and the questions around them, measured on this host.

Reading map:

1. `gpu_sizing.py`        the GPU table's Transformer, sized so that the GPU sets each task's pace
2. `speedup.py`           Table 2: sweeps over K and M, sized for the device, and the bubble curve
3. `fit.py`               Table 1: the largest model whose training step fits a memory budget
4. `layouts.py`           workers as replicas of pipelines: what each layout sends and holds
5. `allreduce.py`         what data parallelism sends instead: a real all-reduce, timed
6. `interpreter_lock.py`  why stage threads overlap badly on small models
"""
