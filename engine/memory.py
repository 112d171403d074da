"""A byte ledger of the activations a stage keeps for its backward pass.

Inside `saving()` autograd's saved-tensors pack hook only notes each tensor it saves; at the block's
end the ledger counts each distinct storage noted (parameters left out) in a `Holding`, counted
until the task that frees the graph releases it (its backward, or W after a split one); a storage
two holdings share counts once. Inputs kept for a recompute are held alike. A stage runs one task
at a time, so between tasks the live total is what a count per tensor (a Python object and a lock
per saved tensor, on every layer of every micro-batch) showed. A split backward's B frees what W
does not need: such a holding is watched (weak references) and swept before anything new counts.
The peak of the live total is what the trace reports.
"""
from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from typing import Iterable

import torch


class Holding:
    """Storages one block of saving (or one kept input) holds in a ledger: (key, bytes) pairs, and,
    if watched, weak references to the saved tensors on each storage."""

    __slots__ = ("storages", "watched")

    def __init__(self):
        self.storages: list[tuple[tuple, int]] = []
        self.watched: dict[tuple, list] = {}


class ActivationLedger:
    """Live and peak bytes of the activations one stage holds for backward."""

    def __init__(self, parameters: Iterable[torch.Tensor] = ()):
        self._lock = threading.Lock()
        self._excluded = {_storage_key(p, p.untyped_storage()) for p in parameters}
        self._holders: dict[tuple, list[int]] = {}  # storage -> [bytes, holdings]
        self._watched: list[Holding] = []
        self.live = 0
        self.peak = 0

    def hold_all(self, tensors: Iterable[torch.Tensor]) -> Holding:
        """Count the storages of `tensors` (e.g. a stage input kept for recompute) until released;
        parameters and empty storages are not counted."""
        holding = Holding()
        self._add(holding, tensors)
        return holding

    def _add(self, holding: Holding, tensors: Iterable[torch.Tensor], watch: bool = False) -> None:
        storages = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()  # one storage object per tensor: a block notes a dozen
            key = _storage_key(tensor, storage)
            if key not in self._excluded:
                size = storage.nbytes()
                if size:
                    storages[key] = size
                    if watch:
                        holding.watched.setdefault(key, []).append(weakref.ref(tensor))
        holding.storages = list(storages.items())
        with self._lock:
            for watched in self._watched:
                self._drop(watched, [(key, size) for key, size in watched.storages
                                     if all(ref() is None for ref in watched.watched[key])])
            if holding.watched:  # released by `release`, which looks for it only then
                self._watched.append(holding)
            for key, size in holding.storages:
                entry = self._holders.get(key)
                if entry is None:
                    entry = self._holders[key] = [size, 0]
                    self.live += size
                entry[1] += 1
            self.peak = max(self.peak, self.live)

    def release(self, holding: Holding) -> None:
        """Stop counting what `holding` held (a storage another holding shares stays counted)."""
        with self._lock:
            self._drop(holding, holding.storages)
            if holding.watched:
                self._watched.remove(holding)

    def _drop(self, holding: Holding, storages: list) -> None:
        for key, _ in storages:
            entry = self._holders[key]
            entry[1] -= 1
            if entry[1] == 0:
                del self._holders[key]
                self.live -= entry[0]
        if storages:  # all of them when released (no search), some when a split backward freed them
            holding.storages = [] if storages is holding.storages else \
                [pair for pair in holding.storages if pair not in storages]

    @contextmanager
    def saving(self, watch: bool = False):
        """Note every tensor autograd saves for backward inside this block; at its end they are
        held (the Holding this yields is filled then) until released. `watch`: storages autograd
        frees before the release stop counting then (a graph that a split backward frees in parts)."""
        noted: list[torch.Tensor] = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:  # detached: a saved output would hold its own graph
            noted.append(tensor.detach())               # node, a cycle that outlives a graph no backward frees
            return noted[-1]

        holding = Holding()
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
                yield holding
            self._add(holding, noted, watch)
        finally:
            noted.clear()  # autograd keeps `pack`, and so this list, as long as it keeps what was saved


def _storage_key(tensor: torch.Tensor, storage) -> tuple:
    """Which storage a tensor lives on (`storage`: its untyped storage, taken once by the caller)."""
    return tensor.device, storage.data_ptr()


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
