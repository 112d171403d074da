"""The engine's own time: what it costs beyond the model's compute, beside plain PyTorch and its peers.

Reading map:

1. `overhead.py`    per call, per micro-batch and per message, on a model that does almost nothing
2. `call_ends.py`   a call's two ends, timed by hooks on the model's first layer, alike for every contender
3. `host_time.py`   the host's share of a task: Python calls, ATen operators and microseconds per task
4. `peers.py`       the race against torch.distributed.pipelining and torchgpipe on one workload
5. `steps.py`       the steps `python -m lab.bench` times, and how it times them
6. `throughput.py`  the benchmark's rows of throughputs and ratios
7. `messages.py`    what a message and a gap between tasks cost on this host
"""
