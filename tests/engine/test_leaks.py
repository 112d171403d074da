"""A long run neither grows memory nor leaves threads or tensors behind."""
import gc
import threading
import warnings

import torch
from small_models import mlp
from torch import nn

from engine import GPipe


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def live_tensors() -> int:
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on some torch objects warns about deprecations
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def test_hundreds_of_steps_do_not_grow_memory():
    """After 100 steps (warm caches, grown allocator pools), 300 more leave the same tensors alive
    (one tensor kept per step would show as 300), the same threads, and the resident memory within
    8 MiB (a leak of 28 KiB a step would cross it)."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 16), torch.randint(0, 3, (16,))
    model = mlp(dropout=0.1, batch_norm=True)
    pipe = GPipe(model, 3, chunks=4, checkpoint="except_last", deferred_batch_norm=True, seed=0)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()

    def train(steps):
        for _ in range(steps):
            opt.zero_grad()
            pipe.step(x, y, loss_fn)
            opt.step()

    train(100)
    tensors, rss, threads = live_tensors(), resident_bytes(), threading.active_count()
    train(300)
    assert live_tensors() == tensors
    assert resident_bytes() - rss < 8 * 2 ** 20
    assert threading.active_count() == threads
    assert all(stage.ledger.live == 0 for stage in pipe._local.chunks.values())
