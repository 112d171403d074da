"""Behaviours users of torchgpipe and of plain nn.BatchNorm expect from a pipeline."""

import pytest
import torch
from small_models import grads, mlp
from torch import nn
from torch.optim.swa_utils import update_bn

from engine import GPipe, balance_by_size, balance_by_time

LOSS = nn.CrossEntropyLoss()


def batch_norm_layers(model):
    return [m for m in model.modules() if isinstance(m, nn.BatchNorm1d)]


def whole_batch_reference(model, x, momentum):
    """The first BN layer's statistics after nn.BatchNorm sees the whole mini-batch once."""
    reference = nn.BatchNorm1d(16, momentum=momentum)
    reference.load_state_dict(model[1].state_dict())
    reference.train()(model[0](x).detach())
    return reference


# --- 1. deferred batch norm in a forward-only training-mode call --------------------------------

@pytest.mark.parametrize("momentum", [0.1, 0.5, None])
def test_training_mode_forward_updates_running_stats_once_like_whole_batch(batch, momentum):
    x, _ = batch
    model = mlp(batch_norm=True, depth=1)
    model[1].momentum = momentum
    pipe = GPipe(model, 2, chunks=4, deferred_batch_norm=True)
    pipe.train()
    for calls in (1, 2):
        reference = whole_batch_reference(model, x, momentum)
        pipe(x)
        assert int(model[1].num_batches_tracked) == calls
        assert torch.allclose(model[1].running_mean, reference.running_mean, rtol=1e-5, atol=1e-6)
        assert torch.allclose(model[1].running_var, reference.running_var, rtol=1e-5, atol=1e-6)


def test_forward_then_step_with_cumulative_average_counts_both(batch):
    x, y = batch
    model = mlp(batch_norm=True, depth=1)
    model[1].momentum = None
    reference = nn.BatchNorm1d(16, momentum=None)
    pipe = GPipe(model, 2, chunks=3, deferred_batch_norm=True)
    pipe(x)
    reference(model[0](x).detach())
    pipe.step(x, y, LOSS)
    reference(model[0](x).detach())
    assert int(model[1].num_batches_tracked) == 2
    assert torch.allclose(model[1].running_mean, reference.running_mean, rtol=1e-5, atol=1e-6)
    assert torch.allclose(model[1].running_var, reference.running_var, rtol=1e-5, atol=1e-6)


def test_eval_mode_forward_changes_no_statistics(batch):
    x, _ = batch
    model = mlp(batch_norm=True)
    pipe = GPipe(model, 2, chunks=4, deferred_batch_norm=True).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pipe(x)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_swa_update_bn_recomputes_the_statistics_through_the_pipe(batch):
    x, _ = batch
    model = mlp(batch_norm=True, depth=1)
    pipe = GPipe(model, 2, chunks=4, deferred_batch_norm=True)
    loader = [x[:12], x[12:]]
    update_bn(loader, pipe)
    reference = nn.BatchNorm1d(16, momentum=None)  # what update_bn computes without a pipeline
    for part in loader:
        reference(model[0](part).detach())
    assert model[1].momentum == 0.1  # update_bn put it back
    assert int(model[1].num_batches_tracked) == 2
    assert torch.allclose(model[1].running_mean, reference.running_mean, rtol=1e-5, atol=1e-6)
    assert torch.allclose(model[1].running_var, reference.running_var, rtol=1e-5, atol=1e-6)


# --- 2. balancers profile training, whatever mode the model is in --------------------------------

def dropout_heavy_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.5), nn.Dropout(0.5), nn.Dropout(0.5),
                         nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 3))


def test_balance_by_size_counts_dropout_masks_even_in_eval_mode(batch):
    x, _ = batch
    model = dropout_heavy_model()
    trained = balance_by_size(2, model, x[:6])
    model.eval()
    assert balance_by_size(2, model, x[:6]) == trained
    assert not model.training and not any(m.training for m in model.modules())


class NeedsTraining(nn.Module):
    def forward(self, t):
        assert self.training, "profiled in eval mode"
        return t * 2


def test_balance_by_time_profiles_training_and_leaves_the_mode(batch):
    x, _ = batch
    model = nn.Sequential(nn.Linear(16, 16), NeedsTraining(), nn.Linear(16, 16), nn.Linear(16, 3)).eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert len(balance_by_time(2, model, x[:6], repeat=1)) == 2
    assert not any(m.training for m in model.modules())
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


# --- 3. hooks on a partition run for every micro-batch -------------------------------------------

def test_partition_hooks_see_stage_inputs_and_outputs_forward_and_recompute(batch):
    x, y = batch
    model = mlp()
    pipe = GPipe(model, 3, chunks=4, checkpoint="always")
    seen = {"pre": [], "post": []}
    middle = pipe.partitions[1]
    middle.register_forward_pre_hook(lambda mod, args: seen["pre"].append(args[0].shape))
    middle.register_forward_hook(lambda mod, args, out: seen["post"].append((args[0].shape, out.shape)))
    pipe.step(x, y, LOSS)
    assert seen["pre"] == [torch.Size([6, 16])] * 8  # 4 forwards + 4 recomputes
    assert seen["post"] == [(torch.Size([6, 16]), torch.Size([6, 16]))] * 8
    seen["pre"].clear()
    pipe(x)
    assert len(seen["pre"]) == 4


def test_a_forward_hook_may_replace_the_stage_output(batch):
    x, _ = batch
    model = mlp()
    pipe = GPipe(model, 2, chunks=2).eval()
    plain = pipe(x)
    pipe.partitions[0].register_forward_hook(lambda mod, args, out: out * 0)
    zeroed = pipe(x)
    assert not torch.equal(plain, zeroed)
    assert torch.allclose(zeroed, model[5:](torch.zeros(24, 16)))


# --- 4. a short last batch trains like any other -------------------------------------------------

@pytest.mark.parametrize("size,expected", [(3, 3), (5, 3), (1, 1)])
def test_a_batch_smaller_than_chunks_runs_as_many_micro_batches_as_torch_chunk_gives(batch, size, expected):
    x, y = batch
    model = mlp()
    pipe = GPipe(model, 2, chunks=4)
    loss = pipe.step(x[:size], y[:size], LOSS)
    assert pipe.trace.micro_batches == expected == len(x[:size].chunk(4))
    reference = mlp()
    expected_loss = LOSS(reference(x[:size]), y[:size])
    expected_loss.backward()
    assert loss.item() == pytest.approx(expected_loss.item(), rel=1e-6)
    for a, b in zip(grads(model), grads(reference)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert pipe(x[:size]).shape == (size, 3)


def test_an_epoch_with_a_short_last_batch_completes(batch):
    x, y = batch
    pipe = GPipe(mlp(), 2, chunks=8)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=10, drop_last=False)
    sizes = []
    for inputs, targets in loader:  # 10, 10, 4
        optimizer.zero_grad()
        pipe.step(inputs, targets, LOSS)
        optimizer.step()
        sizes.append(pipe.trace.micro_batches)
    assert sizes == [len(torch.empty(10).chunk(8)), len(torch.empty(10).chunk(8)), 4]


# --- 5. extra positional arguments fail before any work ------------------------------------------

def test_extra_positional_arguments_are_a_clear_type_error(batch):
    x, y = batch
    calls = []
    model = mlp()
    model[0].register_forward_hook(lambda *args: calls.append(1))
    pipe = GPipe(model, 2, chunks=2)
    with pytest.raises(TypeError, match=r"one input value, got 2 positional arguments.*pipe\(\(a, b\)\)"):
        pipe(x, x)
    with pytest.raises(TypeError, match="positional"):
        pipe.step(x, y, LOSS, print)
    assert calls == [], "refused before any layer ran"
