"""Writing a pipeline schedule by hand: a preset to start from, the engine's verdict on every edit in
one line, the unit-cost diagram and the ideal replay on this host's task times, and a real step
beside GPipe's with the gradients compared.

The text is `parse`'s and `format`'s: one line of tasks per stage, "@chunk" where a stage holds
several chunks, an optional "placement:" line; torch.distributed.pipelining's actions as well. Only
`run_beside_gpipe` needs torch (it loads it when called), so the page can check and draw at once.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

from engine import schedule as schedules
from engine.schedule import Report, Schedule, Task, loop, v_shape
from engine.trace import Event, Trace
from lab.config import RunConfig, micro_batch_count
from lab.timelines.replay import Timeline

PRESETS = tuple(schedules.SCHEDULES)  # every built-in schedule, at the fewest chunks per stage it places
MAX_CHARS = 100_000                   # the longest text `examine` reads


TORCH_OPS = {"F": "F", "I": "B", "W": "W", "B": "whole B"}   # torch's action letters in the lab's ops
TORCH_COMMS = re.compile(r"\d+(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)\d*")


def torch_compute(words: list[str]) -> list[str]:
    """torch.distributed.pipelining's actions as compute tasks: its communication actions dropped
    (the engine sends and receives by itself), and an overlapped pair "(0F3;3B1)OVERLAP_F_B"
    (DualPipeV) as its two actions one after the other (the lab runs one task at a time per stage)."""
    tasks = []
    for word in words:
        pair = re.fullmatch(r"\((.*)\)OVERLAP_F_B", word)
        if pair:
            tasks += [action.strip() for action in pair[1].split(";") if action.strip()]
        elif not TORCH_COMMS.fullmatch(word):
            tasks.append(word)
    return tasks


def in_stage_order(lines: list[str]) -> list[str]:
    """The non-empty lines, the stages' put in order where every one is labelled "stage k:" and the
    labels number them 0..K-1 in another order (written bottom up, say); else as they are."""
    lines = [line for line in lines if line]
    stages = [line for line in lines if not line.lower().startswith("placement")]
    labels = [re.match(r"stage\s*(\d+)\s*:", line, re.I) for line in stages]
    if not all(labels) or sorted(int(m[1]) for m in labels) != list(range(len(stages))):
        return lines
    by_label = iter(line for _, line in sorted(zip((int(m[1]) for m in labels), stages)))
    return [line if line.lower().startswith("placement") else next(by_label) for line in lines]


def parse(text: str) -> Schedule:
    """A schedule from text, one line of tasks per stage ("stage 0: F0 F1 B0 F2 B1 B2", the label
    optional): op and micro-batch, then "@chunk" where a stage holds several chunks ("F3@5"), and an
    optional line "placement: loop", "placement: V" or the stage of each chunk ("placement: 0 1 1 0");
    without one, chunk c is on the stage that names it. "#" starts a comment. It reads
    torch.distributed.pipelining's actions too, comma-separated ("1F0": chunk 1, forward, micro-batch
    0; "I" is a B with W split off, and torch's "B", a whole backward, is a B and its W where W is
    split off elsewhere), one rank per line, with communication and overlapped actions (`torch_compute`)."""
    placement, rows, found, named_twice = None, [], {}, None
    for line in in_stage_order([line.split("#")[0].strip() for line in text.splitlines()]):
        head, _, rest = line.rpartition(":")
        if head.strip().lower() == "placement":
            placement = rest.split()
            continue
        if head and not re.fullmatch(rf"stage\s*{len(rows)}", head.strip(), re.I):
            raise ValueError(f"{head.strip()!r}: expected 'stage {len(rows)}:' (stages in order) or 'placement:'")
        row = []
        for word in torch_compute(rest.replace(",", " ").split()):
            match = re.fullmatch(r"([FRBW])(\d+)(?:@(\d+))?|(\d+)([FIBW])(\d+)", word)
            if match is None:
                raise ValueError(f"{word!r} is not a task: expected F, R, B or W, a micro-batch and, where a stage "
                                 f"holds several chunks, @chunk (F3, B0@5), or a torch action (1F0)")
            op, micro, chunk = match.group(1, 2, 3) if match[1] else (TORCH_OPS[match[5]], match[6], match[4])
            row.append((op, int(micro), None if chunk is None else int(chunk)))
            if chunk is not None and found.setdefault(int(chunk), len(rows)) != len(rows):
                named_twice = (int(chunk), found[int(chunk)], len(rows))
        rows.append(row)
    if not rows:
        raise ValueError("no stages: expected one line of tasks per stage, such as 'stage 0: F0 F1 B0 B1'")
    split = any(op == "W" for row in rows for op, _, _ in row)

    def lab_tasks(op: str, micro: int, chunk):   # torch's whole B: the lab's B, and its W where W is split off
        return [("B", micro, chunk), ("W", micro, chunk)] if op == "whole B" and split else \
            [("B" if op == "whole B" else op, micro, chunk)]
    rows = [[task for written in row for task in lab_tasks(*written)] for row in rows]
    if max(found, default=-1) >= sum(map(len, rows)):  # every chunk has tasks: a stray "@99999" lays out nothing
        raise ValueError(f"chunk {max(found)} is named, but {sum(map(len, rows))} tasks cannot cover so many chunks")
    count = -(-max(max(found, default=0) + 1, len(rows)) // len(rows)) * len(rows)
    if placement is None:
        if named_twice:
            chunk, first, second = named_twice
            raise ValueError(f"chunk {chunk} is named on stage {first} and on stage {second}: a chunk of layers lives "
                             f"on one stage (rename one, or say where each chunk lives in a 'placement:' line)")
        place = tuple(found.get(c, c % len(rows)) for c in range(count))
    elif placement in (["loop"], ["V"]):
        place = (loop if placement == ["loop"] else v_shape)(len(rows), count)
    elif all(p.isdigit() for p in placement):
        place = tuple(map(int, placement))
    else:
        raise ValueError(f"placement: {' '.join(placement)}: expected 'loop', 'V' or one stage number per chunk")
    mine = [[c for c, at in enumerate(place) if at == k] for k in range(len(rows))]
    for k, op, micro in ((k, op, m) for k, row in enumerate(rows) for op, m, c in row if c is None):
        if len(mine[k]) != 1:
            raise ValueError(f"{op}{micro} on stage {k} names no chunk, but the stage holds chunks {mine[k]}: "
                             f"write {op}{micro}@{(mine[k] or [k])[0]}")
    return Schedule([[Task(op, m, mine[k][0] if c is None else c) for op, m, c in row]
                     for k, row in enumerate(rows)], place)


def format(schedule: list[list[Task]], torch: bool = False) -> str:
    """The text `parse` reads: a placement line where a stage holds several chunks, then the stages;
    or, `torch=True`, torch.distributed.pipelining's actions, one rank per row, which have no
    recompute (a schedule with R's raises: checkpoint inside the stage's module there)."""
    schedule = schedule if isinstance(schedule, Schedule) else Schedule(schedule)
    place, stages, split = schedule.placement, len(schedule), any(t.op == "W" for s in schedule for t in s)
    if torch:
        for k, task in ((k, t) for k, tasks in enumerate(schedule) for t in tasks if t.op == "R"):
            raise ValueError(f"stage {k} runs {schedule.label(task)}, a recompute: torch.distributed.pipelining "
                             f"has no recompute action, so export a schedule made with checkpoint='never'")
        return "\n".join(",".join(f"{t.chunk}{'I' if split and t.op == 'B' else t.op}{t.micro}" for t in tasks)
                         for tasks in schedule)
    named = {v_shape(stages, len(place)): "V", loop(stages, len(place)): "loop"}.get(place, " ".join(map(str, place)))
    head = [f"placement: {named}"] if len(place) > stages or named != "loop" else []
    return "\n".join(head + [f"stage {k}: " + " ".join(map(schedule.label, tasks)) for k, tasks in enumerate(schedule)])


def preset(name: str, stages: int, micro_batches: int, checkpoint: str) -> str:
    """The text of a named schedule at K, M and checkpoint mode, to start editing from (interleaved
    and ZB-V with two chunks per stage); a ValueError, as the engine words it, where it cannot be
    built (interleaved needs M a multiple of K)."""
    if name not in PRESETS:
        raise ValueError(f"preset {name!r}: expected one of {PRESETS}")
    kind = schedules.SCHEDULES[name]
    return format(Schedule(kind(stages, micro_batches, checkpoint, kind.fewest_chunks)))


def describe(report: Report) -> str:
    """A report in words: "makespan 33 units, bubble 27%, at most 4 micro-batches held on a stage"."""
    return (f"makespan {report.makespan:g} units, bubble {report.bubble:.0%}, at most {report.held:g} "
            f"micro-batch{'' if report.held == 1 else 'es'} held on a stage")


@dataclass(frozen=True)
class Verdict:
    """What the engine says of a written text: the schedule and its report if it can run, and one line."""

    schedule: Optional[Schedule]
    report: Optional[Report]
    line: str

    @property
    def legal(self) -> bool:
        return self.report is not None


def examine(text: str, micro_batches: int, checkpoint: str) -> Verdict:
    """Parse and check `text` for M micro-batches: "✓ legal: <report>" or "✗ <the first problem>"; a
    text longer than MAX_CHARS is refused unread (a page's box takes any text)."""
    if len(text) > MAX_CHARS:
        return Verdict(None, None, f"✗ {len(text)} characters: a page takes at most {MAX_CHARS} (ZB-V at K=8, M=64 "
                                   f"is about 26,000)")
    try:
        schedule = parse(text)
        report = schedules.check(schedule, micro_batches, checkpoint)
    except ValueError as error:
        return Verdict(None, None, f"✗ {error}{where_in(text, str(error))}{torch_malformed(text, micro_batches)}")
    return Verdict(schedule, report, f"✓ legal: {describe(report)}")


def where_in(text: str, problem: str) -> str:
    """" (line 3)": the line of `text` holding the stage a `problem` ("stage 2 runs F9: ...") names,
    as `in_stage_order` reads the lines (by their labels where every stage line has one)."""
    named = re.match(r"stage (\d+) ", problem)
    if named is None:
        return ""
    stage = int(named[1])
    cleaned = [(number, line.split("#")[0].strip()) for number, line in enumerate(text.splitlines(), 1)]
    rows = [(number, line) for number, line in cleaned if line and not line.lower().startswith("placement")]
    labels = {int(m[1]): number for number, line in rows if (m := re.match(r"stage\s*(\d+)\s*:", line, re.I))}
    line = labels.get(stage) if len(labels) == len(rows) else (rows[stage][0] if stage < len(rows) else None)
    return "" if line is None else f" (line {line})"


def torch_malformed(text: str, micro_batches: int) -> str:
    """Where `text` is in torch.distributed.pipelining's actions and a rank's forwards are numbered 1
    to M, one past the M micro-batches (Schedule1F1B's last rank, as torch 2.13 writes its order),
    what that is and how to get a correct order; else ""."""
    for line in text.splitlines():
        forwards = sorted(int(m[1]) for m in re.finditer(r"(?<![\w@])\d+F(\d+)", line))
        if forwards and forwards == list(range(1, micro_batches + 1)):
            return (f". This is torch.distributed.pipelining's own order, malformed as torch writes it: a rank's "
                    f"forwards are numbered 1 to {micro_batches}, one too high (Schedule1F1B's last rank, torch "
                    f"2.13); renumber them from 0, or take the lab's 1F1B ('1f1b' preset, or format(..., torch=True))")
    return ""


def laid_out(schedule: Schedule, duration, label: str, unit: str, latency: float = 0.0) -> Timeline:
    """The schedule's tasks laid onto its dependencies (engine.schedule.timeline), as a Timeline."""
    times = schedules.timeline(schedule, duration, latency)
    events = [Event(k, task.micro, task.op, start, end, "", task.chunk)
              for k, tasks in enumerate(schedule) for task, (start, end) in zip(tasks, times[k])]
    return Timeline(label, Trace(stages=len(schedule), events=sorted(events, key=lambda e: (e.start, e.stage))), unit)


def unit_cost(schedule: Schedule) -> Timeline:
    """The textbook diagram of a written schedule, with the costs `check` predicts with (a stage's
    F 1, B 2, or B 1 and W 1 with W split off, R 1; a chunk of a stage of v does 1/v of it)."""
    split = any(t.op == "W" for tasks in schedule for t in tasks)
    costs = {"F": 1.0, "R": 1.0, "B": 1.0 if split else 2.0, "W": 1.0}
    share = len(schedule) / len(schedule.placement)
    return laid_out(schedule, lambda k, task: costs[task.op] * share, "theory (unit costs), written", "time units")


def stage_task_seconds(events: list[dict], virtual: int) -> dict[tuple[int, str], float]:
    """Each stage's mean measured seconds per op, for the stage's whole share of layers (a chunk's
    time times the `virtual` chunks per stage it was measured with); with W measured apart, B's
    includes it. Keyed by (stage, op): stages of one model differ (an embedding, a head)."""
    totals: dict[tuple[int, str], list[float]] = {}
    for e in events:
        totals.setdefault((e["stage"], e["op"]), []).append((e["end"] - e["start"]) * virtual)
    mean = {key: sum(times) / len(times) for key, times in totals.items()}
    for stage, _ in [key for key in mean if key[1] == "W"]:
        mean[(stage, "B")] += mean.pop((stage, "W"))
    return mean


def message_seconds(messages: list[dict]) -> float:
    """What a message between stages took in a run (a RunRecord's `messages`): the median sending
    time plus the median reading time, the two stage threads' shares (0 for threads, which pass
    references). A replay adds it where a task waits for another stage's."""
    def median(direction: str) -> float:
        times = sorted(m["end"] - m["start"] for m in messages if m["direction"] == direction)
        return times[len(times) // 2] if times else 0.0
    return median("send") + median("receive")


def replayed(schedule: Schedule, events: list[dict], virtual: int, latency: float = 0.0) -> Timeline:
    """An ideal replay of the written schedule on this host's measured task times: each stage's mean
    per op (`stage_task_seconds`), divided among the schedule's chunks, and `latency` per message
    between stages; with W split off, B and W take half of the stage's measured backward each (how
    the engine's split falls on a given model varies)."""
    mean = stage_task_seconds(events, virtual)
    split = any(t.op == "W" for tasks in schedule for t in tasks)
    share = len(schedule) / len(schedule.placement)

    def cost(stage: int, task: Task) -> float:
        backward = mean[(stage, "B")]
        return share * {"F": mean[(stage, "F")], "R": mean.get((stage, "R"), mean[(stage, "F")]),
                        "B": backward / (2 if split else 1), "W": backward / 2}[task.op]
    return laid_out(schedule, cost, "ideal replay of this host's task times", "s", latency)


@dataclass(frozen=True)
class Ran:
    """A schedule's real steps: the median step's measured timeline, each stage's activation peak
    (and the one its task lists predict), how far its gradients are from the reference (`reference`
    says which), and each measured round's step (seconds) and bubble, measured beside the other
    schedule's in the same rounds."""

    label: str
    timeline: Timeline
    peaks: list[int]
    difference: float
    reference: str
    steps: tuple = ()
    bubbles: tuple = ()
    predicted_peaks: tuple = ()   # each stage's, from where its tasks sit (lab.runs.schedule_memory)


def run_beside_gpipe(config: RunConfig, schedule: Schedule, rounds: int = 1, also: tuple = (),
                     called: str = "written", checkpoint: Optional[str] = None) -> list[Ran]:
    """Steps of `schedule` (labelled `called`; under `checkpoint`, "as_written" say, else the
    configuration's) on the configuration's model, its stages as the configuration says (threads
    or processes), beside GPipe's at the same K and M, and beside each built-in schedule named in
    `also` (at the fewest chunks per stage it places): one step of each
    to warm up, then `rounds` rounds of one step of each, in turn, so that the host's load falls on
    all alike (lab.timelines.verdict judges the rounds). The gradients of each (every step starts from zero,
    no optimizer steps) against the unpipelined step on the whole mini-batch (against GPipe's, for
    a model with dropout, whose masks the pipeline draws per micro-batch)."""
    from lab.runs.exactness import has_dropout, unpipelined_gradients  # torch loads here, not with the page
    from lab.runs.experiments import build, choose_balance, schedule_peaks, stepper_for
    from lab.timelines.replay import measured

    if rounds < 1:
        raise ValueError(f"rounds={rounds}: expected at least one measured round")
    micro = micro_batch_count(config)
    checkpoint = checkpoint or config.checkpoint
    schedules.check(schedule, micro, checkpoint)
    if len(schedule) != config.stages:
        raise ValueError(f"the schedule has {len(schedule)} stages but the setting has K={config.stages}")
    virtual = len(schedule.placement) // len(schedule)
    schedules.check_layout("written", config.stages, micro, virtual, config.layers)  # a layer or more per chunk
    sides = ((called, config.but(virtual_stages=virtual, checkpoint=checkpoint), schedule),
             ("GPipe", config.but(schedule="gpipe", virtual_stages=1), None),
             *((schedules.SCHEDULES[name].label, config.but(schedule=name, virtual_stages=schedules.SCHEDULES[
                 name].fewest_chunks), None) for name in also if name != "gpipe"))
    traces: dict[str, list] = {label: [] for label, _, _ in sides}
    gradients, predicted, peaks = {}, {}, {}
    for number in range(rounds + 1):  # round 0 warms up: the first step pays for allocations
        for label, setting, written in sides:
            model, (inputs, targets), loss_fn = build(setting)
            balance = choose_balance(setting, model, inputs)
            if not number:  # on the model as built, before a pipe moves it
                predicted[label] = tuple(schedule_peaks(setting, model, inputs, balance, written))
            with stepper_for(setting, balance, model, schedule=written) as stepper:
                warm = stepper.step(inputs, targets, loss_fn)[1]  # the ledger's count: the timed step keeps none
                peaks[label] = [m.activation_peak_bytes for m in warm.memory]
                if number:
                    traces[label].append(stepper.step(inputs, targets, loss_fn, record_memory=False)[1])
                    gradients[label] = stepper.gradients()
    model, (inputs, targets), loss_fn = build(config)
    dropout = has_dropout(model)
    reference = gradients["GPipe"] if dropout else unpipelined_gradients(model, inputs, targets, loss_fn)
    runs = []
    for label, steps in traces.items():
        median = sorted(steps, key=lambda t: t.makespan)[len(steps) // 2]
        runs.append(Ran(label, measured(median.to_records(), median.stages, f"measured, {label}"),
                        peaks[label],
                        max(float((a.cpu() - b.cpu()).abs().max()) for a, b in zip(gradients[label], reference)),
                        "GPipe's gradients" if dropout else "the unpipelined step",
                        tuple(t.makespan for t in steps), tuple(t.bubble for t in steps), predicted[label]))
    return runs


def cap_line(config: RunConfig, schedule: Schedule, cap: int) -> str:
    """The written schedule against a cap of `cap` bytes on each stage's activations, predicted from
    where its tasks sit on the configuration's model (lab.runs.schedule_memory): "✓ ..." with each stage's
    predicted peak, or "✗ ..." naming the first stage and task that would pass the cap."""
    from lab.runs.experiments import config_chunk_bytes
    from lab.runs.schedule_memory import check_cap, peaks

    chunks, batch_bytes = config_chunk_bytes(config.but(virtual_stages=len(schedule.placement) // len(schedule)))
    try:
        check_cap(schedule, chunks, batch_bytes, cap)
    except ValueError as error:
        return f"✗ {error}"
    held = ", ".join(f"{p / 1024:.0f}" for p in peaks(schedule, chunks, batch_bytes))
    return f"✓ within the cap of {cap / 1024:.0f} KiB on every stage: predicted peaks {held} KiB"


def gradients_cell(ran: Ran) -> str:
    """One run's largest gradient difference from the reference, as a table's short cell ("2.0e-08"),
    or "the reference" for the run whose gradients are it (`gradients_caption` says which)."""
    return "the reference" if ran.reference == f"{ran.label}'s gradients" else f"{ran.difference:.1e}"


def gradients_caption(runs: Sequence[Ran]) -> str:
    """What the gradients column compares against, in words, once under the table."""
    reference = runs[0].reference
    dropout = reference.endswith("'s gradients")  # a schedule's own: the unpipelined step draws other masks
    why = "; the model has dropout, whose masks only a pipeline draws alike" if dropout else ""
    return f"Largest gradient difference: each schedule's, from {reference}{why}."
