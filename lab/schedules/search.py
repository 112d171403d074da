"""Finding a schedule instead of writing one: given each stage's measured task times, K, M and a
cap on each stage's activation bytes, the fastest order of tasks that fits.

The search space is the zero-bubble paper's (Qi et al., 2023), one chunk per stage and no
recompute: each backward split into B (input gradient, sent upstream) and W (weight gradient, free
to move), or, as a second space, whole backwards (one pass can cost less than B and W apart: on
a CPU it often does); each stage runs its F's, B's and W's in micro-batch order (micro-batches
cost alike, so another order buys nothing). A schedule's time is `engine.schedule.timeline` on the
given costs, its memory `lab.runs.schedule_memory.footprints` on the measured bytes: the predictions
`check` and the cap make.

- **Heuristic**, in the spirit of the paper's: lay tasks onto the clock, a free stage running a
  ready B first (the critical path), else a ready F if the stage holds fewer than a limit of
  micro-batches and the cap allows, else its oldest pending W (so W's fill what would be idle time
  and free memory an F waits for; "eager": right after their B). Every limit from 1 to M with W's
  late, eager or whole is tried, with GPipe, 1F1B and ZB-H1 themselves; the fastest that fits wins.
- **Exact** for small K and M: from the heuristic's best, a depth-first search over every order of
  both spaces, one task at a time on the stage free earliest (or that stage waits for another's
  task), pruned by a lower bound and by the cap. It says whether it finished within `exact_limit`
  steps; where it did not, the answer is the best found, and said so.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Optional, Sequence

from engine.schedule import SCHEDULES, Schedule, Task, timeline, upstream
from lab.config import RunConfig, micro_batch_count
from lab.runs.schedule_memory import ChunkBytes, in_bytes, peaks


@dataclass(frozen=True)
class Costs:
    """Each stage's time for one micro-batch's F, B (with W split off: the input gradient only) and
    W, and the time a message takes between stages, in one unit (seconds, or unit costs); `whole`,
    where measured, the backward's time without W split off (one pass instead of two can be
    cheaper than B and W together), else B + W."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    weights: tuple[float, ...]
    latency: float = 0.0
    whole: Optional[tuple[float, ...]] = None

    def __post_init__(self):
        counts = {len(self.forward), len(self.backward), len(self.weights), len(self.whole or self.forward)}
        if len(counts) != 1 or not self.forward:
            raise ValueError(f"costs for {len(self.forward)}, {len(self.backward)} and {len(self.weights)} stages: "
                             f"expected F, B and W times for every stage")
        if min(self.forward + self.backward + self.weights + (self.whole or ())) < 0 or self.latency < 0:
            raise ValueError("a task's time or the latency is negative: expected times >= 0")

    @property
    def stages(self) -> int:
        return len(self.forward)

    def duration(self, stage: int, task: Task, split: bool = True) -> float:
        """A task's time on its stage; without W's split off (`split` False) a B is the whole backward."""
        if task.op == "F":
            return self.forward[stage]
        if task.op == "W":
            return self.weights[stage]
        if split:
            return self.backward[stage]
        return self.whole[stage] if self.whole else self.backward[stage] + self.weights[stage]


def unit_costs(stages: int) -> Costs:
    """F = B = W = 1 on every stage, no latency: the zero-bubble paper's textbook setting."""
    return Costs((1.0,) * stages, (1.0,) * stages, (1.0,) * stages)


def measured_costs(events: list[dict], latency: float = 0.0, whole: Optional[list[dict]] = None) -> Costs:
    """Each stage's median F, B and W seconds from a run's events with W split off (ZB-H1's, say;
    lab.runs.experiments.solo_run times each task alone), `latency` per message, and the whole
    backward's from the events of a run without W's (`whole`, 1F1B's say), where given."""
    median = _medians(events)
    stages = 1 + max(stage for stage, _ in median)
    missing = [f"{op} on stage {k}" for k in range(stages) for op in "FBW" if (k, op) not in median]
    if missing:
        raise ValueError(f"no {', '.join(missing)} among the events: expected a run with W split off (zb-h1)")
    backward = None if whole is None else _medians(whole)
    if backward is not None and any((k, "B") not in backward or (k, "W") in backward for k in range(stages)):
        raise ValueError("the whole backward's events: expected a B on every stage and no W (a run without W's)")
    return Costs(*(tuple(median[(k, op)] for k in range(stages)) for op in "FBW"), latency=latency,
                 whole=None if backward is None else tuple(backward[(k, "B")] for k in range(stages)))


def _medians(events: list[dict]) -> dict[tuple[int, str], float]:
    """The median duration of each (stage, op) among the events."""
    times: dict[tuple[int, str], list[float]] = {}
    for e in events:
        times.setdefault((e["stage"], e["op"]), []).append(e["end"] - e["start"])
    return {key: sorted(v)[len(v) // 2] for key, v in times.items()}


def makespan(schedule: Schedule, costs: Costs) -> float:
    """A schedule's predicted time on these costs (its tasks laid onto their dependencies; a stage
    of v chunks spends 1/v of its time on each)."""
    split, share = any(t.op == "W" for tasks in schedule for t in tasks), len(schedule) / len(schedule.placement)
    times = timeline(schedule, lambda k, task: costs.duration(k, task, split) * share, costs.latency)
    return max(end for stage in times for _, end in stage)


@dataclass(frozen=True)
class Found:
    """The search's answer: the schedule, its predicted time and peaks, whether the search covered
    every order (`exact`) or took the heuristic's best, and how it was found, in words."""

    schedule: Schedule
    makespan: float
    peaks: tuple[int, ...]
    exact: bool
    how: str


class _Bytes:
    """What F, B and W add and free on each stage (one chunk per stage), as lab.runs.schedule_memory counts
    them: F holds the chunk's input and saved tensors (the first stage: the mini-batch's storage once,
    while any micro-batch is held), B frees all but what W's graph keeps, W frees the rest."""

    def __init__(self, chunks: list[ChunkBytes], batch_bytes: int):
        first = lambda c: c == 0
        self.held = [sum(n for _, n in b.saved) + (0 if first(c) else b.input) for c, b in enumerate(chunks)]
        self.kept = [sum(n for name, n in b.saved if name in b.kept_for_w) +
                     (b.input if "in" in b.kept_for_w and not first(c) else 0) for c, b in enumerate(chunks)]
        self.base = [batch_bytes] + [0] * (len(chunks) - 1)

    def change(self, stage: int, op: str, split: bool) -> int:
        """What a task of `op` adds to (or frees from) its stage's bytes."""
        return {"F": self.held[stage], "B": (self.kept[stage] if split else 0) - self.held[stage],
                "W": -self.kept[stage]}[op]


def search(stages: int, micro_batches: int, costs: Costs, chunks: Optional[list[ChunkBytes]] = None,
           batch_bytes: int = 0, cap: Optional[Sequence[int]] = None, exact_limit: int = 50_000) -> Found:
    """The fastest schedule (by `makespan` on `costs`) whose predicted activations stay under `cap`
    (bytes per stage, one number or one per stage; None: no cap, and `chunks` may be None). Exact when
    the search finishes within `exact_limit` nodes, else the heuristic's best. Raises ValueError when
    no schedule fits (the cap is below one micro-batch on some stage)."""
    if costs.stages != stages:
        raise ValueError(f"costs for {costs.stages} stages, but K={stages}")
    if stages < 1 or micro_batches < 1:
        raise ValueError(f"need K >= 1 and M >= 1, got K={stages} and M={micro_batches}")
    caps = None if cap is None else (list(cap) if isinstance(cap, (list, tuple)) else [cap] * stages)
    if caps is not None and (chunks is None or len(chunks) != stages or len(caps) != stages):
        raise ValueError(f"a cap needs each of the {stages} stages' chunk bytes and one cap (or one per stage)")
    sizes = _Bytes(chunks, batch_bytes) if caps is not None else None
    if sizes is not None:
        for k in range(stages):
            if sizes.base[k] + sizes.held[k] > caps[k]:
                raise ValueError(f"stage {k} holds {in_bytes(sizes.base[k] + sizes.held[k])} with one micro-batch, "
                                 f"over its cap of {in_bytes(caps[k])}: no order of tasks fits (recompute, or more "
                                 "stages)")
    best = _heuristic(stages, micro_batches, costs, sizes, caps, chunks, batch_bytes)
    schedule, how, nodes, finished = best[1], best[2], 0, True
    for split in (True, False):  # the orders with W's split off, then those with whole backwards
        exact = _Exact(stages, micro_batches, costs, sizes, caps, (best[0], schedule), exact_limit, split)
        if exact.best is not schedule:
            schedule, how = exact.best, "a depth-first search from the heuristic's best"
        nodes, finished = nodes + exact.nodes, finished and exact.nodes <= exact_limit
        best = (exact.bound, schedule)
    same = next((SCHEDULES[name].label for name in ("gpipe", "1f1b", "zb-h1")
                 if Schedule(SCHEDULES[name](stages, micro_batches, "never")) == schedule), None)
    how += (f" (the very order of {same})" if same else "") + (
        f"; every order searched ({nodes} steps): none is faster" if finished else
        f"; the best found: the exact search stopped at {exact_limit} steps, before it covered every order")
    held = tuple(peaks(schedule, chunks, batch_bytes)) if chunks is not None else ()
    return Found(schedule, makespan(schedule, costs), held, finished, how)


def _fits(schedule: Schedule, chunks, batch_bytes: int, caps) -> bool:
    return caps is None or all(p <= c for p, c in zip(peaks(schedule, chunks, batch_bytes), caps))


def _heuristic(stages: int, micro: int, costs: Costs, sizes, caps, chunks, batch_bytes) -> tuple[float, Schedule, str]:
    """The fastest fitting schedule among the greedy variants and the named ones: (time, schedule, how)."""
    tried = [(f"greedy, at most {limit} in flight, W {when}", _greedy(stages, micro, costs, sizes, caps, limit, when))
             for limit in range(1, micro + 1) for when in ("late", "eager", "whole")]
    tried += [(SCHEDULES[name].label, Schedule(SCHEDULES[name](stages, micro, "never"))) for name in
              ("gpipe", "1f1b", "zb-h1")]
    fitting = [(makespan(s, costs), i, s, how) for i, (how, s) in enumerate(tried)
               if s is not None and _fits(s, chunks, batch_bytes, caps)]
    if not fitting:
        raise ValueError("no schedule the search tried fits the cap")
    time, _, schedule, how = min(fitting, key=lambda f: (f[0], f[1]))
    return time, schedule, how


def _greedy(stages: int, micro: int, costs: Costs, sizes, caps, limit: int, when: str) -> Optional[Schedule]:
    """One list schedule (see the module's docstring), laid on a clock that moves from one task's end
    (or message's arrival) to the next: W's "late" or "eager", or none ("whole": each B the whole
    backward). None if the limit or the cap stalls it."""
    split = when != "whole"
    per_stage = (3 if split else 2) * micro
    plans: list[list[Task]] = [[] for _ in range(stages)]
    ends: dict[Task, float] = {}
    free, held, events = [0.0] * stages, [0] * stages, [0.0]
    f, b, w = [0] * stages, [0] * stages, [0] * stages

    def arrived(task: Task, clock: float) -> bool:
        at = _arrival(task, stages, ends, costs.latency)
        return at is not None and at <= clock

    def fits(k: int) -> bool:
        return caps is None or sizes.base[k] + held[k] + sizes.held[k] <= caps[k]

    while events:
        clock = heapq.heappop(events)
        for k in (k for k in range(stages) if free[k] <= clock and len(plans[k]) < per_stage):
            ready = [t for t in [Task("B", b[k], k)] * (b[k] < f[k]) if arrived(t, clock)] or \
                [t for t in [Task("F", f[k], k)] * (f[k] < micro and f[k] - (w if split else b)[k] < limit and fits(k))
                 if arrived(t, clock)]
            if split and w[k] < b[k] and (when == "eager" or not ready):
                ready = [Task("W", w[k], k)]   # right after its B, or where the stage would idle or wait for memory
            if not ready:
                continue
            task = ready[0]
            ends[task] = free[k] = clock + costs.duration(k, task, split)
            plans[k].append(task)
            heapq.heappush(events, free[k])
            if costs.latency:
                heapq.heappush(events, free[k] + costs.latency)
            counter = {"F": f, "B": b, "W": w}[task.op]
            counter[k] += 1
            held[k] += sizes.change(k, task.op, split) if sizes else 0
    return Schedule(plans) if all(len(p) == per_stage for p in plans) else None


def _arrival(task: Task, stages: int, ends: dict, latency: float) -> Optional[float]:
    """When a task's input from the neighbouring stage is there (engine.schedule.upstream; one chunk
    per stage: chunk k is stage k), 0 if it needs none (what its own stage made comes earlier in its
    list); None while the task it needs is not laid yet."""
    needed = upstream(task, stages)
    if needed is None:
        return 0.0
    return ends[needed] + latency if needed in ends else None


class _Exact:
    """The depth-first search over every order (see the module's docstring), from the heuristic's
    best (time, schedule, how) as the bound to beat; `best` is the schedule found, `nodes` the
    count of steps taken (more than `limit`: stopped)."""

    def __init__(self, stages: int, micro: int, costs: Costs, sizes, caps, start, limit: int, split: bool):
        self.K, self.M, self.costs, self.sizes, self.caps, self.limit = stages, micro, costs, sizes, caps, limit
        self.split, self.per_stage = split, (3 if split else 2) * micro
        self.bound, self.best, self.nodes = start[0], start[1], 0
        self.plans = [[] for _ in range(stages)]
        self.ends: dict[Task, float] = {}
        self.free, self.held = [0.0] * stages, [0] * stages
        self.counts = [[0, 0, 0] for _ in range(stages)]  # F, B, W laid per stage
        self.was_free: list[float] = []                     # each laid task's stage's free time before it
        self.left = [micro * sum(costs.duration(k, Task(op, 0), split) for op in "FBW"[:2 + split])
                     for k in range(stages)]
        self._dive(frozenset(), {})

    def _lower_bound(self) -> float:
        """No order from here ends sooner: each stage has its remaining work to do; and the last
        micro-batch's chain, its F down the stages and its B back up (a message between stages),
        each link no sooner than its stage's remaining F's (and B's) before it, then the first
        stage's last W."""
        last, lat, bound = self.M - 1, self.costs.latency, 0.0
        time = lambda k, op: self.costs.duration(k, Task(op, 0), self.split)
        chain = 0.0
        for k in range(self.K):  # the last F's end on each stage, down the pipe
            f, b, _ = self.counts[k]
            done = self.ends.get(Task("F", last, k))
            chain = done if done is not None else max(self.free[k] + (self.M - f) * time(k, "F"),
                                                      chain + (lat if k else 0.0) + time(k, "F"))
        for k in reversed(range(self.K)):  # the last B's end on each stage, back up
            f, b, w = self.counts[k]
            done = self.ends.get(Task("B", last, k))
            chain = done if done is not None else max(
                self.free[k] + (self.M - f) * time(k, "F") + (self.M - b) * time(k, "B"),
                chain + (lat if k < self.K - 1 else 0.0) + time(k, "B"))
            last_w = time(k, "W") if self.split and w < self.M else 0.0
            bound = max(bound, self.free[k] + self.left[k], chain + last_w)
        return bound

    def _options(self, k: int) -> list[Task]:
        f, b, w = self.counts[k]
        tasks = [Task("B", b, k)] * (b < f) + [Task("F", f, k)] * (f < self.M) + \
            [Task("W", w, k)] * (self.split and w < b)
        if self.caps is not None and f < self.M:
            sizes = self.sizes
            if sizes.base[k] + self.held[k] + sizes.held[k] > self.caps[k]:
                tasks.remove(Task("F", f, k))
        return [t for t in tasks if _arrival(t, self.K, self.ends, self.costs.latency) is not None]

    def _dive(self, waiting: frozenset, forbidden: dict) -> None:
        self.nodes += 1
        if self.nodes > self.limit:
            return
        open_ = [k for k in range(self.K) if len(self.plans[k]) < self.per_stage]
        if not open_:
            time = max(self.free)
            if time < self.bound - 1e-12:
                self.bound, self.best = time, Schedule([list(p) for p in self.plans])
            return
        if self._lower_bound() >= self.bound - 1e-12:
            return
        eligible = [k for k in open_ if k not in waiting]
        if not eligible:
            return  # every stage waits for another: this order deadlocks
        k = min(eligible, key=lambda k: (self.free[k], k))
        options = [t for t in self._options(k) if t not in forbidden.get(k, ())]
        for task in options:
            self._lay(k, task)
            self._dive(frozenset(), {j: v for j, v in forbidden.items() if j != k})
            self._unlay(k, task)
            if self.nodes > self.limit:
                return
        if len(eligible) > 1:  # k waits for a task another stage has still to lay
            self._dive(waiting | {k}, {**forbidden, k: forbidden.get(k, frozenset()) | frozenset(options)})

    def _lay(self, k: int, task: Task) -> None:
        start = max(self.free[k], _arrival(task, self.K, self.ends, self.costs.latency))
        duration = self.costs.duration(k, task, self.split)
        self.plans[k].append(task)
        self.ends[task] = start + duration
        self.was_free.append(self.free[k])
        self.free[k] = start + duration
        self.left[k] -= duration
        self.counts[k]["FBW".index(task.op)] += 1
        if self.sizes is not None:
            self.held[k] += self.sizes.change(k, task.op, self.split)

    def _unlay(self, k: int, task: Task) -> None:
        self.plans[k].pop()
        del self.ends[task]
        self.free[k] = self.was_free.pop()
        self.left[k] += self.costs.duration(k, task, self.split)
        self.counts[k]["FBW".index(task.op)] -= 1
        if self.sizes is not None:
            self.held[k] -= self.sizes.change(k, task.op, self.split)


# --- on a configuration of the lab: its costs and bytes measured, the search, its rivals ---------

COMPARED = ("gpipe", "1f1b", "zb-h1", "zb-v")   # what a found schedule is shown beside


def costs_for(config: RunConfig) -> Costs:
    """The configuration's F, B and W seconds per stage, each task timed alone (serial steps of
    ZB-H1, whose W's are split off, without recompute), the whole backward's (serial steps of 1F1B),
    and the time of a message between stages as the run measured it (none between threads, which
    pass references)."""
    from lab.runs.experiments import run
    from lab.schedules.writer import message_seconds
    split, whole = (run(config.but(schedule=name, virtual_stages=1, checkpoint="never"), replay="always")
                    for name in ("zb-h1", "1f1b"))
    return measured_costs(split.solo_events, message_seconds(split.messages), whole.solo_events)


@dataclass(frozen=True)
class Predicted:
    """A schedule's predictions on the measured costs and bytes: time, peak per stage, under the cap
    (`name`: the built-in schedule's, or "searched")."""

    name: str
    label: str
    makespan: float
    peaks: tuple[int, ...]
    fits: bool


def find(config: RunConfig, cap: Optional[int] = None, exact_limit: int = 50_000) -> tuple[Found, list[Predicted]]:
    """Search a schedule for the configuration (its K and M, its model's costs and bytes measured
    here, `cap` bytes per stage), and predict GPipe, 1F1B, ZB-H1 and ZB-V without recompute on the
    same costs and their own bytes (those the model can run: ZB-V needs 2K layers), the found one first."""
    from lab.runs.experiments import config_chunk_bytes
    plain = config.but(checkpoint="never", virtual_stages=1)
    layouts = {1: config_chunk_bytes(plain)}   # chunks per stage -> its chunks' bytes, measured once each
    costs, micro = costs_for(plain), micro_batch_count(config)
    found = search(config.stages, micro, costs, *layouts[1], cap, exact_limit)
    rows = [Predicted("searched", "searched", found.makespan, found.peaks, True)]
    for name in COMPARED:
        kind = SCHEDULES[name]
        if config.stages * kind.fewest_chunks > config.layers:
            continue
        schedule = Schedule(kind(config.stages, micro, "never", kind.fewest_chunks))
        if kind.fewest_chunks not in layouts:
            layouts[kind.fewest_chunks] = config_chunk_bytes(plain.but(schedule=name,
                                                                      virtual_stages=kind.fewest_chunks))
        held = tuple(peaks(schedule, *layouts[kind.fewest_chunks]))
        rows.append(Predicted(name, kind.label, makespan(schedule, costs), held, cap is None or max(held) <= cap))
    return found, rows


# two unequal stages: the embedding with a block, then a block with the head that scores every character
UNEQUAL = RunConfig(model="transformer", blocks=2, width=64, batch=32, stages=2, micro_batches=8, checkpoint="never",
                    transport="threads")


def race(config: RunConfig = UNEQUAL, rounds: int = 7, cap: Optional[int] = None) -> list[tuple[str, str, str]]:
    """The found schedule beside GPipe, 1F1B, ZB-H1 and ZB-V: predicted on this host's measured
    costs, then measured in the same rounds (one step of each in turn), as rows of lab.bench's table:
    (what, measured median and range beside the prediction, the ratio to 1F1B round by round)."""
    from statistics import median

    from lab.schedules.writer import run_beside_gpipe
    found, predicted = find(config, cap)
    runs = run_beside_gpipe(config.but(checkpoint="never"), found.schedule, rounds,
                            also=tuple(p.name for p in predicted[1:]), called="searched")
    steps = {r.label: r.steps for r in runs}
    one_f_one_b = steps[SCHEDULES["1f1b"].label]
    setting = (f"{config.model} ({config.blocks} blocks, width {config.width}), K={config.stages}, "
               f"M={config.micro_batches}" + (f", cap {cap} B" if cap else ""))
    rows = [(f"search on {setting}: how", found.how, "a schedule found, not written")]
    for p, run in zip(predicted, runs):
        ratio = median(a / b for a, b in zip(run.steps, one_f_one_b))
        rows.append((f"search on {setting}: {run.label}",
                     f"predicted {p.makespan * 1e3:.2f} ms; measured {median(run.steps) * 1e3:.2f} ms "
                     f"({min(run.steps) * 1e3:.2f} to {max(run.steps) * 1e3:.2f}); gradients within "
                     f"{run.difference:.0e} of {run.reference}",
                     f"{ratio:.2f}x 1F1B's step (median of the rounds' ratios)" +
                     ("; target: at most 1.0x, and below ZB-H1's" if run.label == "searched" else "")))
    return rows
