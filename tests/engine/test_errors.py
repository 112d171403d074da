"""Bad input gets a clear error; a failure inside a stage reaches the caller, stops every worker, leaks nothing."""
import gc
import threading
import time
import weakref

import pytest
import torch
from small_models import mlp
from torch import nn

from engine import GPipe

LOSS = nn.CrossEntropyLoss()


@pytest.mark.parametrize("module,error,words", [
    (nn.Linear(4, 4), TypeError, "nn.Sequential"),
    (nn.Sequential(), ValueError, "empty"),
])
def test_module_must_be_a_nonempty_sequential(module, error, words):
    with pytest.raises(error, match=words):
        GPipe(module, 1)


@pytest.mark.parametrize("balance,error,words", [
    ([2, 2], ValueError, r"sums to 4 but the model has 9 layers"),
    ([5, 0, 4], ValueError, r"balance\[1\]=0"),
    ([6, -1, 4], ValueError, r"balance\[1\]=-1"),
    (10, ValueError, r"balance=10 stages but the model has only 9 layers"),
    (0, ValueError, r"balance=0"),
    ("2", TypeError, "balance must be"),
    ([4.5, 4.5], TypeError, r"balance\[0\]=4.5"),
])
def test_bad_balance(balance, error, words):
    with pytest.raises(error, match=words):
        GPipe(mlp(), balance)


def test_devices_must_match_stages():
    with pytest.raises(ValueError, match="devices has 1 entries but there are 2 stages"):
        GPipe(mlp(), 2, devices=["cpu"])
    with pytest.raises(ValueError, match=r"devices\[1\]='gpu7' is not a device name"):
        GPipe(mlp(), 2, devices=["cpu", "gpu7"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a host without CUDA")
def test_cuda_on_a_cpu_host_says_so():
    with pytest.raises(ValueError, match=r"devices\[1\]='cuda:0' is not available: this host has no CUDA GPU"):
        GPipe(mlp(), 2, devices=["cpu", "cuda:0"])


@pytest.mark.parametrize("options,error,words", [
    (dict(checkpoint="sometimes"), ValueError, "checkpoint='sometimes' is not a checkpoint mode"),
    (dict(chunks=0), ValueError, "chunks=0"),
    (dict(chunks=2.5), ValueError, "chunks=2.5"),
    (dict(threads_per_stage=0), ValueError, "threads_per_stage=0"),
    (dict(seed="x"), TypeError, "seed='x'"),
])
def test_bad_options(options, error, words):
    with pytest.raises(error, match=words):
        GPipe(mlp(), 2, **options)


def test_bad_call_arguments(batch):
    x, y = batch
    pipe = GPipe(mlp(), 2, chunks=4)
    with pytest.raises(TypeError, match="inputs must be a tensor or a non-empty tuple of tensors, got list"):
        pipe.step([x], y, LOSS)
    with pytest.raises(TypeError, match="inputs must be"):
        pipe.step((x, "text"), y, LOSS)
    with pytest.raises(ValueError, match="targets must have the inputs' batch size 24 in dim 0, got batch size 23"):
        pipe.step(x, y[:23], LOSS)
    with pytest.raises(TypeError, match="targets must be a tensor"):
        pipe.step(x, [0] * 24, LOSS)
    with pytest.raises(ValueError, match="inputs are an empty batch"):
        pipe.step(x[:0], y[:0], LOSS)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        pipe.step(x, y, "mse")
    with pytest.raises(TypeError, match="inputs must be"):
        pipe("not a tensor")


def wrong_width_model():
    model = mlp()
    model[7] = nn.Linear(5, 16)  # layer 7 expects 5 features and gets 16
    return model


@pytest.mark.timeout(30)
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_stage_failure_reaches_the_caller_with_stage_and_micro_batch(batch, checkpoint):
    x, y = batch
    pipe = GPipe(wrong_width_model(), 3, chunks=4, checkpoint=checkpoint)  # layer 7 is in stage 2
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"\[stage 2, micro-batch 0, forward \(F0\)\].*mat1 and mat2 shapes"):
        pipe.step(x, y, LOSS)
    assert time.perf_counter() - start < 10
    assert stage_threads() == 3  # the pipe's three workers, idle again
    with pytest.raises(RuntimeError):
        pipe.step(x, y, LOSS)
    assert stage_threads() == 3
    pipe.close()
    assert wait_for(lambda: stage_threads() == 0)


def stage_threads():
    return sum(t.name.startswith("gpipe-stage") for t in threading.enumerate())


def wait_for(condition, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.timeout(30)
def test_workers_end_with_their_pipe(batch):
    x, y = batch
    pipe = GPipe(mlp(), 4, chunks=2)
    pipe.step(x, y, LOSS)
    assert stage_threads() == 4
    del pipe
    gc.collect()
    assert wait_for(lambda: stage_threads() == 0)


@pytest.mark.timeout(30)
def test_failure_in_backward_and_in_loss_keep_their_types(batch):
    x, y = batch

    class Explodes(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            raise ZeroDivisionError("boom in backward")

    class Layer(nn.Module):
        def forward(self, t):
            return Explodes.apply(t)

    model = mlp()
    model.insert(2, Layer())
    pipe = GPipe(model, 3, chunks=4)
    with pytest.raises(ZeroDivisionError, match=r"\[stage 0, micro-batch 3, backward \(B3\)\] boom in backward"):
        pipe.step(x, y, LOSS)

    def bad_loss(out, target):
        raise KeyError("no such loss")

    with pytest.raises(KeyError, match=r"stage 2, micro-batch 3, forward"):  # the first loss: F3's (the
        pipe.step(x, y, bad_loss)                                              # others' come with their R)
    with pytest.raises(TypeError, match="loss_fn must return a scalar tensor"):
        pipe.step(x, y, lambda out, target: out)


@pytest.mark.timeout(30)
def test_same_pipe_works_after_a_failure(batch):
    x, y = batch
    model = mlp()
    pipe = GPipe(model, 3, chunks=4)
    with pytest.raises(RuntimeError):
        pipe.step(x[:, :5], y, LOSS)  # wrong input width fails in stage 0
    bad_loss = lambda out, target: 1 / 0  # noqa: E731
    outputs = []  # weak references to stage 0's outputs, which its graphs hold
    hook = pipe.partitions[0].register_forward_hook(lambda module, args, out: outputs.append(weakref.ref(out)))
    with pytest.raises(ZeroDivisionError):
        pipe.step(x, y, bad_loss)  # fails in the last stage, after the others kept their graphs
    hook.remove()
    assert outputs and all(ref() is None for ref in outputs)  # the dropped graphs are freed
    assert all(stage.ledger.live == 0 for stage in pipe._local.chunks.values())  # and released from the ledger
    for p in model.parameters():
        p.grad = None
    loss = pipe.step(x, y, LOSS)
    reference = mlp()
    expected = LOSS(reference(x), y)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    assert all(stage.ledger.live == 0 for stage in pipe._local.chunks.values())


@pytest.mark.timeout(30)
def test_failure_in_forward_only_call(batch):
    x, _ = batch
    pipe = GPipe(wrong_width_model(), 3, chunks=2)
    with pytest.raises(RuntimeError, match=r"stage 2, micro-batch 0, forward"):
        pipe(x)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_a_failing_loss_leaves_nothing_held(batch, checkpoint):
    x, y = batch
    pipe = GPipe(mlp(), 2, chunks=4, checkpoint=checkpoint)  # "always": the loss comes with R, after its graph
    task = "recompute" if checkpoint == "always" else "forward"
    with pytest.raises(ZeroDivisionError, match=rf"stage 1, micro-batch \d, {task}"):
        pipe.step(x, y, lambda out, target: 1 / 0)
    assert all(chunk.ledger.live == 0 for chunk in pipe._local.chunks.values())
    assert pipe.step(x, y, LOSS).item() > 0


def test_weights_tied_across_stages_are_refused_naming_both_layers():
    """Each stage holds its own weights (its own copy, in a stage process or on a GPU of its own), so
    a parameter two stages would share cannot get one gradient: refused, unless one stage holds both."""
    embedding, head = nn.Embedding(10, 8), nn.Linear(8, 10)
    head.weight = embedding.weight
    model = nn.Sequential(embedding, nn.Linear(8, 8), head)
    with pytest.raises(ValueError, match=r"layer '0' \(stage 0\) and layer '2' \(stage 1\) share a parameter "
                                         r"\(0.weight is 2.weight\)"):
        GPipe(model, 2)
    assert len(GPipe(model, [3]).partitions) == 1
