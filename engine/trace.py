"""What one pipelined step recorded: a timed event per task, memory per stage, derived figures."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass(frozen=True)
class Event:
    """One task as it ran on a stage: `op` is "F", "R", "B" or "W"; `start`/`end` are seconds from
    the step's start (on a GPU, of the GPU's timeline); `chunk` is the chunk of layers it ran (the
    stage itself, unless stages hold several chunks); `host` is the seconds the stage's thread spent
    issuing it (on a CPU the task's own time; on a GPU far less than `duration` when the GPU, not
    Python, sets the pace; 0 where not recorded)."""

    stage: int
    micro: int
    op: str
    start: float
    end: float
    device: str
    chunk: int = 0
    host: float = 0.0

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Message:
    """An activation ("act") or gradient ("grad") crossing between stage processes, as the stage
    thread of one side spent time on it: encoding it and handing it to the backend (`direction`
    "send"), or reading it once it had arrived ("receive"). Seconds from the step's start. The gap
    from a send's start to the matching receive's start is the time the message was on its way
    (or waiting, if its receiver was busy computing)."""

    stage: int
    peer: int
    direction: str
    kind: str
    micro: int
    bytes: int
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Reduction:
    """A stage's all-reduce of its gradients with the same stage of the other replicas (data
    parallelism): from the moment its last task ended until the sums were there, in seconds from the
    step's start, and the bytes each replica put in."""

    stage: int
    start: float
    end: float
    bytes: int

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class StageMemory:
    """Memory of one stage: bytes of its parameters and gradients, and the activation peak.

    `activation_peak_bytes` is measured from the tensors autograd actually saved for backward (plus
    inputs kept for recompute), not estimated from shapes. `device_peak_bytes` is
    torch.cuda.max_memory_allocated of the stage's GPU (shared by stages on one GPU); None on CPU.
    """

    stage: int
    device: str
    param_bytes: int
    grad_bytes: int
    activation_peak_bytes: int
    device_peak_bytes: Optional[int] = None


@dataclass
class Trace:
    """The record of the last `step()` or forward call of a GPipe. With stages as processes
    (`group=`), `messages` holds what crossed between them, `transport` says "processes" and `lane`
    how: "shared memory" (one host), "gloo", or "gloo+nccl" (payloads between GPUs on NCCL). With
    `data_parallel=`, `reductions` holds each stage's gradient all-reduce with its replicas, and
    `replicas` says how many there are (the trace itself is this pipeline's)."""

    stages: int = 0
    micro_batches: int = 0
    batch_size: int = 0
    checkpoint: object = ""  # the pipe's checkpoint mode, or a tuple of one per stage
    kind: str = "step"  # "step" (forward+backward), "serial step" (one task at a time) or "forward"
    events: list[Event] = field(default_factory=list)
    memory: list[StageMemory] = field(default_factory=list)
    wall: float = 0.0  # seconds the whole call took, as the caller saw it
    messages: list[Message] = field(default_factory=list)
    transport: str = "threads"
    lane: str = ""
    reductions: list[Reduction] = field(default_factory=list)  # with data_parallel=: each stage's all-reduce
    replicas: int = 1                                           # pipelines training together (D)

    @property
    def makespan(self) -> float:
        """Seconds from the step's start to the end of its last task."""
        return max((e.end for e in self.events), default=0.0)

    @property
    def busy(self) -> list[float]:
        """Seconds each stage spent running tasks."""
        totals = [0.0] * self.stages
        for e in self.events:
            totals[e.stage] += e.duration
        return totals

    @property
    def bubble(self) -> float:
        """Measured idle fraction of the K stages over the makespan: 1 - sum(busy) / (K * makespan)."""
        if not self.events or self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (self.stages * self.makespan)

    @property
    def samples_per_second(self) -> float:
        """Mini-batch samples processed per second of makespan."""
        return self.batch_size / self.makespan if self.makespan > 0 else 0.0

    @property
    def boundary_bytes(self) -> list[dict]:
        """Per pair of stages that exchanged messages (stage k and k+1, and stage K-1 and 0 when
        stages hold several chunks): bytes of activations sent forward and of gradients sent back
        in this call. Only messages between processes are counted: threads share memory."""
        totals: dict[tuple[int, int], dict] = {}
        for m in self.messages:
            if m.direction == "send":
                pair = (m.stage, m.peer) if m.kind == "act" else (m.peer, m.stage)
                entry = totals.setdefault(pair, {"stages": pair, "activations": 0, "gradients": 0})
                entry["activations" if m.kind == "act" else "gradients"] += m.bytes
        return [totals[pair] for pair in sorted(totals)]

    def to_records(self) -> list[dict]:
        """The events as a list of plain dicts (stage, micro, op, start, end, device, chunk, host)."""
        return [asdict(e) for e in self.events]

    def to_dataframe(self):
        """The events as a pandas DataFrame, one row per task, with a `duration` column."""
        import pandas as pd

        frame = pd.DataFrame(self.to_records(),
                             columns=["stage", "micro", "op", "start", "end", "device", "chunk", "host"])
        frame["duration"] = frame["end"] - frame["start"]
        return frame

    def to_chrome_trace(self) -> str:
        """Chrome-trace JSON (open it at ui.perfetto.dev or chrome://tracing): one row per stage."""
        names = {"F": "forward", "R": "recompute", "B": "backward", "W": "weight gradient"}
        rows = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": s, "args": {"name": f"stage {s}"}}
                for s in range(self.stages)]
        rows += [{"name": f"{e.op}{e.micro}", "cat": names.get(e.op, e.op), "ph": "X", "pid": 0, "tid": e.stage,
                  "ts": e.start * 1e6, "dur": e.duration * 1e6,
                  "args": {"micro_batch": e.micro, "device": e.device}}
                 for e in self.events]
        return json.dumps({"traceEvents": rows, "displayTimeUnit": "ms"})
