"""Reproducible randomness for pipeline stages: one random stream per (step, layer, micro-batch).

PyTorch's default CPU generator is one per process and shared by every thread, so stage workers
that draw dropout masks from it race each other, and saving/restoring its state around a
recompute races the same way. Instead, while a stage runs a layer, its random ops draw from a
private generator seeded from (seed, step, layer, micro-batch). The masks then depend on neither
the partition nor thread timing: forward and recompute draw the same bits, and K = 1, 2, 3, 4 draw
the same bits.

Two ways in, by cost. An nn.Dropout (the common case) draws its mask itself: for the length of a
call its `forward` is one that passes the stream's generator to the very ops ATen's dropout runs,
so a dropout costs no more Python calls than torch's own. Anything else that draws (the other
dropout-like modules, a custom layer seen drawing) runs under a thread-local dispatch mode that
hands every random op the generator, at a Python call per op.

Without a user seed, each call's base seed is drawn from torch's own generator, so
`torch.manual_seed` still makes a whole run reproducible.
"""
from __future__ import annotations

import threading
import types
import weakref
from typing import Callable, Optional, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

_MASK64 = (1 << 64) - 1


def mix_seed(*parts: int) -> int:
    """Fold integers into one 64-bit seed with splitmix64, so nearby keys give unrelated streams."""
    state = 0x9E3779B97F4A7C15
    for part in parts:
        state = (state ^ (part & _MASK64)) & _MASK64
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        state = z ^ (z >> 31)
    return state


_RANDOM_MODULES = (nn.modules.dropout._DropoutNd, nn.RReLU, nn.MultiheadAttention)
_running = threading.local()  # .randomness: the StageRandomness whose layer this thread is running


def _streams_itself(module: nn.Module) -> bool:
    """Whether `module` draws through _streamed_dropout: nn.Dropout's own forward, not overridden."""
    return type(module).forward is nn.Dropout.forward


class StageRandomness(TorchDispatchMode):
    """Dispatch mode giving each (layer, micro-batch) its own seeded generator on the stage's thread.

    nn.Dropout modules draw through `_streamed_dropout`, installed for the length of a call. The
    mode costs a Python call per tensor op, so it is switched on only where other random numbers
    are drawn: around each other dropout-like submodule (by forward hooks that act only on this
    stage's worker thread), and around any other layer seen drawing random numbers on a
    training-mode call. (A custom layer that draws nothing on its first training call but does
    later is not caught; draw through a dropout-like module instead.)
    """

    def __init__(self, layers: Sequence[tuple[int, nn.Module]]):
        super().__init__()
        self.base_seed = 0
        # per layer: "modules" (its dropout-like submodules draw from the stream), None (not known
        # yet: run it under the mode and watch), True (draws: run it under the mode), False (never)
        self._kind: dict[int, object] = {}
        self._dropouts: list[nn.Module] = []  # nn.Dropout modules: _streamed_dropout while a call runs
        self.quiet: set[int] = set()  # layers known to draw nothing (kind False): callers may run them as they are
        handles, me = [], weakref.ref(self)
        for layer_id, layer in layers:
            random_parts = [m for m in layer.modules() if isinstance(m, _RANDOM_MODULES)]
            self._kind[layer_id] = "modules" if random_parts else None
            self._dropouts += [m for m in random_parts if _streams_itself(m)]
            for part in (m for m in random_parts if not _streams_itself(m)):
                handles.append(part.register_forward_pre_hook(lambda *_: _hook(me, entering=True)))
                handles.append(part.register_forward_hook(lambda *_: _hook(me, entering=False)))
        remove_when_gone(self, handles)
        self._thread: Optional[int] = None  # the worker thread inside run(), for the hooks
        self._depth = 0
        self._key: tuple[int, int] = (0, 0)
        self._generators: dict[torch.device, torch.Generator] = {}
        self._seeded: dict[torch.device, bool] = {}  # generators seeded since the layer started
        self._drew = False

    def start(self, base_seed: int) -> None:
        """Begin a call whose random streams derive from `base_seed`: its nn.Dropout modules draw
        from them until `finish` (any other caller of them still gets torch's own dropout)."""
        self.base_seed = base_seed
        for module in self._dropouts:  # the instance's own forward, found before the class's
            module.__dict__["forward"] = types.MethodType(_streamed_dropout, module)

    def finish(self) -> None:
        """End the call: the nn.Dropout modules are torch's own again."""
        for module in self._dropouts:
            module.__dict__.pop("forward", None)

    def run(self, layer_id: int, layer: nn.Module, x, micro: int):
        """Run `layer` on micro-batch `micro`, its random ops drawing from the stream of (layer, micro)."""
        kind = self._kind[layer_id]
        if kind is False:
            return layer(x)
        self._key, self._drew = (layer_id, micro), False
        self._seeded.clear()
        self._thread = threading.get_ident()
        _running.randomness = self
        try:
            if kind == "modules":
                return layer(x)
            self._switch(on=True)
            out = layer(x)
            if kind is None and (self._drew or layer.training):
                self._kind[layer_id] = self._drew
                if not self._drew:
                    self.quiet.add(layer_id)
            return out
        finally:
            while self._depth:  # also after an exception, when a forward hook never ran
                self._switch(on=False)
            self._thread = _running.randomness = None

    def _switch(self, on: bool) -> None:
        if on:
            self.__enter__()
            self._depth += 1
        elif self._depth:
            self._depth -= 1
            self.__exit__(None, None, None)

    def generator(self, device: torch.device) -> torch.Generator:
        """The generator for the current (layer, micro-batch) on `device`, freshly seeded on first use."""
        self._drew = True
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
        if device not in self._seeded:
            gen.manual_seed(mix_seed(self.base_seed, *self._key))
            self._seeded[device] = True
        return gen

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Nothing here is compiled; without this PyTorch wraps __torch_dispatch__ in a dynamo guard
        # that costs tens of microseconds per op (and imports torch._dynamo on first use).
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _handler(func)
        if handler is None:
            return func(*args, **kwargs)
        return handler(self, func, args, kwargs)


def _streamed_dropout(module: nn.Dropout, x: torch.Tensor) -> torch.Tensor:
    """nn.Dropout's forward drawing its mask from the running stage's stream: the ops (and so the
    bits) of ATen's dropout, given the generator. Outside a stage's layer it is torch's own."""
    randomness = getattr(_running, "randomness", None)
    p = module.p
    if randomness is None or not module.training or p in (0, 1) or x.numel() == 0:
        return nn.Dropout.forward(module, x)  # no draw, or not a stage's: the same as torch's
    generator = randomness.generator(x.device)
    if not module.inplace and x.device.type in _FUSED_DROPOUT:  # ATen's native_dropout: a bool mask
        mask = torch.empty_like(x, dtype=torch.bool).bernoulli_(1 - p, generator=generator)
        return x * mask * (1.0 / (1.0 - p))
    noise = torch.empty_like(x).bernoulli_(1 - p, generator=generator).div_(1 - p)
    return x.mul_(noise) if module.inplace else x * noise


_FUSED_DROPOUT = ("cuda", "xpu", "lazy", "privateuseone")  # where ATen's dropout is native_dropout


def _hook(randomness: weakref.ref, entering: bool) -> None:
    """Forward (pre-)hook of a dropout-like module: switch its stage's mode on or off, but only
    when that stage's worker is the one running it."""
    mode = randomness()
    if mode is not None and mode._thread == threading.get_ident():
        mode._switch(on=entering)


def remove_when_gone(owner, handles: list) -> None:
    """Remove the hooks `handles` registered on the model's layers once `owner` is garbage-collected."""
    weakref.finalize(owner, lambda: [handle.remove() for handle in handles])


# --- routing each random op to a private generator -------------------------------------------

_FALLBACK_LOCK = threading.Lock()
_handlers: dict = {}


def _handler(func) -> Optional[Callable]:
    """How to run `func` reproducibly: None for ops that draw no random numbers."""
    if func not in _handlers:
        _handlers[func] = _make_handler(func)
    return _handlers[func]


def _make_handler(func) -> Optional[Callable]:
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return None
    names = [a.name for a in func._schema.arguments]
    if "generator" in names:
        return _inject_generator
    if func is torch.ops.aten.native_dropout.default:
        return _native_dropout
    twin = _generator_twin(func, names)
    if twin is not None:
        return lambda mode, _func, args, kwargs: _inject_generator(mode, twin, args, kwargs)
    return _seeded_default_generator


def _generator_twin(func, names: list[str]):
    """The overload of `func` that takes the same arguments plus a generator (rand -> rand.generator)."""
    packet = getattr(torch.ops.aten, func._schema.name.split("::")[-1])
    for overload in packet.overloads():
        candidate = getattr(packet, overload)
        other = [a.name for a in candidate._schema.arguments]
        if "generator" in other and [n for n in other if n != "generator"] == names:
            return candidate
    return None


def _device_of(args, kwargs) -> torch.device:
    device = kwargs.get("device")
    if device is not None:
        return torch.device(device)
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def _inject_generator(mode: StageRandomness, func, args, kwargs):
    if kwargs.get("generator") is None:
        kwargs = dict(kwargs, generator=mode.generator(_device_of(args, kwargs)))
    return func(*args, **kwargs)


def _native_dropout(mode: StageRandomness, func, args, kwargs):
    """aten.native_dropout (the fused CUDA path) has no generator argument: redo it with one."""
    bound = dict(zip(("input", "p", "train"), args), **kwargs)
    x, p, train = bound["input"], bound["p"], bound.get("train")
    if train is False:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    mask = torch.empty_like(x, dtype=torch.bool).bernoulli_(1.0 - p, generator=mode.generator(x.device))
    scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
    return x * mask * scale, mask


def _seeded_default_generator(mode: StageRandomness, func, args, kwargs):
    """Ops with no generator argument at all (fused attention or RNN dropout): run them on the
    process-wide generator, reseeded for this layer, under a lock so stages cannot interleave."""
    bound = dict(zip((a.name for a in func._schema.arguments), args), **kwargs)
    if bound.get("dropout_p", bound.get("dropout", 1)) == 0 or bound.get("train") is False:
        return func(*args, **kwargs)
    device = _device_of(args, kwargs)
    default = torch.default_generator if device.type == "cpu" else torch.cuda.default_generators[device.index or 0]
    with _FALLBACK_LOCK:
        state = default.get_state()
        default.manual_seed(mode.generator(device).initial_seed())
        try:
            return func(*args, **kwargs)
        finally:
            default.set_state(state)
