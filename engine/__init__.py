"""A compact GPipe engine: pipeline-parallel training of any nn.Sequential in PyTorch.

    from engine import GPipe, balance_by_time, balance_by_size
"""
from .balance import balance_by_size, balance_by_time
from .pipe import GPipe
from .trace import Event, StageMemory, Trace

__all__ = ["GPipe", "balance_by_time", "balance_by_size", "Trace", "Event", "StageMemory"]
