"""What a step records: events per task, derived figures, exports, live events, memory peaks."""
import json

import pytest
import torch
from small_models import mlp
from torch import nn

from engine import GPipe

LOSS = nn.CrossEntropyLoss()


def test_one_event_per_task_in_schedule_order(batch):
    x, y = batch
    pipe = GPipe(mlp(), 3, chunks=4, checkpoint="except_last")
    pipe.step(x, y, LOSS)
    trace = pipe.trace
    assert (trace.stages, trace.micro_batches, trace.batch_size, trace.kind) == (3, 4, 24, "step")
    for stage in range(3):
        mine = sorted((e for e in trace.events if e.stage == stage), key=lambda e: e.start)
        assert " ".join(f"{e.op}{e.micro}" for e in mine) == "F0 F1 F2 F3 B3 R2 B2 R1 B1 R0 B0"
        assert all(0 <= e.start <= e.end for e in mine)
        assert all(a.end <= b.start for a, b in zip(mine, mine[1:]))  # one task at a time per stage
        assert {e.device for e in mine} == {"cpu"}


def test_data_dependencies_hold_in_measured_times(batch):
    x, y = batch
    pipe = GPipe(mlp(), 4, chunks=4)
    pipe.step(x, y, LOSS)
    at = {(e.stage, e.op, e.micro): e for e in pipe.trace.events}
    for (stage, op, micro), event in at.items():
        if op == "F" and stage > 0:
            assert event.start >= at[(stage - 1, "F", micro)].end
        if op == "B" and stage < 3:
            assert event.start >= at[(stage + 1, "B", micro)].end


def test_derived_figures(batch):
    x, y = batch
    pipe = GPipe(mlp(), 2, chunks=3)
    pipe.step(x, y, LOSS)
    trace = pipe.trace
    assert trace.makespan == max(e.end for e in trace.events)
    assert trace.busy == pytest.approx([sum(e.end - e.start for e in trace.events if e.stage == s) for s in (0, 1)])
    assert trace.bubble == pytest.approx(1 - sum(trace.busy) / (2 * trace.makespan))
    assert 0 <= trace.bubble < 1
    assert trace.samples_per_second == pytest.approx(24 / trace.makespan)
    assert trace.wall >= trace.makespan


def test_exports(batch):
    x, y = batch
    pipe = GPipe(mlp(), 2, chunks=2, checkpoint="always")
    pipe.step(x, y, LOSS)
    records = pipe.trace.to_records()
    assert len(records) == 2 * 6 and set(records[0]) == {"stage", "micro", "op", "start", "end", "device", "chunk",
                                                         "host"}
    assert all(r["host"] == pytest.approx(r["end"] - r["start"]) for r in records)  # on a CPU the thread is the device
    frame = pipe.trace.to_dataframe()
    assert list(frame.columns) == ["stage", "micro", "op", "start", "end", "device", "chunk", "host", "duration"]
    assert sorted(frame["op"].value_counts().to_dict().items()) == [("B", 4), ("F", 4), ("R", 4)]
    chrome = json.loads(pipe.trace.to_chrome_trace())
    complete = [e for e in chrome["traceEvents"] if e["ph"] == "X"]
    names = [e for e in chrome["traceEvents"] if e["ph"] == "M"]
    assert len(complete) == 12 and len(names) == 2
    assert all(e["dur"] >= 0 and e["tid"] in (0, 1) for e in complete)


def test_events_stream_to_a_callback_as_tasks_finish(batch):
    x, y = batch
    seen = []
    pipe = GPipe(mlp(), 3, chunks=4)
    pipe.step(x, y, LOSS, on_event=seen.append)
    assert sorted(seen, key=lambda e: (e.start, e.stage)) == pipe.trace.events
    ends = [e.end for e in seen]
    per_stage = {s: [e.end for e in seen if e.stage == s] for s in range(3)}
    assert all(v == sorted(v) for v in per_stage.values()) and len(ends) == len(pipe.trace.events)


def test_forward_only_call(batch):
    x, _ = batch
    model = mlp()
    pipe = GPipe(model, 3, chunks=4)
    out = pipe(x)
    assert torch.allclose(out, model(x), rtol=1e-5, atol=1e-6)
    assert not out.requires_grad
    assert pipe.trace.kind == "forward" and {e.op for e in pipe.trace.events} == {"F"}
    assert len(pipe.trace.events) == 12


def test_memory_per_stage(batch):
    x, y = batch
    model = mlp(width=32)
    x = torch.randn(24, 32)
    pipe = GPipe(model, 2, chunks=4, checkpoint="never")
    pipe.step(x, y, LOSS)
    memory = pipe.trace.memory
    assert [m.stage for m in memory] == [0, 1]
    for m, partition in zip(memory, pipe.partitions):
        params = sum(p.numel() * 4 for p in partition.parameters())
        assert m.param_bytes == params and m.grad_bytes == params
        assert m.activation_peak_bytes > 0 and m.device_peak_bytes is None


def test_a_trace_read_late_tells_of_its_call_as_it_ended(batch):
    """The trace is built when first read; what changes after the call (gradients zeroed, the
    ledger's next call) does not reach it, and a trace nobody read is never built."""
    x, y = batch
    model = mlp(width=32)
    x = torch.randn(24, 32)
    pipe = GPipe(model, 2, chunks=4, checkpoint="never")
    pipe.step(x, y, LOSS)
    assert callable(pipe._trace)  # not built yet
    model.zero_grad(set_to_none=True)
    pipe.forward(x)  # another call, forward only, in between: its own trace replaces the step's unread one
    pipe.step(x, y, LOSS)
    model.zero_grad(set_to_none=True)
    trace = pipe.trace
    assert trace is pipe.trace and trace.kind == "step" and len(trace.events) == 2 * 2 * 4
    for m, partition in zip(trace.memory, pipe.partitions):
        assert m.grad_bytes == sum(p.numel() * 4 for p in partition.parameters())  # as the step left them
        assert m.activation_peak_bytes > 0


def test_recompute_holds_far_fewer_activations():
    model = nn.Sequential(*[layer for _ in range(8) for layer in (nn.Linear(64, 64), nn.Tanh())])
    x, y = torch.randn(256, 64), torch.randn(256, 64)
    peaks = {}
    for checkpoint in ("never", "always"):
        pipe = GPipe(model, 2, chunks=8, checkpoint=checkpoint)
        pipe.step(x, y, nn.MSELoss())
        peaks[checkpoint] = [m.activation_peak_bytes for m in pipe.trace.memory]
    micro = 256 // 8 * 64 * 4  # bytes of one micro-batch activation
    # Each stage is 4 x (Linear, Tanh). Per micro-batch autograd keeps the stage input (saved by the
    # first Linear) and the 4 Tanh outputs (saved by Tanh and by the next Linear: one storage).
    # Without recompute all 8 micro-batches are held at once: 8 * 5.
    assert peaks["never"] == [8 * 5 * micro] * 2
    # With recompute: the 8 kept stage inputs, plus the 4 Tanh outputs of the one micro-batch being
    # recomputed (its input is already among the 8).
    assert peaks["always"] == [(8 + 4) * micro] * 2


def test_nothing_stays_held_after_a_step(batch):
    x, y = batch
    pipe = GPipe(mlp(), 3, chunks=4, checkpoint="except_last")
    pipe.step(x, y, LOSS)
    assert all(stage.ledger.live == 0 for stage in pipe._local.chunks.values())


def test_a_watched_holding_goes_with_its_release_even_when_it_counted_nothing():
    """A split backward's holdings are watched until released; one whose block saved nothing but
    parameters (nothing counted) must not stay watched, swept again before every later count."""
    from engine.memory import ActivationLedger
    weight = nn.Parameter(torch.randn(4, 4))
    ledger = ActivationLedger([weight])
    with ledger.saving(watch=True) as holding:
        out = torch.randn(2, 4) @ weight  # saves its input (counted) and the weight (not), held by out's graph
    with ledger.saving(watch=True) as nothing:
        weight.sum()  # saves nothing
    assert holding.storages and not nothing.storages and ledger._watched == [holding]
    del out
    ledger.release(holding)
    ledger.release(nothing)
    assert ledger.live == 0 and ledger._watched == []


def test_serial_step_times_each_task_alone_and_gives_the_same_gradients(batch):
    x, y = batch
    results = []
    for serial in (False, True):
        model = mlp(dropout=0.3)
        pipe = GPipe(model, 3, chunks=4, seed=1, threads_per_stage=1)
        pipe.step(x, y, LOSS, serial=serial)
        results.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert pipe.trace.kind == "serial step"
    events = sorted(pipe.trace.events, key=lambda e: e.start)
    assert all(a.end <= b.start for a, b in zip(events, events[1:]))  # never two tasks at once
    assert len(events) == 3 * (4 + 4 + 3)


def test_serial_step_names_the_failing_stage(batch):
    x, y = batch
    model = mlp()
    model[7] = nn.Linear(5, 16)
    with pytest.raises(RuntimeError, match=r"\[stage 2, micro-batch 0, forward"):
        GPipe(model, 3, chunks=4).step(x, y, LOSS, serial=True)
