"""CUDA paths: stages on GPUs, exactness, GPU-time events, memory peaks, where a pool's stages land.
Each test whose body can run without a GPU runs on the CPU too (`kind`: "cpu" everywhere, "cuda"
where there is a GPU), so that a mistake in a test's own code fails in CI, not first on a rented
GPU; only what needs a GPU (memory peaks on the device, streams, NCCL, the sizing) is left to
"cuda". Stages on several streams agree within lab.checkup.comparisons.GPU_TOLERANCE of the largest gradient,
not bit for bit (cuBLAS does not promise that across streams); traces across GPUs are in order
within the measured skew of the GPUs' time origins (lab.checkup.comparisons.origin_skew)."""
import time

import pytest
import torch
from small_models import grads, mlp
from torch import nn

from engine import GPipe
from engine.device import StageDevice, pinned
from lab import zoo
from lab.checkup.comparisons import GPU_TOLERANCE, out_of_order, relative_difference, trace_slack
from lab.machine.host import exclusive_gpus

NO_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
# stage processes started by a process that already holds CUDA contexts (this one, after the thread tests)
SHARED_GPUS = pytest.mark.skipif(exclusive_gpus(), reason="EXCLUSIVE_PROCESS GPUs serve one process each: this "
                                 "test's own CUDA context and its stage processes cannot share them (the doctor's "
                                 "rows run each in a process of its own)")
KINDS = pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=NO_GPU)])
# on one pytest-xdist worker: each worker would hold CUDA contexts of its own, which EXCLUSIVE_PROCESS
# GPUs refuse (and a host of many cores would start a worker per core for a few GPU tests)
pytestmark = pytest.mark.xdist_group("gpus")
LOSS = nn.functional.cross_entropy  # a function: stage processes import it by name (an nn.Module instance is refused)


def devices(stages, kind="cuda"):
    """K stages spread over this host's GPUs (or all on the CPU)."""
    if kind == "cpu":
        return ["cpu"] * stages
    count = torch.cuda.device_count()
    return [f"cuda:{k % count}" for k in range(stages)]


@KINDS
def test_cuda_gradients_match_cpu_and_each_partition(kind):
    torch.manual_seed(1)
    x, y = torch.randn(32, 16), torch.randint(0, 3, (32,))
    reference = mlp(dropout=0.2)
    GPipe(reference, 1, chunks=4, seed=3, devices=devices(1, kind)).step(x, y, LOSS)
    for stages in (2, 3):
        model = mlp(dropout=0.2)
        pipe = GPipe(model, stages, chunks=4, seed=3, devices=devices(stages, kind), checkpoint="always")
        pipe.step(x, y, LOSS)
        got, expected = [g.cpu() for g in grads(model)], [g.cpu() for g in grads(reference)]
        assert relative_difference(got, expected) <= GPU_TOLERANCE, stages


@KINDS
def test_cuda_trace_has_gpu_times_and_memory_peaks(kind):
    torch.manual_seed(1)
    x, y = torch.randn(32, 16), torch.randint(0, 3, (32,))
    pipe = GPipe(mlp(), 2, chunks=4, devices=devices(2, kind))
    seen = []
    pipe.step(x, y, LOSS, on_event=seen.append)
    assert len(seen) == len(pipe.trace.events) == 2 * (4 + 4 + 3)
    assert all(e.device.startswith(kind) and 0 <= e.start <= e.end for e in pipe.trace.events)
    if kind == "cuda":  # the device's own allocator peak: GPUs only
        assert all(m.device_peak_bytes and m.device_peak_bytes > 0 for m in pipe.trace.memory)
    out = pipe(x.to(kind))
    assert out.device == torch.device(devices(2, kind)[-1])


@KINDS
def test_a_model_on_a_gpu_keeps_every_stage_there_for_every_k(kind):
    place = torch.device(devices(1, kind)[0])
    for stages in (1, 2, 3):
        model = mlp().to(place)
        assert GPipe(model, stages, chunks=2).devices == [place] * stages


@KINDS
def test_a_gpu_stage_hands_over_to_a_cpu_stage_and_back(kind):
    torch.manual_seed(1)
    x, y = torch.randn(32, 16, dtype=torch.float64), torch.randint(0, 3, (32,))
    reference = mlp(dtype=torch.float64)
    LOSS(reference(x), y).backward()
    model = mlp(dtype=torch.float64)
    GPipe(model, 3, chunks=4, devices=[devices(1, kind)[0], "cpu", devices(1, kind)[0]]).step(x, y, LOSS)
    for a, b in zip(grads(model), grads(reference)):
        assert torch.allclose(a.cpu(), b, atol=1e-12)


@KINDS
def test_serial_runs_time_each_task_alone_and_traces_keep_dependencies(kind):
    torch.manual_seed(1)
    x, y = torch.randn(256, 16), torch.randint(0, 3, (256,))
    slack = trace_slack(kind)   # 1 us on one GPU; on two, the measured skew of their time origins
    assert slack < 5e-3
    pipe = GPipe(mlp(width=16, depth=6), 2, chunks=8, devices=devices(2, kind))
    pipe.step(x, y, LOSS, serial=True)
    events = sorted(pipe.trace.events, key=lambda e: e.start)
    assert all(b.start >= a.end - slack for a, b in zip(events, events[1:]))
    pipe.step(x, y, LOSS)
    assert out_of_order(pipe.trace, slack) == []


@NO_GPU
def test_a_gated_serial_step_holds_each_task_so_a_launch_bound_task_reads_below_one():
    """A near-empty model's tasks are all launching: gated (engine.device.Gate), their kernels run back
    to back, so the GPU's time per task falls below the host's time to issue it."""
    from lab.studies.speedup import stage_ratios
    torch.manual_seed(1)
    x, y = torch.randn(64, 16), torch.randint(0, 3, (64,))
    pipe = GPipe(mlp(width=16, depth=6), 1, chunks=8, devices=["cuda:0"])
    for _ in range(3):   # the spin grows to twice the longest host time seen: later steps are held throughout
        pipe.step(x, y, LOSS, serial="gated")
    gate = pipe._local.devices[0].gate
    missed = gate.missed
    pipe.step(x, y, LOSS, serial="gated")
    assert gate.missed == missed, "every task of a step after the warm-up was held until the host had issued it"
    [ratio] = stage_ratios(pipe.trace.to_records(), 1)
    assert ratio < 1.0, f"a near-empty model's GPU time per task should be under the host's: {ratio:.2f}"


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=[TWO_GPUS, SHARED_GPUS])])
def test_a_pool_started_with_a_local_rank_puts_stage_k_on_gpu_k(monkeypatch, kind):
    """As a pool started from a torchrun worker: its children inherit LOCAL_RANK, and must not all
    take that GPU (2 GPUs tell the stages' GPUs apart)."""
    from lab.processes.pool import ProcessPool
    monkeypatch.setenv("LOCAL_RANK", "1")
    torch.manual_seed(1)
    x, y = torch.randn(32, 16), torch.randint(0, 3, (32,))
    with ProcessPool(2, timeout=120, device=kind) as pool:
        pool.build("small_models:mlp", {}, chunks=4)
        pool.step(x, y, LOSS)
        placed = {e.stage: e.device for e in pool.trace.events}
    assert placed == ({0: "cuda:0", 1: "cuda:1"} if kind == "cuda" else {0: "cpu", 1: "cpu"})


@NO_GPU
def test_host_batches_are_pinned_on_a_gpu_host():
    for batch in (torch.randn(4, 3), torch.randn(3)[None].expand(4, 3), torch.randn(3, 4).t()):
        assert pinned(batch, ["cuda"]).is_pinned() and torch.equal(pinned(batch, ["cuda"]), batch)


@TWO_GPUS
def test_a_copy_into_a_gpu_waits_for_nothing_else_queued_there():
    """A stage's activation reaches the next GPU while that GPU's default stream is still busy (it
    used to wait for it, and so for every earlier copy into that GPU)."""
    sender = StageDevice(torch.device("cuda", 0), 1)
    sender.start(time.perf_counter(), None)
    with sender.enter():   # a first copy: cuda:1's context, peer access and a cached block, none of which may wait
        sender.send(torch.zeros(4, device="cuda:0"), torch.device("cuda", 1))[1].synchronize()
    torch.cuda.synchronize(1)
    with torch.cuda.device(1):
        torch.cuda._sleep(int(3e9))                # seconds of work on cuda:1's default stream
    with sender.enter():
        value = torch.arange(4.0, device="cuda:0")
        moved, ready = sender.send(value, torch.device("cuda", 1))
    ready.synchronize()
    busy = not torch.cuda.default_stream(1).query()   # cuda:1's seconds of work still queued: the copy did not wait
    assert busy and moved.device == torch.device("cuda", 1)
    torch.cuda.synchronize(1)
    assert torch.equal(moved.cpu(), torch.arange(4.0))


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=[TWO_GPUS, SHARED_GPUS])])
def test_stage_processes_on_two_gpus_send_payloads_over_nccl(kind):
    """With an expanded target (stride 0), as a user's may be; on the CPU payloads go through
    shared memory."""
    from lab.processes.pool import ProcessPool
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    with ProcessPool(2, timeout=120, device=kind) as pool:
        pool.build(zoo.build, dict(name="mlp", blocks=4, width=16), chunks=4)
        loss = pool.step(x, y[:, None].float().expand(8, 16), torch.nn.functional.mse_loss)
        assert pool.trace.lane == ("gloo+nccl" if kind == "cuda" else "shared memory") and torch.isfinite(loss)


@NO_GPU
def test_the_gpu_table_is_sized_until_the_gpu_sets_the_pace():
    """The quick GPU table's sizing on this GPU, by arithmetic on probed rates: every stage of K=8
    measured at M=32, and the size it chose either meets the target on every stage or says it is the
    best that fits; its probes' TFLOP/s are a GPU's, not a host's."""
    from lab.studies import gpu_sizing, speedup
    sizing = speedup.gpu_sizing(quick=True)
    assert sizing.tried and len(sizing.ratios) == 8 and all(r > 0 for r in sizing.ratios)
    assert sizing.met == (min(sizing.ratios) >= gpu_sizing.GPU_TARGET), sizing.describe()
    assert all(t > 1.0 for t in sizing.tflops), sizing.describe()


@NO_GPU
def test_a_gpu_memory_probe_after_one_that_ran_out_still_counts_the_whole_step():
    """The capped probe right after an out-of-memory one: the first run on a GPU reported 48 MB for a
    step whose weights, gradients and Adam state alone took 305 MB (the failed probe's memory, still
    held by a reference cycle, counted as the next one's baseline)."""
    from dataclasses import replace

    from lab.config import RunConfig
    from lab.studies import fit
    small = RunConfig(model="transformer", blocks=2, width=128, batch=16, stages=1, micro_batches=4, device="cuda",
                      checkpoint="always")   # one stage: its GPU holds the whole model's state
    assert not fit.footprint_cuda(replace(small, blocks=64), budget=2 ** 20)[2]   # out of memory under 1 MiB
    params, peak, fits = fit.footprint_cuda(small, budget=2 ** 30)
    assert fits and peak >= 16 * params   # float32 weights, gradients and two moments, all on this GPU
