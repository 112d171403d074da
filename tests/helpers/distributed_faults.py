"""Run under torchrun by tests/engine/distributed/test_processes.py, one process per stage: each scenario makes a pipe
over the whole group, provokes one fault, and every rank prints one JSON line saying what it raised
and when (wall-clock seconds, comparable across the ranks of one machine), in a file of its own
in the folder named by GPIPE_FAULTS_OUT.

    torchrun --standalone --nproc-per-node 3 tests/helpers/distributed_faults.py errors [RUNS [BACKWARD_RUNS]]
    torchrun --nnodes 2 ... tests/helpers/distributed_faults.py kill      # one process per "node"
    torchrun --nnodes 2 ... tests/helpers/distributed_faults.py setup     # rank 1 stops making the gloo lane
    GPIPE_LANE=gloo torchrun --standalone --nproc-per-node 3 ... stall    # a payload that never lands
"""
import json
import os
import pickle
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from small_models import mlp  # noqa: E402

from engine import GPipe  # noqa: E402
from engine.distributed.runner import decode_end  # noqa: E402

LOSS = nn.CrossEntropyLoss()


class Explodes(nn.Module):
    """Fails on its `at`-th training forward call (micro-batch at-1 of the first step): by raising,
    or by killing its own process as a crash would."""

    def __init__(self, at: int, how: str):
        super().__init__()
        self.at, self.how, self.calls = at, how, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at:
            report(failed_at=time.time())
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ZeroDivisionError("boom in forward")
        return x


class ExplodesInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        report(failed_at=time.time())
        raise KeyError("boom in backward")


class BackwardBomb(nn.Module):
    def forward(self, x):
        return ExplodesInBackward.apply(x)


def report(**fields) -> None:
    """One JSON line in this rank's own file (the ranks' stdout lines could interleave)."""
    with open(os.path.join(os.environ["GPIPE_FAULTS_OUT"], f"rank{os.environ['RANK']}.jsonl"), "a") as out:
        out.write(json.dumps({"scenario": SCENARIO, "run": RUN, "rank": RANK, **fields}) + "\n")


def attempt(call) -> None:
    """Run `call`, and report what it raised (or that it returned) and when."""
    try:
        call()
        report(raised=None, at=time.time())
    except Exception as error:  # reported, not hidden: the test reads it
        report(raised=type(error).__name__, message=str(error), at=time.time())


class Unpickled:
    """What a pickled "end" message holds: unpickling it would write the file GPIPE_FAULTS_OUT/unpickled."""

    def __reduce__(self):
        return open, (os.path.join(os.environ["GPIPE_FAULTS_OUT"], "unpickled"), "w")


def blob(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


FORGED_ENDS = {  # the honest "end" (bytes: the loss, the batch size, the trace) -> what a forger sends
    "garbled end": lambda honest: blob(b"\x07" * 40),
    "pickled end": lambda honest: blob(pickle.dumps([Unpickled()])),
    "end of another form": lambda honest: torch.zeros(3),
}


def garble_pieces(honest: torch.Tensor) -> torch.Tensor:
    """The honest "end" with its loss and batch size, and garbage for the trace pieces."""
    data = honest.numpy().tobytes()
    return blob(data[:decode_end(data)[2]] + b"\x07" * 40)


def forge_end(pipe, forged) -> None:
    """Make this rank's next "end" message the forged one (for one call)."""
    transport = pipe.runner.transport
    honest = transport.send_control

    def send_control(destination, kind, value=None, micro=0):
        if kind == "end":
            transport.send_control = honest
            value = forged(value)
        honest(destination, kind, value, micro)
    transport.send_control = send_control


class NeverLands:
    """An NCCL receive whose transfer never completes (the sender's side never came)."""

    def is_completed(self):
        return False

    def exception(self):
        return None


def stall_payload(pipe, micro: int) -> None:
    """Make this rank's receive of activation `micro` a transfer that never lands."""
    transport = pipe.runner.transport
    honest = transport._file

    def file(arrival):
        if arrival.header.kind == "act" and arrival.header.micro == micro:
            arrival = arrival._replace(ready=[NeverLands()])
        honest(arrival)
    transport._file = file


def stop_making_the_lane() -> None:
    """Stop this process (SIGSTOP: alive, its agent and the Store up, as a rank hung or killed where
    the Store outlives it) as it starts making the gloo lane's groups, after the ranks' meeting."""
    from engine.distributed import gloo_lane

    def own_group(*args, **kwargs):
        report(failed_at=time.time(), pid=os.getpid())  # the test kills it
        os.kill(os.getpid(), signal.SIGSTOP)
    gloo_lane.own_group = own_group


def batch():
    torch.manual_seed(1)
    return torch.randn(24, 16), torch.randint(0, 3, (24,))


def main(group: str, runs: int, backward_runs: int) -> None:
    global SCENARIO, RANK, RUN
    dist.init_process_group("gloo")
    RANK, size = dist.get_rank(), dist.get_world_size()
    x, y = batch()
    last = size - 1
    inputs, targets = (x if RANK == 0 else None), (y if RANK == last else None)
    if group == "stall":  # rank 1's F1 waits for a payload that never lands
        SCENARIO = "stall"
        pipe = GPipe(mlp(), size, chunks=4, threads_per_stage=1, group=dist.group.WORLD)
        if RANK == 1:
            stall_payload(pipe, micro=1)
        report(failed_at=time.time())
        attempt(lambda: pipe.step(inputs, targets, LOSS))
        os._exit(0)  # the lane gave up its transfers: leave without the collective clean-up
    if group == "setup":
        SCENARIO = "setup"
        if RANK == 1:
            stop_making_the_lane()
        attempt(lambda: GPipe(mlp(), size, chunks=4, threads_per_stage=1, group=dist.group.WORLD))
        os._exit(0)  # a thread still waits in the group's making: leave without it
    if group == "kill":
        SCENARIO = "kill"
        model = mlp()
        model.insert(7, Explodes(at=3, how="kill"))  # 10 layers over 2 stages: in stage 1
        pipe = GPipe(model, size, chunks=4, threads_per_stage=1, group=dist.group.WORLD)
        attempt(lambda: pipe.step(inputs, targets, LOSS))
        report(lane=pipe.runner.transport.lane.name)
        pipe.close()  # the survivor's lane removes what the killed rank left in /dev/shm
        os._exit(0)  # the group is broken: leave without the collective clean-up

    for RUN in range(max(runs, backward_runs)):  # each in a new pipe: a clean-up racing a survivor shows
        if RUN < backward_runs:
            SCENARIO = "backward"
            model = mlp()
            model.insert(1, BackwardBomb())  # in the first stage
            pipe = GPipe(model, size, chunks=4, threads_per_stage=1, group=dist.group.WORLD)
            attempt(lambda: pipe.step(inputs, targets, LOSS))
            pipe.close()
        if RUN >= runs:
            continue
        SCENARIO = "forward"
        model = mlp()
        model.insert(len(model) - 2, Explodes(at=3, how="raise"))  # in the last stage
        pipe = GPipe(model, size, chunks=4, threads_per_stage=1, group=dist.group.WORLD)
        attempt(lambda: pipe.step(inputs, targets, LOSS))
        if RUN == 0:
            SCENARIO = "recovers"  # the same pipe, the next step: works, and every rank gets the same loss
            losses = []
            attempt(lambda: losses.append(pipe.step(inputs, targets, LOSS).item()))
            report(loss=losses[0] if losses else None)
        pipe.close()

        pipe = GPipe(mlp(), size, chunks=4, threads_per_stage=1, group=dist.group.WORLD)
        SCENARIO = "missing inputs"
        report(failed_at=time.time())
        attempt(lambda: pipe.step(None, targets, LOSS))
        SCENARIO = "missing targets"
        report(failed_at=time.time())
        attempt(lambda: pipe.step(x, None, LOSS))
        pipe.close()
    RUN = 0

    pipe = GPipe(mlp(), size, chunks=4, threads_per_stage=1, group=dist.group.WORLD)
    SCENARIO = "forward only"  # output on the last rank, None elsewhere; inputs elsewhere are ignored
    out = pipe(x)
    report(output=None if out is None else list(out.shape))
    # the last rank sends the one before it a forged "end" (SCENARIO: the global that report() reads)
    for SCENARIO, forged in FORGED_ENDS.items():  # noqa: B007
        if RANK == last:
            forge_end(pipe, forged)
        report(failed_at=time.time())
        attempt(lambda: pipe.step(inputs, targets, LOSS))
    SCENARIO = "garbled trace"  # a true loss and batch size, garbage for the trace: the step stands, the trace does not
    if RANK == last:
        forge_end(pipe, garble_pieces)
    report(loss=pipe.step(inputs, targets, LOSS).item())
    attempt(lambda: pipe.trace)
    pipe.close()

    SCENARIO = "group size"
    report(failed_at=time.time())
    attempt(lambda: GPipe(mlp(), size + 1, group=dist.group.WORLD))
    dist.destroy_process_group()


if __name__ == "__main__":
    SCENARIO, RANK, RUN = "start", int(os.environ["RANK"]), 0
    main(sys.argv[1], *(int(n) for n in (sys.argv[2:] + ["1", "1"])[:2]))
