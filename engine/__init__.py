"""A compact GPipe engine: pipeline-parallel training of any nn.Sequential in PyTorch.

    from engine import GPipe, balance_by_time, balance_by_size
    GPipe(model, balance, ...)                       # stages as threads of this process
    GPipe(model, balance, ..., group=dist.group.WORLD)  # one process per stage (under torchrun)
    GPipe(model, balance, ..., group=pp, data_parallel=dp)  # D pipelines as replicas
    ProcessPool(stages)                              # K local stage processes driven from here

Every name here loads the first time it is asked for: `engine.schedule` and `engine.trace` need no
torch (the lab draws its theory diagrams from them while torch is still loading), and the thread
engine never imports the process path (engine/distributed).
"""
from importlib import import_module

_HOMES = {"GPipe": "pipe", "balance_by_time": "balance", "balance_by_size": "balance", "StageFailed": "transport",
          "Trace": "trace", "Event": "trace", "Message": "trace", "StageMemory": "trace",
          "Reduction": "trace",
          "ProcessPool": "distributed.pool", "StageProcessError": "distributed.pool"}
__all__ = list(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(import_module(f".{_HOMES[name]}", __name__), name)
