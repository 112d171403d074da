"""Your own model, pipelined: what `python -m lab.check` finds, apart from its command line.

Reading map:

1. `model.py`       MODULE:FUNCTION taken as a chain of layers with a batch, or refused in one line
2. `exactness.py`   the pipeline's gradients against one device's, for each K and M, and why they differ
3. `memory.py`      what each stage holds in a step, and its count against the CPU allocator's peak
4. `plan.py`        each layer's time and size, three cuts, and the plan that fits a budget fastest
"""
