"""Run one pipeline configuration through the engine and keep what it measured as a plain record.

A record holds only plain data (dicts, lists, numbers), so the app can cache it, a notebook can
tabulate it and the reproduction CLI can write it to CSV.
"""
from __future__ import annotations

import copy
import itertools
import os
import statistics
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Iterator, Optional, Union

import pandas as pd
import torch
from torch import nn

from engine import GPipe, balance_by_size, balance_by_time
from engine.balance import layer_sizes, layer_times
from engine.device import cpu_cores, spread
from engine.microbatch import tensors_of
from engine.partition import even_balance
from engine.schedule import SCHEDULES, Schedule
from engine.trace import Event, Message, Trace
from lab import theory, zoo
from lab.config import RunConfig, baseline_of, check, micro_batch_count
from lab.machine import host
from lab.machine.host import keep_freed_cpu_memory
from lab.processes.sources import OWN, Pools
from lab.runs.stepper import Stepper

RECIPE = zoo.build   # a zoo model by name: what stage processes build
AUTOCAST = {"float32": None, "bf16": torch.bfloat16}  # a configuration's precision: GPipe's autocast=


@dataclass
class RunRecord:
    """What one run measured, as plain data."""

    config: dict
    balance: list[int]               # layers per chunk (per stage, unless stages hold several chunks)
    kind: str                        # "measured" (threads) or "measured alone" (serial step)
    events: list[dict]               # stage, micro, op, start, end, device
    memory: list[dict]               # per stage: bytes of params, grads, activation peak, prediction
    makespan: float
    bubble: float
    samples_per_second: float
    loss: float
    wall: float
    host: dict
    solo_events: Optional[list[dict]] = None   # the same step run one task at a time, for replays
    notes: list[str] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # stage, peer, direction, kind, micro, bytes, start, end
    boundary_bytes: list[dict] = field(default_factory=list)  # per cut: activations and gradients per step
    boundary_how: str = ""  # "sent between processes" or "sizes of the tensors at each cut"
    rounds: list[dict] = field(default_factory=list)  # per measured step: step, baseline (K=1), bubble, share
    baseline_events: list[dict] = field(default_factory=list)  # with baseline=True: the median K=1 step's tasks

    @property
    def transport(self) -> str:
        return self.config.get("transport", "threads")

    @property
    def communication_share(self) -> float:
        """Share of the stages' time spent on messages: their threads' sending and reading time
        over K x makespan (0 with threads, which hand tensors over in memory)."""
        return communication_share(self.messages, self.stages, self.makespan)

    @property
    def speedups(self) -> list[float]:
        """Per round, the K=1 step over this step (rounds measured with a baseline)."""
        return [r["baseline"] / r["step"] for r in self.rounds if r.get("baseline")]

    def spread(self, what: str) -> tuple[float, float, float]:
        """(median, lowest, highest) over the measured rounds of "step", "bubble",
        "communication_share", "samples_per_second" or "speedup"."""
        if what == "speedup":
            values = self.speedups
        elif what == "samples_per_second":
            values = [self.config["batch"] / r["step"] for r in self.rounds]
        else:
            values = [r[what] for r in self.rounds]
        return statistics.median(values), min(values), max(values)

    @property
    def stages(self) -> int:
        return self.config["stages"]

    @property
    def micro_batches(self) -> int:
        return max(e["micro"] for e in self.events) + 1

    def chrome_trace(self) -> str:
        """The measured step as Chrome-trace JSON (opens in ui.perfetto.dev)."""
        return Trace(stages=self.stages, events=[Event(**e) for e in self.events],
                     messages=[Message(**m) for m in self.messages]).to_chrome_trace()

    def events_csv(self) -> str:
        """The measured step's tasks as CSV, one row per task."""
        return pd.DataFrame(self.events).to_csv(index=False)


def communication_share(messages: list, stages: int, makespan: float) -> float:
    """The stage threads' time on messages (sending and reading) over K x makespan."""
    spent = sum((m["end"] - m["start"]) if isinstance(m, dict) else m.duration for m in messages)
    return spent / (stages * makespan) if makespan > 0 else 0.0


def parallel_devices(config: RunConfig) -> int:
    """How many stages this host can really run at once: its GPUs, or its cores at one per stage.
    GPIPE_LAB_DEVICES=n pretends it is n (to check lessons and pages for other hosts on this one)."""
    pretend = os.environ.get("GPIPE_LAB_DEVICES")
    if pretend:
        if not pretend.isdigit() or int(pretend) < 1:
            raise ValueError(f"GPIPE_LAB_DEVICES={pretend!r}: expected a whole number of devices, at least 1")
        return int(pretend)
    if config.device == "cuda":
        return torch.cuda.device_count()
    return max(1, cpu_cores() // config.threads_per_stage)


def devices_for(config: RunConfig) -> list[str]:
    """One device per stage, named explicitly: all "cpu", or round-robin over the GPUs."""
    return [str(device) for device in spread(config.device, config.stages)]


def build(config: RunConfig, on: str = "cpu") -> tuple[nn.Sequential, tuple, Callable]:
    """The model (made on device `on`: a wide one takes seconds to initialise on the host), one
    mini-batch (inputs, targets, on the host) and the loss function of a configuration."""
    entry, lengths = zoo.get(config.model), zoo.lengths(config.context)
    with torch.device(on) if on != "cpu" else nullcontext():  # a mode: every torch call through Python
        model = entry.build(config.blocks, config.width, config.seed, **lengths)
    return model, entry.batch(config.batch, config.width, config.seed, **lengths), entry.loss_fn


def micro_sample(inputs, config: RunConfig):
    """A copy of the first micro-batch of `inputs`, the sample a balance is profiled on."""
    return tensors_of(inputs)[0].chunk(config.micro_batches)[0].clone()


def choose_balance(config: RunConfig, model: nn.Sequential, inputs) -> list[int]:
    """Layers per chunk (per stage, unless stages hold several chunks): equal counts, or balanced by
    measured time or memory."""
    chunks = config.stages * config.virtual_stages
    if config.balance == "uniform":
        return even_balance(config.layers, chunks)
    if config.balance == "blocks":
        return block_balance(model, chunks)
    sample = micro_sample(inputs, config)
    if config.balance == "time":
        return balance_by_time(chunks, model, profiled_on(config, sample))
    return balance_by_size(chunks, model, sample)


def block_balance(model: nn.Sequential, chunks: int) -> list[int]:
    """Layers per chunk giving each chunk an equal share of the model's blocks (its most frequent kind
    of layer): the layers before the first block join the first chunk, those after the last the last
    (a Transformer's embedding and head, which cost a small part of a block, beside blocks)."""
    kinds = [type(layer) for layer in model]
    block = max(kinds, key=kinds.count)
    first, last = kinds.index(block), len(kinds) - kinds[::-1].index(block)
    counts = even_balance(last - first, chunks)
    counts[0] += first
    counts[-1] += len(kinds) - last
    return counts


def profiled_on(config: RunConfig, sample):
    """The sample moved to the device the stages compute on: layers are timed where they will run
    (a GPU's costs are not a CPU's, nor in the same proportions)."""
    return sample.to(devices_for(config)[0])


def layer_costs(config: RunConfig) -> list[float]:
    """Forward+backward seconds of each layer on one micro-batch of the configuration, on its
    device: the costs balance="time" cuts by (engine.balance.layer_times)."""
    model, (inputs, _), _ = build(config)
    return layer_times(model, profiled_on(config, micro_sample(inputs, config)))


def pipe_options(config: RunConfig) -> dict:
    """How the lab pipelines a configuration: deferred batch norm, seeded randomness, its precision."""
    return dict(chunks=config.micro_batches, checkpoint=config.checkpoint, schedule=config.schedule,
                virtual_stages=config.virtual_stages, seed=config.seed, deferred_batch_norm=True,
                threads_per_stage=config.threads_per_stage, autocast=AUTOCAST[config.precision])


def pipeline(config: RunConfig, model: nn.Sequential, balance, record_memory: bool = False) -> GPipe:
    """The engine pipeline of a configuration, its stages as threads of this process: the one way
    the lab makes a pipe of a configuration (Stepper makes its steps). It keeps no activation
    ledger unless asked (for timing its tasks: the ledger's bookkeeping would be in their times)."""
    return GPipe(model, balance, devices=devices_for(config), **pipe_options(config), record_memory=record_memory)


def run(config: RunConfig, on_event: Optional[Callable] = None, replay: Union[bool, str] = False,
        warmup: int = 1, on_wait: Optional[Callable[[], None]] = None, rounds: int = 1,
        baseline: bool = False, pools: Pools = OWN) -> RunRecord:
    """Build the configuration, run `warmup` unrecorded steps, then `rounds` measured steps, with
    the stages as threads of this process or, with `transport="processes"`, as stage processes from
    `pools` (lab.processes.sources: a pool of the run's own unless the caller shares one; `on_wait`
    is called if another run holds it). The record
    shows the median step (by time), and keeps every round's figures for their spread. Its memory
    is the first step's, the only one that keeps the activation ledger: timed steps keep none.

    With `baseline=True` each round also times one step of K=1 at the same M in this process (one
    stage on one thread, `baseline_of`), K and K=1 interleaved step by step as the benchmark does,
    so both share the host's noise; `record.speedups` are the per-round ratios.

    `on_event` receives the events of the first warm-up step as its tasks finish (for a live view).
    The measured steps run unobserved, since drawing while they run would take CPU time from the
    stages and show up in the very timings.

    With `replay=True`, when the host cannot run all K stages at once, or the stages are on GPUs
    (where the tasks' GPU-over-host ratio says whether Python set the pace: lab.studies.speedup), the same
    step is also run one task at a time (`serial=True`, in this process): those task times, not the
    ones stretched by sharing, are what an ideal replay lays onto K independent devices. `replay="always"` does
    it whatever the host, for claims that must hold on any host.
    """
    check(config)
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: expected at least one measured step")
    if config.device == "cpu":
        keep_freed_cpu_memory()  # as in the stage processes and the benchmarks: every side of a comparison alike
    model, (inputs, targets), loss_fn = build(config)
    balance = choose_balance(config, model, inputs)
    # Sized on the model as built, on the host: a pipe of threads moves the layers it is given onto
    # the stages' devices (as torchgpipe does), where the host's samples could no longer reach them.
    predicted = predicted_activation_bytes(config, model, inputs, balance)
    per_sample = boundary_bytes(model, micro_sample(inputs, config))
    # on GPUs the tasks are timed alone too: their GPU-over-host ratio says whether the step was launch-bound
    alone_needed = config.stages > parallel_devices(config) or config.device == "cuda"
    replayed = replay == "always" or (bool(replay) and alone_needed)
    single = baseline_of(config)
    with stepper_for(config, balance, model, on_wait, pools=pools) as pipe, \
            (stepper_for(single, [config.layers]) if baseline else nullcontext()) as single_pipe:
        memory = None  # the first step's: it alone keeps the activation ledger, the timed steps none
        for number in range(warmup):
            step = pipe.step(inputs, targets, loss_fn, on_event if number == 0 else None, record_memory=number == 0)
            memory = memory or step[1].memory
            if single_pipe is not None:
                single_pipe.step(inputs, targets, loss_fn, record_memory=False)
        measured = []
        for _ in range(rounds):
            loss, trace, wall = pipe.step(inputs, targets, loss_fn, record_memory=memory is None)
            memory = memory or trace.memory
            measured.append((trace, loss, wall, single_pipe.step(inputs, targets, loss_fn, record_memory=False)[1]
                             if single_pipe else None))
    trace, loss, wall, _ = sorted(measured, key=lambda m: m[0].makespan)[len(measured) // 2]
    singles = sorted((m[3] for m in measured if m[3] is not None), key=lambda t: t.makespan)
    if replayed:  # one model at a time (a GPU sized for one has no room for two): the serial run builds its own
        del pipe, single_pipe, model
        if config.device == "cuda":
            if config.transport == "processes":
                pools.free_gpus()
            host.free_gpu_memory()
    solo = solo_run(config, balance) if replayed else None
    crossed, how = _boundary_traffic(config, trace, per_sample, balance)
    return RunRecord(
        config=asdict(config), balance=list(balance), kind="measured", events=trace.to_records(),
        memory=[dict(asdict(m), predicted_activation_bytes=p) for m, p in zip(memory, predicted)],
        makespan=trace.makespan, bubble=trace.bubble, samples_per_second=trace.samples_per_second,
        loss=loss, wall=wall, host=host.describe(), solo_events=solo, notes=_notes(config, inputs),
        messages=[asdict(m) for m in trace.messages], boundary_bytes=crossed, boundary_how=how,
        rounds=[{"step": t.makespan, "baseline": b.makespan if b else None, "bubble": t.bubble,
                 "communication_share": communication_share(t.messages, config.stages, t.makespan)}
                for t, _, _, b in measured],
        baseline_events=singles[len(singles) // 2].to_records() if singles else [])


def side_by_side(configs: dict[str, RunConfig], rounds: int = 5, warmup: int = 1) -> dict[str, list[Trace]]:
    """Steps of several configurations measured in the same rounds: each round runs one step of
    each, in turn, so that a busy moment of the host falls on all of them alike (lab.timelines.verdict judges
    the rounds). Name -> the traces of its measured steps, round by round. Threads only, so that no
    configuration waits for stage processes."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: expected at least one round")
    with ExitStack() as stack:
        steppers = {}
        for name, config in configs.items():
            check(config)
            if config.transport != "threads":
                raise ValueError(f"{name}: transport={config.transport!r}; side_by_side runs stages as threads")
            model, batch, loss_fn = build(config)
            steppers[name] = (stack.enter_context(stepper_for(config, choose_balance(config, model, batch[0]), model)),
                              batch, loss_fn)
        traces: dict[str, list[Trace]] = {name: [] for name in configs}
        for number in range(warmup + rounds):
            for name, (stepper, (inputs, targets), loss_fn) in steppers.items():
                trace = stepper.step(inputs, targets, loss_fn)[1]
                if number >= warmup:
                    traces[name].append(trace)
        return traces


@contextmanager
def stepper_for(config: RunConfig, balance: list[int], model: Optional[nn.Sequential] = None,
                on_wait: Optional[Callable] = None, optimizer: Optional[tuple[str, dict]] = None,
                schedule=None, pools: Pools = OWN) -> Iterator[Stepper]:
    """The configuration's pipe as a lab.runs.stepper.Stepper, cut by `balance`: its stages as threads of
    this process (on `model` if given, the configuration's model built here) or, with
    `transport="processes"`, on stage processes held from `pools` meanwhile (`on_wait` is called if
    another run holds them). `schedule`, a written engine.schedule.Schedule, replaces the named one."""
    recipe = dict(name=config.model, blocks=config.blocks, width=config.width, seed=config.seed, context=config.context)
    options = {**pipe_options(config), **({} if schedule is None else {"schedule": schedule})}
    if config.transport == "processes":
        with pools.hold(config.stages, config.threads_per_stage, on_wait, config.device) as pool:
            yield Stepper(RECIPE, recipe, balance, pool=pool, optimizer=optimizer, **options)
        return
    with Stepper(RECIPE, recipe, balance, optimizer=optimizer, model=model, devices=devices_for(config),
                 **options) as threads:
        yield threads


def _boundary_traffic(config: RunConfig, trace: Trace, per_sample: list[float], balance: list[int]):
    """Bytes per step across each cut between stages, and how they were obtained: counted on the
    wire when stages are processes; from the tensors' sizes at each cut (`per_sample`: bytes per
    sample of each layer's input) when they are threads (which hand tensors over in memory), where a
    gradient the size of each activation comes back."""
    if trace.messages:
        return trace.boundary_bytes, "sent between processes"
    totals: dict[tuple[int, int], dict] = {}
    for chunk in range(len(balance) - 1):
        pair = (chunk % config.stages, (chunk + 1) % config.stages)
        if pair[0] == pair[1]:
            continue  # one stage holds both chunks: nothing crosses
        size = round(config.batch * per_sample[sum(balance[:chunk + 1])])
        entry = totals.setdefault(pair, {"stages": pair, "activations": 0, "gradients": 0})
        entry["activations"] += size
        entry["gradients"] += size
    return [totals[pair] for pair in sorted(totals)], "sizes of the tensors at each cut"


def _notes(config: RunConfig, inputs) -> list[str]:
    """What a learner should know about how this configuration ran here."""
    notes = []
    effective = micro_batch_count(config)
    if effective != config.micro_batches:
        notes.append(f"torch.chunk cuts N={config.batch} into {effective} micro-batches, not M={config.micro_batches} "
                     f"(pieces of {-(-config.batch // config.micro_batches)}): the pipeline ran M={effective}.")
    if config.stages > parallel_devices(config):
        notes.append(f"{config.stages} stages share {parallel_devices(config)} {config.device.upper()} "
                     f"device(s) here: measured tasks stretch while they wait for one. "
                     f"The ideal replay shows K separate devices.")
    return notes


def solo_run(config: RunConfig, balance: list[int]) -> list[dict]:
    """The configuration's tasks timed one at a time (solo_events) on a fresh pipe of its model cut by `balance`."""
    model, (inputs, targets), loss_fn = build(config)
    pipe = pipeline(config, model, balance)
    try:
        return solo_events(pipe, inputs, targets, loss_fn)
    finally:
        pipe.close()


def solo_events(pipe: GPipe, inputs, targets, loss_fn, repeats: int = 5, serial=True) -> list[dict]:
    """Task times measured one at a time (serial steps); each task keeps its median time over
    `repeats` steps (at least 5), so that neither one preempted timing nor one lucky one sets it.
    `serial="gated"`: on GPUs each task's kernels run back to back (GPipe.step), for its GPU time
    apart from the host's; the default times each task at its own pace, as an ideal replay wants."""
    if repeats < 5:
        raise ValueError(f"repeats={repeats}: expected at least 5 serial steps, so that a median means something")
    timings: dict = {}
    for _ in range(repeats):
        pipe.step(inputs, targets, loss_fn, serial=serial)
        for event in pipe.trace.to_records():
            timings.setdefault((event["chunk"], event["op"], event["micro"]), []).append(event)
    middle = [sorted(events, key=lambda e: e["end"] - e["start"])[len(events) // 2] for events in timings.values()]
    return sorted(middle, key=lambda e: e["start"])


def predicted_activation_bytes(config: RunConfig, model: nn.Sequential, inputs, balance: list[int]) -> list[float]:
    """Per stage, the activation peak predicted from per-layer bytes measured on one micro-batch:
    for GPipe, the O(N + (L/K)(N/M)) formula (or O(N*L/K) without recompute); for a later schedule,
    its own task lists replayed by lab.runs.schedule_memory (where each R and W sits matters there)."""
    if config.schedule != "gpipe":
        return [float(p) for p in schedule_peaks(config, model, inputs, balance)]
    saved, inputs_per_sample = layer_bytes_per_sample(model, micro_sample(inputs, config))
    recompute = config.checkpoint != "never"
    predictions, first = [0.0] * config.stages, 0
    for chunk, count in enumerate(balance):
        predictions[chunk % config.stages] += theory.stage_activation_bytes(
            saved[first:first + count], inputs_per_sample[first], config.batch, config.micro_batches, recompute)
        first += count
    return predictions


def schedule_peaks(config: RunConfig, model: nn.Sequential, inputs, balance: list[int],
                   tasks: Optional[Schedule] = None) -> list[int]:
    """Each stage's activation peak for the configuration's schedule, or the written `tasks`
    (lab.runs.schedule_memory), its chunks' storages measured on the model as built, on one micro-batch."""
    from lab.runs.schedule_memory import peaks
    micro = micro_batch_count(config)
    if tasks is None:
        tasks = Schedule(SCHEDULES[config.schedule](config.stages, micro, config.checkpoint, config.virtual_stages))
    return peaks(tasks, *chunk_bytes(config, model, inputs, balance))


def config_chunk_bytes(config: RunConfig) -> tuple[list, int]:
    """`chunk_bytes` on the configuration's model, built here and cut as the configuration says."""
    model, (inputs, _), _ = build(config)
    return chunk_bytes(config, model, inputs, choose_balance(config, model, inputs))


def chunk_bytes(config: RunConfig, model: nn.Sequential, inputs, balance: list[int]) -> tuple[list, int]:
    """What a schedule's activation memory is predicted from: the storages each chunk of `balance`
    saves on one micro-batch (lab.runs.schedule_memory.measure_chunks, on copies of the layers as built),
    and the bytes of the mini-batch's input."""
    return layer_chunks(model, balance, micro_sample(inputs, config)), tensors_of(inputs)[0].untyped_storage().nbytes()


def layer_chunks(model: nn.Sequential, balance: list[int], sample) -> list:
    """The storages each chunk of `balance` saves on `sample`, one micro-batch
    (lab.runs.schedule_memory.measure_chunks), measured on copies of the layers as built."""
    from lab.runs.schedule_memory import measure_chunks
    edges = list(itertools.accumulate(balance, initial=0))
    parts = [copy.deepcopy(nn.Sequential(*list(model)[a:b])) for a, b in zip(edges, edges[1:])]
    # copies of the layers: their batch norm counters and the random state stay
    with torch.random.fork_rng(devices=[]):
        return measure_chunks(parts, sample)


def per_layer_bytes(config: RunConfig) -> tuple[list[float], list[float]]:
    """Measured on one micro-batch of the configuration: per layer, the bytes per sample autograd
    saves for its backward (its own input left out: that is the previous layer's output), and the
    bytes per sample of its input. What the activation-memory formula is fed with."""
    model, (inputs, _), _ = build(config)
    return layer_bytes_per_sample(model, micro_sample(inputs, config))


def layer_bytes_per_sample(model: nn.Sequential, sample) -> tuple[list[float], list[float]]:
    """(bytes each layer saves for backward, bytes of each layer's input), per sample of `sample`."""
    saved = per_sample_of(lambda rows: [b / rows.shape[0] for b in layer_sizes(model, rows, param_scale=0.0,
                                                                                count_inputs=False)], sample)
    return saved, boundary_bytes(model, sample)


def per_sample_of(measure: Callable, sample) -> list[float]:
    """`measure(sample)` (per layer, bytes per sample of the rows it is given) from passes over the
    first 2 and 4 rows only: a layer's bytes are a part that grows with the rows and a part that
    does not (an embedding's position indices), so two small passes give a large one's figures
    without its compute (a GPU table's M=1 sample is its whole batch: minutes on the host)."""
    rows = sample.shape[0]
    if rows <= 4:
        return measure(sample)
    two, four = measure(sample[:2]), measure(sample[:4])
    return [2 * f - t + 4 * (t - f) / rows for t, f in zip(two, four)]


@torch.no_grad()
def boundary_bytes(model: nn.Sequential, sample) -> list[float]:
    """Bytes per sample of each layer's input (what a stage starting there keeps per micro-batch)."""
    return per_sample_of(lambda rows: _input_bytes(model, rows), sample)


def _input_bytes(model: nn.Sequential, sample) -> list[float]:
    sizes, x = [], sample
    was_training = model.training
    model.eval()
    try:
        for layer in model:
            sizes.append(sum(t.numel() * t.element_size() for t in tensors_of(x)) / tensors_of(x)[0].shape[0])
            x = layer(x)
    finally:
        model.train(was_training)
    return sizes


def sweep(configs: Iterable[RunConfig], progress: Optional[Callable[[RunRecord], None]] = None,
          **options) -> list[RunRecord]:
    """Run several configurations in turn; `progress` is called after each."""
    records = []
    for config in configs:
        records.append(run(config, **options))
        if progress is not None:
            progress(records[-1])
    return records


def training_curve(config: RunConfig, steps: int, lr: float = 3e-3) -> list[float]:
    """Train the configuration's model with Adam for `steps` steps through the pipeline (its
    stages as threads or as stage processes of its own); the losses.

    Each step draws a fresh mini-batch (seeded by step), so the curve is a real training curve.
    """
    check(config)
    entry, lengths = zoo.get(config.model), zoo.lengths(config.context)
    model, (inputs, _), _ = build(config)
    balance = choose_balance(config, model, inputs)
    batches = [entry.batch(config.batch, config.width, config.seed + 1 + step, **lengths) for step in range(steps)]
    with stepper_for(config, balance, model, optimizer=("torch.optim.Adam", {"lr": lr})) as pipe:
        return [pipe.step(x, y, entry.loss_fn)[0] for x, y in batches]
