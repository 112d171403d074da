"""A compact GPipe engine: pipeline-parallel training of any nn.Sequential in PyTorch.

    from engine import GPipe, balance_by_time, balance_by_size
    GPipe(model, balance, ...)                       # stages as threads of this process
    GPipe(model, balance, ..., group=dist.group.WORLD)  # one process per stage (under torchrun)
    ProcessPool(stages)                              # K local stage processes driven from here
"""
from .balance import balance_by_size, balance_by_time
from .pipe import GPipe
from .pool import ProcessPool, StageProcessError
from .trace import Event, Message, StageMemory, Trace
from .transport import StageFailed

__all__ = ["GPipe", "balance_by_time", "balance_by_size", "ProcessPool", "StageProcessError", "StageFailed",
           "Trace", "Event", "Message", "StageMemory"]
