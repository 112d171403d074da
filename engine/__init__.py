"""A compact GPipe engine: pipeline-parallel training of any nn.Sequential in PyTorch.

    from engine import GPipe, balance_by_time, balance_by_size
    GPipe(model, balance, ...)                       # stages as threads of this process
    GPipe(model, balance, ..., group=dist.group.WORLD)  # one process per stage (under torchrun)
    GPipe(model, balance, ..., group=pp, data_parallel=dp)  # D pipelines as replicas

Reading path, core first (each file has one job):
 1. pipe.py       GPipe: cut the model, plan each call, hand it to a runner
 2. call.py       the first stage's Decision and the Call every stage plans alike
 3. schedule.py   task lists (GPipe, 1F1B, interleaved, ZB-H1, ZB-V, or written) as pure data
 4. runner.py     run_tasks, the one task loop; the Runner protocol; ThreadRunner
 5. stages.py     the stages one process runs: start, settle, conclude a call
 6. chunk.py      a piece of layers and its tasks: forward, recompute, backward, weights
 7. transport.py  how a task's output reaches the next chunk between threads
 8. device.py, microbatch.py, partition.py, balance.py, batchnorm.py, rng.py, memory.py, trace.py
Then the process plug-in, engine/distributed (its own docstring orders it): a RankRunner and a
ProcessTransport over one of two Lanes. (lab.processes.pool starts K local stage processes for the lab.)

Every name here loads the first time it is asked for: `engine.schedule` and `engine.trace` need no
torch (the lab draws its theory diagrams from them while torch is still loading), and the thread
engine never imports the process path (engine/distributed).
"""
from importlib import import_module

_HOMES = {"GPipe": "pipe", "balance_by_time": "balance", "balance_by_size": "balance", "StageFailed": "transport",
          "Trace": "trace", "Event": "trace", "Message": "trace", "StageMemory": "trace",
          "Reduction": "trace"}
__all__ = list(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(import_module(f".{_HOMES[name]}", __name__), name)
