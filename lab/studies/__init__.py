"""Studies: the paper's tables and the questions around them, measured on this host.

Reading map:

1. `speedup.py`           Table 2: sweeps over K and M, sized for the device, and the bubble curve
2. `fit.py`               Table 1: the largest model whose training step fits a memory budget
3. `layouts.py`           workers as replicas of pipelines: what each layout sends and holds
4. `allreduce.py`         what data parallelism sends instead: a real all-reduce, timed
5. `interpreter_lock.py`  why stage threads overlap badly on small models
"""
