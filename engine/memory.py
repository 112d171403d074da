"""A byte ledger of the activations a stage keeps for its backward pass.

Autograd hands every tensor it saves for backward to a saved-tensors pack hook; the ledger counts
the bytes of each distinct storage while anything still holds it, and forgets it when the graph
that saved it is freed. Parameters are not activations and are left out. Inputs kept for a
recompute are added explicitly. The peak of the live total is what the trace reports.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterable

import torch


class _Held:
    """What autograd stores instead of a saved activation: the tensor plus its ledger entry, which
    is released when autograd frees this handle."""

    __slots__ = ("tensor", "_ledger", "_key")

    def __init__(self, tensor: torch.Tensor, ledger: "ActivationLedger", key: tuple):
        self.tensor, self._ledger, self._key = tensor, ledger, key

    def __del__(self):
        self._ledger._release(self._key)


class ActivationLedger:
    """Live and peak bytes of the activations one stage holds for backward."""

    def __init__(self, parameters: Iterable[torch.Tensor] = ()):
        self._lock = threading.Lock()
        self._excluded = {_storage_key(p) for p in parameters}
        self._holders: dict[tuple, list[int]] = {}  # storage -> [bytes, holders]
        self.live = 0
        self.peak = 0

    def hold(self, tensor: torch.Tensor):
        """Count `tensor`'s storage until the returned handle is deleted (parameters and empty
        tensors are not counted and come back as they are: the pack hook runs for every tensor
        autograd saves, so it stays lean)."""
        key = _storage_key(tensor)
        if key in self._excluded:
            return tensor
        size = tensor.untyped_storage().nbytes()
        if size == 0:
            return tensor
        with self._lock:
            entry = self._holders.get(key)
            if entry is None:
                entry = self._holders[key] = [size, 0]
                self.live += size
                if self.live > self.peak:
                    self.peak = self.live
            entry[1] += 1
        # detached: a layer's saved output would otherwise hold its own graph node, a cycle that
        # outlives the graph when no backward frees it (a failed step, or a graph kept for W)
        return _Held(tensor.detach(), self, key)

    def hold_all(self, tensors: Iterable[torch.Tensor]) -> list:
        """Count several tensors (e.g. a stage input kept for recompute) until the handles go."""
        return [self.hold(t) for t in tensors]

    def _release(self, key: tuple) -> None:
        with self._lock:
            entry = self._holders[key]
            entry[1] -= 1
            if entry[1] == 0:
                del self._holders[key]
                self.live -= entry[0]

    @contextmanager
    def saving(self):
        """Count every tensor autograd saves for backward inside this block."""
        with torch.autograd.graph.saved_tensors_hooks(self.hold, _unpack):
            yield


def _storage_key(tensor: torch.Tensor) -> tuple:
    return tensor.device, tensor.untyped_storage().data_ptr()


def _unpack(packed) -> torch.Tensor:
    return packed.tensor if type(packed) is _Held else packed
