"""A compact GPipe engine: pipeline-parallel training of any nn.Sequential in PyTorch.

    from engine import GPipe, balance_by_time, balance_by_size
    GPipe(model, balance, ...)                       # stages as threads of this process
    GPipe(model, balance, ..., group=dist.group.WORLD)  # one process per stage (under torchrun)
    ProcessPool(stages)                              # K local stage processes driven from here

The thread engine never imports the process path (engine/distributed): `ProcessPool` and
`StageProcessError` are loaded from there the first time they are asked for.
"""
from .balance import balance_by_size, balance_by_time
from .pipe import GPipe
from .trace import Event, Message, StageMemory, Trace
from .transport import StageFailed

__all__ = ["GPipe", "balance_by_time", "balance_by_size", "ProcessPool", "StageProcessError", "StageFailed",
           "Trace", "Event", "Message", "StageMemory"]


def __getattr__(name: str):
    if name in ("ProcessPool", "StageProcessError"):
        from .distributed import pool
        return getattr(pool, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
