"""The wire format between stage processes: a message is one frame of bytes, a header then a payload.

The header (int64 words) names the call and task (step, kind, micro-batch, chunk), carries the call's
decision (engine/call.py), and describes each tensor of the value (dtype, shape, requires_grad) or
its absence (None), so uneven micro-batches and tuples cross processes as they cross threads. A
small payload travels inside the frame, into a receive the peer posted in advance; a larger one
follows as one message per tensor. Frames are packed with `struct` on NumPy views, several times
cheaper than torch ops.
"""
from __future__ import annotations

import functools
import math
import struct
from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch

from ..call import Decision

FRAME_BYTES = 512 * 1024  # capacity of a preposted receive; larger payloads follow separately
KINDS = ("act", "grad", "end", "done", "bye", "call")
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
          torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
_FORMS = ("tensor", "tuple", "none")
_FIXED = 10  # words before the per-entry descriptions
_ALIGN = 16
_MASK64 = (1 << 64) - 1


NO_DECISION = Decision(0, 0)


class Malformed(ValueError):
    """A message that does not read as this format says; nothing of it is executed or guessed at."""


class Lost(Exception):
    """A lane's connection to `peer` broke (its process has probably died)."""

    def __init__(self, peer: int, error: BaseException):
        super().__init__(peer, error)
        self.peer, self.error = peer, error


class Entry(NamedTuple):  # tuples: built per message, 3x cheaper than frozen dataclasses
    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class Header(NamedTuple):
    step: int
    kind: str
    micro: int
    chunk: int
    decision: Decision
    form: str                          # "tensor", "tuple" or "none"
    entries: tuple[Optional[Entry], ...]
    inline: bool                       # payload inside the frame, else one message per tensor
    size: int                          # bytes of the header in the frame (padded)

    @property
    def payload_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries if e is not None)


class Arrival(NamedTuple):
    """One message as a lane hands it to the stage thread."""

    peer: int
    header: Header
    tensors: list         # on this stage's device
    ready: object         # what to wait for before using them (NCCL works, an event), or None
    start: float          # the stage thread's reading time
    end: float


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def describe(value) -> tuple[str, list[Optional[torch.Tensor]]]:
    """The form of a value ("tensor", "tuple" of tensors or Nones, or "none") and its entries."""
    if value is None:
        return "none", []
    if isinstance(value, torch.Tensor):
        return "tensor", [value]
    return "tuple", list(value)


def rebuild_value(form: str, tensors: Sequence[Optional[torch.Tensor]]):
    """The inverse of `describe`."""
    return None if form == "none" else tensors[0] if form == "tensor" else tuple(tensors)


_NUMPY = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
          torch.complex64: np.complex64, torch.complex128: np.complex128, torch.int64: np.int64,
          torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8, torch.uint8: np.uint8,
          torch.bool: np.bool_}


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's bytes as a flat NumPy uint8 array (a view unless it is not contiguous)."""
    if tensor.dtype in _NUMPY:
        return np.ascontiguousarray(tensor.detach().numpy()).reshape(-1).view(np.uint8)
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()  # bfloat16: no NumPy type


def encode(step: int, kind: str, micro: int, chunk: int, decision: Decision, value,
           inline: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The frame of a message and the tensors that follow it (none if the payload fits and `inline`)."""
    header, present = encode_header(step, kind, micro, chunk, decision, value)
    size = len(header) + payload_bytes(present)
    if not inline or size > FRAME_BYTES:
        return torch.frombuffer(bytearray(header), dtype=torch.uint8), [t.detach().contiguous() for t in present]
    view = np.empty(size, dtype=np.uint8)
    view[:len(header)] = np.frombuffer(header, dtype=np.uint8)
    view[72] = 1  # word 9, little-endian: the payload is inline
    write_tensors(view, len(header), present)
    return torch.from_numpy(view), []


def encode_header(step: int, kind: str, micro: int, chunk: int, decision: Decision, value) -> tuple[bytes, list]:
    """A message's header as bytes (payload not inline) and the tensors that follow it, without encode's
    tensor frame: a send runs cold after a task, where each torch call costs microseconds."""
    form, tensors = describe(value)
    words = [0, step, KINDS.index(kind), micro, chunk, decision.batch, _signed(decision.seed),
             _FORMS.index(form), len(tensors), 0]
    present = []
    for t in tensors:
        if t is None:
            words.append(0)
        else:
            words += [1, DTYPES.index(t.dtype), int(t.requires_grad), t.dim(), *t.shape]
            present.append(t)
    words[0] = len(words)
    return struct.pack(f"<{len(words)}q", *words).ljust(_padded(8 * len(words)), b"\0"), present


def tensor_bytes(tensors) -> int:
    """Bytes the tensors hold, unpadded (None counts nothing): what a message or a send in flight carries."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def payload_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes the tensors take laid out one after another, each padded to 16 bytes."""
    return sum(_padded(t.numel() * t.element_size()) for t in tensors)


def write_tensors(view: np.ndarray, offset: int, tensors: Sequence[torch.Tensor]) -> None:
    """Copy CPU tensors into `view` from `offset` on, one after another, each padded to 16 bytes."""
    for t in tensors:
        size = t.numel() * t.element_size()
        view[offset:offset + size] = _bytes_of(t)
        offset += _padded(size)


def decode_header(view: np.ndarray) -> Header:
    """The header at the start of a frame's NumPy view; Malformed if `encode` did not write it."""
    try:
        length = struct.unpack_from("<q", view, 0)[0]
        if not _FIXED <= length <= len(view) // 8:
            raise Malformed(f"a header of {length} words in a frame of {len(view)} bytes")
        words = struct.unpack_from(f"<{length}q", view, 0)
        entries, position = [], _FIXED
        for _ in range(words[8]):
            if words[position] == 0:
                entries.append(None)
                position += 1
                continue
            ndim = words[position + 3]
            shape = tuple(words[position + 4:position + 4 + ndim])
            if ndim < 0 or len(shape) != ndim or min(shape, default=0) < 0:
                raise Malformed(f"entry {len(entries)} has the shape {shape} of {ndim} dimensions")
            entries.append(Entry(_pick(DTYPES, words[position + 1], "dtype"), shape, bool(words[position + 2])))
            position += 4 + ndim
        if position != length or words[8] < 0:
            raise Malformed(f"{words[8]} entries do not fill a header of {length} words")
        return Header(step=words[1], kind=_pick(KINDS, words[2], "kind"), micro=words[3], chunk=words[4],
                      decision=Decision(batch=words[5], seed=words[6] & _MASK64),
                      form=_pick(_FORMS, words[7], "form"), entries=tuple(entries), inline=bool(words[9]),
                      size=_padded(8 * length))
    except (IndexError, struct.error) as error:
        raise Malformed(f"an unreadable header ({error})") from None


def _pick(table: tuple, index: int, what: str):
    """table[index] for an index that a header gave, or Malformed."""
    if not 0 <= index < len(table):
        raise Malformed(f"no {what} has the number {index}")
    return table[index]


def tensors_in(view: np.ndarray, offset: int, header: Header) -> list[Optional[torch.Tensor]]:
    """Copies of the tensors `header` announces, laid out in `view` from `offset` (the buffer is
    reused); Malformed if `view` ends first."""
    needed = sum(_padded(e.nbytes) for e in header.entries if e is not None)
    if offset < 0 or offset + needed > len(view):
        raise Malformed(f"a payload of {needed} bytes at byte {offset} of a buffer of {len(view)}")
    tensors = []
    for entry in header.entries:
        if entry is None:
            tensors.append(None)
            continue
        size = entry.nbytes
        numpy_type = _NUMPY.get(entry.dtype)
        if numpy_type is None:  # bfloat16: copy the bytes, then view them as the dtype in torch
            tensors.append(torch.from_numpy(view[offset:offset + size].copy()).view(entry.dtype).reshape(entry.shape))
        else:
            tensors.append(torch.from_numpy(view[offset:offset + size].view(numpy_type).reshape(entry.shape).copy()))
        offset += _padded(size)
    return marked(tensors, header)


def empty_tensors(header: Header, device: torch.device) -> list[Optional[torch.Tensor]]:
    """Tensors of the announced dtypes and shapes, to receive a payload that follows the frame."""
    return [None if e is None else torch.empty(e.shape, dtype=e.dtype, device=device) for e in header.entries]


def marked(tensors: list[Optional[torch.Tensor]], header: Header) -> list[Optional[torch.Tensor]]:
    """The received tensors with requires_grad as the sender's had it."""
    return [t if t is None or entry is None or not entry.requires_grad else t.requires_grad_()
            for t, entry in zip(tensors, header.entries)]


# --- what ranks tell each other besides tensors: tables of numbers and short strings ------------

SHORT = 255  # bytes of a string in a table: names and labels ("F", "cpu", "act"), not text
_TABLE = struct.Struct("<qq")  # rows, distinct strings


def pack_table(schema: str, rows: Sequence[tuple]) -> bytes:
    """`rows` in a typed layout, never pickle. `schema` types each field: "i" int, "n" count or None,
    "f" float, "s" short string. Layout: row count, distinct strings (length byte, UTF-8), then one
    column per field, float64 for "f", else int64 (a string as its index, None as -1)."""
    columns = list(zip(*rows)) if rows else [()] * len(schema)
    strings = sorted({text for kind, column in zip(schema, columns) if kind == "s" for text in column})
    number = {text: i for i, text in enumerate(strings)}
    parts = [_TABLE.pack(len(rows), len(strings))]
    for text in strings:
        raw = text.encode()
        if len(raw) > SHORT:
            raise ValueError(f"{text[:40]!r}...: a table's strings are at most {SHORT} bytes")
        parts += [bytes([len(raw)]), raw]
    values = []
    for kind, column in zip(schema, columns):
        values += [number[text] for text in column] if kind == "s" else \
            [-1 if value is None else value for value in column] if kind == "n" else column
    parts.append(_columns(schema, len(rows)).pack(*values))  # one call: NumPy per column costs more
    return b"".join(parts)


def unpack_table(schema: str, data: bytes, offset: int = 0) -> tuple[list[tuple], int]:
    """The rows `pack_table(schema, ...)` laid out in `data` from `offset`, and the offset after; or Malformed."""
    try:
        count, distinct = _TABLE.unpack_from(data, offset)
    except struct.error:
        raise Malformed(f"a table cut short at byte {offset} of {len(data)}") from None
    offset += _TABLE.size
    if not 0 <= count <= len(data) or not 0 <= distinct <= count * schema.count("s") or \
            offset + distinct + 8 * count * len(schema) > len(data):
        raise Malformed(f"a table of {count} rows and {distinct} strings in {len(data) - offset} bytes")
    strings = []
    for _ in range(distinct):
        size = data[offset]
        try:
            strings.append(bytes(data[offset + 1:offset + 1 + size]).decode())
        except UnicodeDecodeError:
            raise Malformed(f"a string at byte {offset} that is not UTF-8") from None
        offset += 1 + size
    if offset + 8 * count * len(schema) > len(data):
        raise Malformed(f"a table of {count} rows cut short at byte {len(data)}")
    layout = _columns(schema, count)
    values, offset = layout.unpack_from(data, offset), offset + layout.size
    columns = []
    for i, kind in enumerate(schema):
        column = values[i * count:(i + 1) * count]
        if kind == "s" and count and not 0 <= min(column) <= max(column) < distinct:
            raise Malformed(f"a string's number out of the {distinct} of its table")
        if kind == "n" and count and min(column) < -1:
            raise Malformed(f"a count of {min(column)}")
        columns.append([strings[i] for i in column] if kind == "s" else
                       [None if value == -1 else value for value in column] if kind == "n" else column)
    return list(zip(*columns)) if count else [], offset


@functools.lru_cache(maxsize=256)
def _columns(schema: str, count: int) -> struct.Struct:
    """The layout of a table's columns: `count` float64 or int64 values per field of `schema`."""
    return struct.Struct("<" + "".join(f"{count}{'d' if kind == 'f' else 'q'}" for kind in schema))
