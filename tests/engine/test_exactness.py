"""Gradients do not depend on the partition: bitwise across K and checkpoint modes, close to one device."""
import pytest
import torch
from small_models import grads, mlp
from torch import nn

from engine import GPipe

LOSS = nn.CrossEntropyLoss()


def pipelined_grads(model_fn, inputs, targets, stages, chunks=4, steps=1, **options):
    model = model_fn()
    pipe = GPipe(model, stages, chunks=chunks, threads_per_stage=1, **options)
    losses = [pipe.step(inputs, targets, LOSS) for _ in range(steps)]
    return grads(model), losses, model


def assert_bitwise(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
def test_bitwise_identical_for_every_partition(batch, checkpoint):
    x, y = batch
    reference, _, _ = pipelined_grads(mlp, x, y, 1, checkpoint="never")
    for stages in (1, 2, 3, 4):
        got, _, _ = pipelined_grads(mlp, x, y, stages, checkpoint=checkpoint)
        assert_bitwise(got, reference)


def test_uneven_balance_and_uneven_chunks_still_bitwise():
    torch.manual_seed(3)
    x, y = torch.randn(23, 16), torch.randint(0, 3, (23,))  # torch.chunk(23, 4) -> 6, 6, 6, 5
    reference, _, _ = pipelined_grads(mlp, x, y, 1)
    got, _, _ = pipelined_grads(mlp, x, y, [1, 6, 2])
    assert_bitwise(got, reference)


def test_matches_unpipelined_full_batch_float32(batch):
    x, y = batch
    model = mlp()
    LOSS(model(x), y).backward()
    for stages in (1, 2, 4):
        for checkpoint in ("never", "always"):
            got, losses, _ = pipelined_grads(mlp, x, y, stages, checkpoint=checkpoint)
            for g, p in zip(got, model.parameters()):
                assert torch.allclose(g, p.grad, rtol=1e-5, atol=1e-6)
            assert losses[0].item() == pytest.approx(LOSS(model(x), y).item(), rel=1e-6)


def test_matches_unpipelined_full_batch_float64(batch):
    x, y = batch
    model = mlp(dtype=torch.float64)
    LOSS(model(x.double()), y).backward()
    got, _, _ = pipelined_grads(lambda: mlp(dtype=torch.float64), x.double(), y, 3, chunks=5)
    for g, p in zip(got, model.parameters()):
        assert torch.allclose(g, p.grad, rtol=0, atol=1e-12)


def test_tuple_inputs_pass_between_stages():
    class Mix(nn.Module):  # takes (features, scale) and hands on a tuple
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, pair):
            features, scale = pair
            return torch.relu(self.linear(features)) * scale, scale

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 2)

        def forward(self, pair):
            return self.linear(pair[0])

    def model():
        torch.manual_seed(0)
        return nn.Sequential(Mix(), Mix(), Mix(), Head())

    torch.manual_seed(2)
    x, s, y = torch.randn(12, 8), torch.rand(12, 1), torch.randint(0, 2, (12,))
    reference = model()
    LOSS(reference((x, s)), y).backward()
    got, _, _ = pipelined_grads(model, (x, s), y, 4, chunks=3)
    for g, p in zip(got, reference.parameters()):
        assert torch.allclose(g, p.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("run", range(6))
def test_dropout_with_seed_is_bitwise_for_every_partition(batch, run):
    x, y = batch
    model_fn = lambda: mlp(dropout=0.5)  # noqa: E731
    reference, ref_losses, _ = pipelined_grads(model_fn, x, y, 1, steps=2, seed=run, checkpoint="never")
    for stages in (2, 3, 4):
        for checkpoint in ("never", "always"):
            got, losses, _ = pipelined_grads(model_fn, x, y, stages, steps=2, seed=run, checkpoint=checkpoint)
            assert_bitwise(got, reference)
            assert [loss.item() for loss in losses] == [loss.item() for loss in ref_losses]


def test_dropout_masks_change_between_steps_and_seeds(batch):
    x, y = batch
    model = mlp(dropout=0.5)
    pipe = GPipe(model, 2, chunks=4, seed=0)
    first, second = pipe.step(x, y, LOSS), pipe.step(x, y, LOSS)
    assert first.item() != second.item()  # same weights, new masks
    other = GPipe(mlp(dropout=0.5), 2, chunks=4, seed=1).step(x, y, LOSS)
    assert other.item() != first.item()


def test_recompute_reproduces_dropout_without_seed(batch):
    """No seed: masks come from torch's RNG, yet forward and recompute still agree, so the gradients
    equal the no-recompute run started from the same torch.manual_seed."""
    x, y = batch
    results = []
    for checkpoint in ("never", "always"):
        model = mlp(dropout=0.5)
        torch.manual_seed(42)
        GPipe(model, 3, chunks=4, checkpoint=checkpoint).step(x, y, LOSS)
        results.append(grads(model))
    assert_bitwise(results[0], results[1])


def capture_batch_norm_inputs(model):
    seen = {}
    for layer in model:
        if isinstance(layer, nn.BatchNorm1d):
            layer.register_forward_pre_hook(lambda mod, args: seen.setdefault(mod, []).append(args[0].detach()))
    return seen


def test_deferred_batch_norm_running_stats_equal_whole_batch(batch):
    """Each BN layer's running stats equal nn.BatchNorm run once on everything that layer saw in the
    mini-batch; the recompute passes (checkpoint="always") must not count a second time."""
    x, y = batch
    model = mlp(batch_norm=True)
    seen = capture_batch_norm_inputs(model)
    pipe = GPipe(model, 3, chunks=4, deferred_batch_norm=True, checkpoint="always")
    layers = [m for m in model if isinstance(m, nn.BatchNorm1d)]
    for _ in range(2):
        seen.clear()
        references = []
        for layer in layers:
            reference = nn.BatchNorm1d(16)
            reference.load_state_dict(layer.state_dict())
            references.append(reference)
        pipe.step(x, y, LOSS)
        for layer, reference in zip(layers, references):
            forwards, recomputes = seen[layer][:4], seen[layer][4:]
            assert len(recomputes) == 4
            reference(torch.cat(forwards))
            assert torch.allclose(layer.running_mean, reference.running_mean, rtol=1e-5, atol=1e-6)
            assert torch.allclose(layer.running_var, reference.running_var, rtol=1e-5, atol=1e-6)
    assert all(int(m.num_batches_tracked) == 2 for m in layers)


def test_deferred_batch_norm_with_cumulative_average(batch):
    x, y = batch
    model = mlp(batch_norm=True, depth=1)
    model[1].momentum = None
    reference = nn.BatchNorm1d(16, momentum=None)
    pipe = GPipe(model, 2, chunks=3, deferred_batch_norm=True)
    for _ in range(3):
        pipe.step(x, y, LOSS)
        reference(model[0](x).detach())
    assert torch.allclose(model[1].running_mean, reference.running_mean, rtol=1e-5, atol=1e-6)
    assert torch.allclose(model[1].running_var, reference.running_var, rtol=1e-5, atol=1e-6)


def test_plain_batch_norm_counts_each_micro_batch_once_despite_recompute(batch):
    x, y = batch
    stats = []
    for checkpoint in ("never", "always"):
        model = mlp(batch_norm=True)
        GPipe(model, 2, chunks=4, checkpoint=checkpoint).step(x, y, LOSS)
        bns = [m for m in model if isinstance(m, nn.BatchNorm1d)]
        assert all(int(m.num_batches_tracked) == 4 for m in bns)
        stats.append([(m.running_mean.clone(), m.running_var.clone()) for m in bns])
    for (mean_a, var_a), (mean_b, var_b) in zip(*stats):
        assert torch.equal(mean_a, mean_b) and torch.equal(var_a, var_b)


def test_batch_norm_gradients_bitwise_across_partitions(batch):
    x, y = batch
    model_fn = lambda: mlp(batch_norm=True)  # noqa: E731
    reference, _, _ = pipelined_grads(model_fn, x, y, 1, deferred_batch_norm=True)
    for stages in (2, 4):
        got, _, _ = pipelined_grads(model_fn, x, y, stages, deferred_batch_norm=True, checkpoint="always")
        assert_bitwise(got, reference)


def test_optimizer_loop_trains_and_matches_single_device():
    torch.manual_seed(5)
    x = torch.randn(64, 16)
    y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()  # a learnable 3-class rule
    reference = mlp()
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    model = mlp()
    pipe = GPipe(model, 3, chunks=4, checkpoint="always")
    opt = torch.optim.Adam(pipe.parameters(), lr=0.01)
    losses, ref_losses = [], []
    for _ in range(30):
        opt.zero_grad()
        losses.append(pipe.step(x, y, LOSS).item())
        opt.step()
        ref_opt.zero_grad()
        loss = LOSS(reference(x), y)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert losses == pytest.approx(ref_losses, rel=1e-4, abs=1e-5)
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def test_partitions_are_the_models_own_layers():
    model = mlp()
    pipe = GPipe(model, 3)
    layers = [layer for partition in pipe.partitions for layer in partition]
    assert all(a is b for a, b in zip(layers, model))
    assert {id(p) for p in pipe.parameters()} == {id(p) for p in model.parameters()}


def nested_dropout_model():
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 16), nn.Sequential(nn.Dropout(0.5), nn.ReLU())) for _ in range(4)]
    return nn.Sequential(*blocks, nn.Linear(16, 3))


def test_dropout_nested_inside_blocks_is_bitwise_for_every_partition(batch):
    x, y = batch
    reference, _, _ = pipelined_grads(nested_dropout_model, x, y, 1, seed=4)
    for stages in (2, 5):
        got, _, _ = pipelined_grads(nested_dropout_model, x, y, stages, seed=4, checkpoint="always")
        assert_bitwise(got, reference)


def test_randomness_hooks_are_inert_outside_the_pipe_and_go_with_it(batch):
    x, y = batch
    import gc

    class OwnDropout(nn.Dropout):  # a forward of its own: drawn through the dispatch mode, by hooks
        def forward(self, t):
            return super().forward(t)
    model = nested_dropout_model()
    model[1][1][0] = OwnDropout(0.5)
    pipe = GPipe(model, 2, chunks=2, seed=0)
    seen = []
    plain, own = model[0][1][0], model[1][1][0]
    plain.register_forward_hook(lambda module, args, out: seen.append("forward" in vars(module)))
    pipe.step(x, y, LOSS)
    assert seen and all(seen)  # inside the call nn.Dropout draws from the stage's stream itself
    assert "forward" not in vars(plain) and len(own._forward_pre_hooks) == 1  # outside it, torch's own
    torch.manual_seed(9)
    direct = model(x)  # the caller's own forward uses torch's RNG as usual
    torch.manual_seed(9)
    assert torch.equal(direct, model(x))
    del pipe
    gc.collect()
    assert len(own._forward_pre_hooks) == 0 and len(own._forward_hooks) == 0


@pytest.mark.parametrize("inplace", [False, True])
def test_dropout_drawing_itself_draws_the_dispatch_modes_bits(batch, inplace):
    class OwnDropout(nn.Dropout):  # the same dropout, drawn through the dispatch mode instead
        def forward(self, t):
            return super().forward(t)

    def model(kind):
        def make():
            torch.manual_seed(0)
            return nn.Sequential(nn.Sequential(nn.Linear(16, 16), kind(0.3, inplace=inplace), nn.ReLU()),
                                 nn.Linear(16, 16), kind(0.5), nn.Linear(16, 3))
        return make
    x, y = batch
    for checkpoint in ("always", "never"):
        streamed, losses, _ = pipelined_grads(model(nn.Dropout), x, y, 2, seed=7, checkpoint=checkpoint)
        moded, mode_losses, _ = pipelined_grads(model(OwnDropout), x, y, 2, seed=7, checkpoint=checkpoint)
        assert_bitwise(streamed, moded)
        assert torch.equal(torch.stack(losses), torch.stack(mode_losses))


def test_custom_random_layer_is_detected_and_reproducible(batch):
    class Noise(nn.Module):  # draws with torch.randn_like: no dropout module to recognise
        def forward(self, t):
            return t + 0.1 * torch.randn_like(t) if self.training else t

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 16), Noise(), nn.ReLU(), nn.Linear(16, 16), Noise(), nn.Linear(16, 3))

    x, y = batch
    reference, _, _ = pipelined_grads(model, x, y, 1, seed=2, steps=2)
    got, _, _ = pipelined_grads(model, x, y, 3, seed=2, steps=2, checkpoint="always")
    assert_bitwise(got, reference)


def test_one_f_one_b_schedule_gives_the_same_gradients_up_to_summation_order(batch):
    x, y = batch
    gpipe_grads, _, _ = pipelined_grads(mlp, x, y, 3, checkpoint="never")
    for checkpoint in ("never", "always"):
        got, _, _ = pipelined_grads(mlp, x, y, 3, checkpoint=checkpoint, schedule="1f1b")
        for a, b in zip(got, gpipe_grads):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
    one, _, _ = pipelined_grads(mlp, x, y, 1, schedule="1f1b")
    four, _, _ = pipelined_grads(mlp, x, y, 4, schedule="1f1b", checkpoint="always")
    assert_bitwise(one, four)  # same order of sums for every K


def test_one_f_one_b_holds_fewer_activations(batch):
    x, y = batch
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        pipe = GPipe(mlp(), 2, chunks=8, checkpoint="never", schedule=schedule)
        pipe.step(x, y, LOSS)
        peaks[schedule] = pipe.trace.memory[-1].activation_peak_bytes
    assert peaks["1f1b"] < peaks["gpipe"] / 3  # the last stage holds 1 micro-batch instead of 8


LATER = [("interleaved", 2), ("zb-h1", 1)]


@pytest.mark.parametrize("schedule,virtual", LATER)
def test_later_schedules_match_gpipe_float32_and_float64(batch, schedule, virtual):
    x, y = batch
    for dtype, tolerance in ((torch.float32, dict(rtol=1e-5, atol=1e-6)), (torch.float64, dict(rtol=0, atol=1e-12))):
        make = lambda: mlp(dtype=dtype, dropout=0.2)  # noqa: E731
        inputs = x.to(dtype)
        reference, ref_losses, _ = pipelined_grads(make, inputs, y, 2, seed=3, checkpoint="never")
        for checkpoint in ("never", "always", "except_last"):
            got, losses, _ = pipelined_grads(make, inputs, y, 2, seed=3, checkpoint=checkpoint, schedule=schedule,
                                             virtual_stages=virtual)
            for a, b in zip(got, reference):
                assert torch.allclose(a, b, **tolerance), (schedule, checkpoint, dtype)
            assert losses[0].item() == pytest.approx(ref_losses[0].item(), rel=1e-6)


@pytest.mark.parametrize("schedule,virtual", LATER)
def test_later_schedules_are_bitwise_reproducible_across_runs_and_k(batch, schedule, virtual):
    x, y = batch
    make = lambda: mlp(dropout=0.3, batch_norm=True)  # noqa: E731
    reference, _, _ = pipelined_grads(make, x, y, 1, seed=1, schedule=schedule, virtual_stages=virtual,
                                      deferred_batch_norm=True)
    again, _, _ = pipelined_grads(make, x, y, 1, seed=1, schedule=schedule, virtual_stages=virtual,
                                  deferred_batch_norm=True)
    assert_bitwise(again, reference)
    for stages in (2, 4):
        for checkpoint in ("never", "always"):
            got, _, _ = pipelined_grads(make, x, y, stages, seed=1, schedule=schedule, virtual_stages=virtual,
                                        checkpoint=checkpoint, deferred_batch_norm=True)
            assert_bitwise(got, reference)


def test_interleaved_places_chunks_round_robin_and_balances_them(batch):
    x, y = batch
    model = mlp(depth=4)  # 9 layers
    pipe = GPipe(model, 2, chunks=4, schedule="interleaved", virtual_stages=3)
    assert pipe.balance == [2, 2, 2, 1, 1, 1] and pipe.stages == 2
    assert [len(p) for p in pipe.partitions] == pipe.balance  # the chunks, in model order
    pipe.step(x, y, LOSS)
    events = pipe.trace.events
    assert {(e.stage, e.chunk) for e in events} == {(c % 2, c) for c in range(6)}
    assert len(pipe.trace.memory) == 2
    with pytest.raises(ValueError, match="needs M \\(micro-batches, chunks=\\) to be a multiple of K=2"):
        GPipe(mlp(), 2, chunks=3, schedule="interleaved", virtual_stages=2)
    with pytest.raises(ValueError, match="5 stages x virtual_stages=2 = 10 chunks but the model has only 9 layers"):
        GPipe(mlp(), 5, chunks=5, schedule="interleaved", virtual_stages=2)
    with pytest.raises(ValueError, match="with virtual_stages=2 it lists the K\\*v chunks, expected a multiple of 2"):
        GPipe(mlp(), [3, 3, 3], chunks=2, schedule="interleaved", virtual_stages=2)
    with pytest.raises(ValueError, match="virtual_stages=2: schedule='gpipe' places 1 chunk on a stage; "
                                         "several chunks per stage: schedule='interleaved', 'zb-v'"):
        GPipe(mlp(), 2, virtual_stages=2)


def test_zero_bubble_runs_weight_tasks_and_holds_at_most_k_micro_batches(batch):
    x, y = batch
    peaks = {}
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        pipe = GPipe(mlp(), 2, chunks=8, checkpoint="never", schedule=schedule)
        pipe.step(x, y, LOSS)
        peaks[schedule] = [m.activation_peak_bytes for m in pipe.trace.memory]
        if schedule == "zb-h1":
            assert sum(e.op == "W" for e in pipe.trace.events) == 2 * 8
    assert peaks["zb-h1"][0] == peaks["1f1b"][0]  # stage 0 holds K=2 micro-batches in both
    assert max(peaks["zb-h1"]) <= max(peaks["1f1b"]) < peaks["gpipe"][0]  # 1F1B's bound, not GPipe's M


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_autocast_runs_every_task_in_bfloat16_and_stays_exact_across_k_and_recompute(batch, schedule):
    """`autocast=torch.bfloat16`: each micro-batch's gradients are those of the model run on it
    under torch.autocast on one device, summed, bitwise for every K and recompute setting; and the
    matrix products really ran in bfloat16 (the plain float32 gradients differ)."""
    x, y = batch
    model = mlp()
    for rows, targets in zip(x.chunk(4), y.chunk(4)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = LOSS(model(rows), targets) * (rows.shape[0] / x.shape[0])
        loss.backward()
    reference = [p.grad for p in model.parameters()]
    for stages in (1, 2, 3):
        for checkpoint in ("never", "always"):
            got, _, _ = pipelined_grads(mlp, x, y, stages, checkpoint=checkpoint, schedule=schedule,
                                        autocast=torch.bfloat16)
            assert_bitwise(got, reference)
    plain, _, _ = pipelined_grads(mlp, x, y, 2)
    assert not all(torch.equal(a, b) for a, b in zip(plain, reference))
    with pytest.raises(ValueError, match=r"autocast=torch.int8: expected None, torch.bfloat16 or torch.float16"):
        GPipe(mlp(), 2, autocast=torch.int8)
