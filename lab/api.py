"""The engine's public API, as the lessons use it: notebooks and the app import only `lab`, so the
first lesson reaches GPipe itself through here (the very same classes as `engine`)."""
from engine import GPipe, ProcessPool, StageFailed, Trace, balance_by_size, balance_by_time  # noqa: F401

__all__ = ["GPipe", "ProcessPool", "StageFailed", "Trace", "balance_by_size", "balance_by_time"]
