"""What every check of the doctor trains, and how it compares: the check model, its gradients
pipelined and not, their differences, and whether a trace's tasks started after their inputs."""
from __future__ import annotations

import time

import torch
from torch import nn

from engine.schedule import Task, upstream
from lab.runs.exactness import unpipelined_gradients
from lab.runs.stepper import Stepper
from lab.zoo import mlp

BATCH, MICRO = 16, 4
CPU_SLACK = 1e-6       # seconds a task may seem to start before its input was ready: perf_counter's rounding
GPU_TOLERANCE = 1e-5   # float32 on GPUs, relative to the largest value: cuBLAS promises no bitwise equality
#                        across streams (nor across processes, whose kernels may be chosen differently)

CHECK_MODEL = mlp.build   # stage processes build it too
LOSS = nn.functional.mse_loss


def check_model(width: int = 32) -> dict:
    """The recipe of the model every check trains: six Linear/Tanh blocks (smooth gradients)."""
    return dict(blocks=6, width=width, activation="tanh")


def batch(width: int = 32, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The check model's mini-batch (lab.zoo.mlp.batch), the same on every call."""
    return tuple(t.to(dtype) for t in mlp.batch(BATCH, width, seed=1))


def gradients(devices, stages: int, dtype=torch.float32, **options) -> tuple[list[torch.Tensor], object]:
    """The gradients (on the CPU) and trace of one step of the check model as K stages on `devices`."""
    model = mlp.build(**check_model()).to(dtype)
    with Stepper(CHECK_MODEL, check_model(), stages, model=model, devices=devices, chunks=MICRO,
                 threads_per_stage=1, **options) as stepper:
        _, trace, _ = stepper.step(*batch(dtype=dtype), LOSS)
        return stepper.gradients(), trace


def unpipelined(dtype=torch.float64) -> list[torch.Tensor]:
    """The same step on the whole mini-batch, no pipeline: the reference every schedule must give."""
    return unpipelined_gradients(mlp.build(**check_model()), *batch(), LOSS, dtype)


def largest_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest elementwise difference between two lists of tensors."""
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


def relative_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """largest_difference over the largest magnitude in `b` (the reference)."""
    return largest_difference(a, b) / (max(y.double().abs().max().item() for y in b) or 1.0)


def origin_skew(rounds: int = 20) -> float:
    """How far apart two GPUs' time origins of one call can be, measured: the engine records one
    origin event per GPU, one after another, once all are idle (LocalStages.start). None lands
    before the recording starts and all have landed once each event completes, so that host time
    bounds the gap; the largest over `rounds` tries. 0 with one GPU: its stages share one origin."""
    count = torch.cuda.device_count()
    worst = 0.0
    for _ in range(rounds if count > 1 else 0):
        for gpu in range(count):
            torch.cuda.synchronize(gpu)
        start = time.perf_counter()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(count)]
        for gpu, event in enumerate(events):
            event.record(torch.cuda.current_stream(gpu))
        for event in events:
            event.synchronize()
        worst = max(worst, time.perf_counter() - start)
    return worst


def trace_slack(device: str) -> float:
    """Seconds by which a task may seem to start before its input was ready in a trace on `device`:
    the clock's rounding on a CPU, the GPUs' measured origin skew on GPUs."""
    return max(CPU_SLACK, origin_skew()) if device == "cuda" else CPU_SLACK


def out_of_order(trace, slack: float = CPU_SLACK) -> list[str]:
    """Tasks that started before the task that produced their input had ended, by more than `slack`
    seconds (trace_slack: on several GPUs their time origins are apart by up to the origin skew)."""
    ends = {(e.chunk, e.micro, e.op): e.end for e in trace.events}
    chunks = 1 + max(e.chunk for e in trace.events)
    late = []
    for e in trace.events:
        before = upstream(Task(e.op, e.micro, e.chunk), chunks)
        if before is not None and e.start < ends[(before.chunk, before.micro, before.op)] - slack:
            late.append(f"{e.op}{e.micro} of chunk {e.chunk}")
    return late

