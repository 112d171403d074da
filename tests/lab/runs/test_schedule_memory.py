"""A schedule's predicted activation peak per stage (lab.runs.schedule_memory) against what the engine's
ledger measures, on the zoo's MLP: every built-in schedule under every checkpoint mode, and one
whose recomputes all run before any backward. The ledger is deterministic, so the comparison is too."""
import pytest
import torch

from engine import GPipe
from engine.schedule import SCHEDULES, Schedule, Task, gpipe
from lab.runs import schedule_memory
from lab.zoo import mlp

M = 8


def measured_and_predicted(schedule, checkpoint, virtual=1):
    torch.manual_seed(0)
    x, y = torch.randn(32, 32), torch.randn(32, 32)
    pipe = GPipe(mlp.build(8, 32), 2, chunks=M, checkpoint=checkpoint, schedule=schedule, virtual_stages=virtual,
                 threads_per_stage=1)
    pipe.step(x, y, torch.nn.functional.mse_loss)
    chunks = schedule_memory.measure_chunks(pipe.partitions, x[: 32 // M])
    predicted = schedule_memory.peaks(pipe.task_lists(M), chunks, x.untyped_storage().nbytes())
    pipe.close()
    return [m.activation_peak_bytes for m in pipe.trace.memory], predicted


def recomputes_first(tasks: list) -> Schedule:
    """Each stage's forwards, then all its recomputes, then its backwards, each in their order."""
    return Schedule([[t for op in "FRB" for t in line if t.op == op] for line in tasks])


@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_built_in_schedules_peak_is_predicted_per_stage(name, checkpoint):
    measured, predicted = measured_and_predicted(name, checkpoint, virtual=SCHEDULES[name].fewest_chunks)
    assert all(abs(p - m) <= 0.1 * m for p, m in zip(predicted, measured)), (measured, predicted)


def test_recomputes_moved_before_every_backward_are_predicted_too():
    """GPipe's order with every R moved up, right after the last F: the stage then holds every
    micro-batch's recomputed tensors at once, as without checkpointing (where the lab's GPipe formula,
    which puts each R just before its B, says far less)."""
    measured, predicted = measured_and_predicted(recomputes_first(gpipe(2, M, "always")), "always")
    assert all(abs(p - m) <= 0.1 * m for p, m in zip(predicted, measured)), (measured, predicted)
    assert measured[0] > 3 * measured_and_predicted("gpipe", "always")[0][0], "moving R up costs memory"


def test_recompute_per_stage_and_per_micro_batch_is_predicted_and_saves_where_it_runs():
    """GPipe with stage 0 alone recomputing, and written with only stage 0's even micro-batches
    recomputed ("as_written"): predicted within 10 %; stage 0 holds less than without recompute
    (the even half: between the two), stage 1 as much."""
    never, always = (measured_and_predicted("gpipe", mode)[0] for mode in ("never", "always"))
    per_stage = measured_and_predicted("gpipe", ("always", "never"))
    plan = gpipe(2, M, "never")
    plan[0] = [t for task in plan[0] for t in [Task("R", task.micro, 0)] * (task.op == "B" and task.micro % 2 == 0)
               + [task]]
    per_micro = measured_and_predicted(Schedule(plan), "as_written")
    for measured, predicted in (per_stage, per_micro):
        assert all(abs(p - m) <= 0.1 * m for p, m in zip(predicted, measured)), (measured, predicted)
        assert measured[0] < never[0] and measured[1] == never[1], (measured, never)
    assert always[0] == per_stage[0][0] < per_micro[0][0] < never[0]


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_a_runs_predicted_peaks_follow_its_schedule(model):
    """What the app's memory chart draws beside the measured peaks: for a later schedule, its own
    task lists replayed (GPipe's formula held for 1F1B's stage 1 four times too much before)."""
    from lab.config import RunConfig
    from lab.runs import experiments
    from lab.views import charts
    config = RunConfig(model=model, blocks=8 if model == "mlp" else 4, width=32, batch=32, stages=2, micro_batches=8,
                       checkpoint="except_last", schedule="1f1b")
    record = experiments.run(config, rounds=1, warmup=0)
    for stage in record.memory:
        assert stage["predicted_activation_bytes"] == pytest.approx(stage["activation_peak_bytes"], rel=0.1), stage
    rows = [dict(measured_never=1, measured_recompute=1, predicted_never=1, predicted_recompute=1)] * 2
    assert [t.name for t in charts.memory_chart(rows, schedule="1f1b").data][2:] == [
        "1f1b's tasks replayed, no recompute", "1f1b's tasks replayed, recompute"]


def test_a_memory_cap_per_stage_is_checked_and_the_first_task_past_it_named():
    """Under a cap GPipe meets (its measured stage-0 peak), GPipe passes and the same tasks with every
    R moved up are refused at the recompute that passes it."""
    torch.manual_seed(0)
    x = torch.randn(32, 32)
    pipe = GPipe(mlp.build(8, 32), 2, chunks=M, checkpoint="always", threads_per_stage=1)
    chunks = schedule_memory.measure_chunks(pipe.partitions, x[: 32 // M])
    pipe.close()
    cap, whole = measured_and_predicted("gpipe", "always")[0][0], x.untyped_storage().nbytes()
    plain = gpipe(2, M, "always")
    schedule_memory.check_cap(Schedule(plain), chunks, whole, cap)
    early = recomputes_first(plain)
    with pytest.raises(ValueError, match=rf"stage 0 holds \d+ bytes \([\d.]+ KiB\) of activations after R\d, "
                                         rf"over its cap of {cap} bytes"):
        schedule_memory.check_cap(early, chunks, whole, cap)
    with pytest.raises(ValueError, match="3 caps for 2 stages"):
        schedule_memory.check_cap(early, chunks, whole, [cap] * 3)
