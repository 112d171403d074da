"""A schedule's activation peak per stage, predicted from where each of its tasks sits.

The prediction replays each stage's task list against what the engine's ledger counts (distinct
storages saved for backward), measured once per chunk on one micro-batch:
- F keeps the chunk's input and every tensor its layers save; F of a micro-batch the schedule
  recomputes (it runs an R for it) keeps its input only, and R saves new tensors (a recompute
  makes its own, also its own output);
- a chunk's output is the next chunk's input: on one stage (a V), one storage, counted once;
- the first chunk's micro-batches are views of the mini-batch: its whole storage counts once while
  any of them is held;
- B frees the micro-batch's tensors; with W split off, B keeps what the layers up to the last one
  with parameters saved (W's graph), and W frees it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.schedule import Schedule, Task, recomputed


@dataclass(frozen=True)
class ChunkBytes:
    """What one micro-batch of a chunk holds, in bytes: its input's storage, each other storage its
    layers save (in order; "out" names the chunk's output when a layer saves it), and which of those
    W's graph keeps."""

    input: int
    saved: tuple[tuple[str, int], ...]   # (name, bytes): "0", "1", ... or "out"
    kept_for_w: frozenset                # names kept from B to W


def measure_chunks(chunks: list[nn.Module], sample: torch.Tensor) -> list[ChunkBytes]:
    """Each chunk's storages saved for backward on one micro-batch (`sample`, the first chunk's input;
    each chunk's output is the next one's), as the ledger counts them (distinct storages,
    parameters left out), and which of them W's graph keeps: those saved up to the output of the
    last module that owns parameters (the engine notes those outputs)."""
    measured = []
    for layers in chunks:
        bytes_, sample = _measure(layers, sample)
        measured.append(bytes_)
    return measured


def _measure(layers: nn.Module, sample: torch.Tensor) -> tuple[ChunkBytes, torch.Tensor]:
    """One chunk's bytes (`measure_chunks`) and its output, detached."""
    parameters = {p.untyped_storage().data_ptr() for p in layers.parameters()}
    key = lambda t: t.untyped_storage().data_ptr()
    order: dict[int, int] = {}           # storage -> bytes, in the order first saved
    last_weights = [0]                   # how many storages were saved when a parameter owner last returned

    def pack(t: torch.Tensor):
        if key(t) not in parameters and key(t) not in order and t.untyped_storage().nbytes():
            order[key(t)] = t.untyped_storage().nbytes()
        return t

    def returned(*_) -> None:
        last_weights[0] = len(order)
    owners = [m for m in layers.modules() if any(p is not None for p in m._parameters.values())]
    hooks = [m.register_forward_hook(returned) for m in owners]
    x = sample.detach().clone().requires_grad_(sample.is_floating_point())  # a storage of its own
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = layers(x)
    finally:
        for hook in hooks:
            hook.remove()
    saved, kept = [], set()
    for position, (storage, size) in enumerate(order.items()):
        name = "in" if storage == key(x) else "out" if storage == key(out) else str(position)
        if name != "in":
            saved.append((name, size))
        if position < last_weights[0]:
            kept.add(name)
    return ChunkBytes(x.untyped_storage().nbytes(), tuple(saved), frozenset(kept)), out.detach()


def footprints(schedule: Schedule, chunks: list[ChunkBytes], batch_bytes: int) -> list[list[tuple[Task, int]]]:
    """Per stage, each task with the activation bytes the stage holds once it has run (before a
    backward frees what it used: the moment of the peak). `chunks[c]`: chunk c's bytes per
    micro-batch; `batch_bytes`: the mini-batch input's storage, which the first chunk's inputs share."""
    split, again = any(t.op == "W" for tasks in schedule for t in tasks), recomputed(schedule)

    def input_of(c: int, m: int) -> tuple:
        return ("batch",) if c == 0 else ("F", c - 1, m, "out")   # the previous chunk's output
    sizes = {("batch",): batch_bytes}
    result = []
    for tasks in schedule:
        held: dict[tuple, int] = {}          # storage -> holders
        holds: dict[tuple, list] = {}        # (chunk, micro) -> storages it holds
        line = []

        def take(owner: tuple, names: list) -> None:
            for name in names:
                held[name] = held.get(name, 0) + 1
            holds.setdefault(owner, []).extend(names)

        def drop(owner: tuple) -> None:
            for name in holds.pop(owner, []):
                held[name] -= 1
                if not held[name]:
                    del held[name]
        for task in tasks:
            c, m, bytes_ = task.chunk, task.micro, chunks[task.chunk]
            made_by = "R" if (c, m) in again else "F"
            body = [(made_by, c, m, name) for name, _ in bytes_.saved]
            sizes.update({(made_by, c, m, name): n for name, n in bytes_.saved})
            sizes.setdefault(input_of(c, m), bytes_.input)
            if task.op == "F":
                take((c, m), [input_of(c, m)] + (body if made_by == "F" else []))
            elif task.op == "R":
                take((c, m), body)
            line.append((task, sum(sizes[name] for name in held)))
            if task.op == "B" and split:
                keep = [input_of(c, m)] * ("in" in bytes_.kept_for_w) + [n for n in body if n[-1] in bytes_.kept_for_w]
                drop((c, m))
                take((c, m), keep)
            elif task.op in "BW":
                drop((c, m))
        result.append(line)
    return result


def peaks(schedule: Schedule, chunks: list[ChunkBytes], batch_bytes: int) -> list[int]:
    """Each stage's predicted activation peak in bytes for `schedule` (see `footprints`)."""
    return [max((held for _, held in line), default=0)
            for line in footprints(schedule, chunks, batch_bytes)]


def in_bytes(count: int) -> str:
    """A byte count as a cap's message says it, in the unit the page's cap is typed in too: "5632 bytes (5.5 KiB)"."""
    return f"{count} bytes ({count / 1024:.1f} KiB)"


def check_cap(schedule: Schedule, chunks: list[ChunkBytes], batch_bytes: int, cap) -> None:
    """Raise a ValueError naming the first stage and task at which the schedule's activations would
    pass `cap` bytes (one number for every stage, or one per stage)."""
    schedule = schedule if isinstance(schedule, Schedule) else Schedule(schedule)
    lines = footprints(schedule, chunks, batch_bytes)
    caps = list(cap) if isinstance(cap, (list, tuple)) else [cap] * len(lines)
    if len(caps) != len(lines):
        raise ValueError(f"{len(caps)} caps for {len(lines)} stages: expected one number, or one per stage")
    for k, (line, limit) in enumerate(zip(lines, caps)):
        for task, held in line:
            if held > limit:
                raise ValueError(f"stage {k} holds {in_bytes(held)} of activations after {schedule.label(task)}, "
                                 f"over its cap of {in_bytes(limit)}")
