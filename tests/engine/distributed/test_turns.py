"""The one order every rank posts its transfers in: it cannot cross, for every built-in schedule, in
any timing, even where the GPU runs each rank's communication in the order it was posted."""
import json
import os
import random
import subprocess
import sys
import threading

import pytest

from engine.distributed.turns import Transfer, Turns, transfer_order
from engine.schedule import SCHEDULES, Schedule, forward_only, upstream
from lab.machine.torchrun import ROOT

LAYOUTS = [(name, stages, micro, virtual) for name, kind in SCHEDULES.items() for stages in (2, 3, 4)
           for micro in (stages, 2 * stages) for virtual in sorted({kind.fewest_chunks, kind.most_chunks or 3})]


def built(name: str, stages: int, micro: int, virtual: int) -> Schedule:
    schedule = SCHEDULES[name](stages, micro, "except_last", virtual)
    return schedule if isinstance(schedule, Schedule) else Schedule(schedule)


def runs_to_the_end(schedule: Schedule, posting_order, seed: int) -> bool:
    """Play a call in a random interleaving, as NCCL would at worst: a stage runs its next task once
    its input has landed, and then offers its output (its header reaches the receiver at once); a
    rank posts its transfers in `posting_order(rank)`'s order, a send once offered, a receive once
    its header came; each rank's posted transfers run one at a time in posting order (the GPU
    serializing its communicators), and a transfer completes only when it heads both its ranks'
    queues. False if it stops with tasks left: a deadlock."""
    rng = random.Random(seed)
    placement, chunks = schedule.placement, len(schedule.placement)
    order = transfer_order(schedule, placement)
    by_key = {t.key: t for t in order}
    cursor = [0] * len(schedule)
    offered, landed, queues = set(), set(), [[] for _ in schedule]
    to_post = [posting_order(rank, order) for rank in range(len(schedule))]
    while True:
        moves = []
        for rank, tasks in enumerate(schedule):
            if cursor[rank] < len(tasks):
                needed = upstream(tasks[cursor[rank]], chunks)
                key = None if needed is None else ("act" if needed.op == "F" else "grad", needed.micro,
                                                   tasks[cursor[rank]].chunk)
                if key not in by_key or key in landed:
                    moves.append(("run", rank))
            if to_post[rank]:
                transfer = to_post[rank][0]
                if transfer.key in offered:  # a send once its value exists; a receive once its header came
                    moves.append(("post", rank))
        for transfer in {q[0] for q in queues if q}:
            if all(queues[r] and queues[r][0] == transfer for r in (transfer.sender, transfer.receiver)):
                moves.append(("land", transfer))
        if not moves:
            return all(cursor[rank] == len(tasks) for rank, tasks in enumerate(schedule))
        what, who = rng.choice(moves)
        if what == "run":
            task = schedule[who][cursor[who]]
            cursor[who] += 1
            sent = ("act", task.micro, task.chunk + 1) if task.op == "F" else ("grad", task.micro, task.chunk - 1)
            if sent in by_key and by_key[sent].sender == who:
                offered.add(sent)
        elif what == "post":
            queues[who].append(to_post[who].pop(0))
        else:
            landed.add(who.key)
            for rank in (who.sender, who.receiver):
                queues[rank].pop(0)


def in_turns(rank: int, order: list[Transfer]) -> list[Transfer]:
    return [t for t in order if rank in (t.sender, t.receiver)]


@pytest.mark.parametrize("name,stages,micro,virtual", LAYOUTS)
def test_posting_in_the_order_never_deadlocks_in_any_timing(name, stages, micro, virtual):
    schedule = built(name, stages, micro, virtual)
    order = transfer_order(schedule, schedule.placement)
    crossing = sum(t.sender != t.receiver for t in order)
    assert len(order) == len(set(order)) == crossing > 0
    assert all(runs_to_the_end(schedule, in_turns, seed) for seed in range(20))


def test_posting_as_each_rank_meets_its_transfers_can_deadlock():
    """What the order prevents: a rank that posts each receive before the sends of the tasks that
    come after it in its own list (as a stage thread meets them) crosses its neighbour under 1F1B."""
    schedule = built("1f1b", 2, 4, 1)
    order = transfer_order(schedule, schedule.placement)
    by_key = {t.key: t for t in order}

    def as_met(rank, _order):
        met = []
        for task in schedule[rank]:
            needed = upstream(task, len(schedule.placement))
            if needed is not None:
                met.append(by_key[("act" if needed.op == "F" else "grad", needed.micro, task.chunk)])
            sent = ("act", task.micro, task.chunk + 1) if task.op == "F" else ("grad", task.micro, task.chunk - 1)
            if sent in by_key and by_key[sent].sender == rank:
                met.append(by_key[sent])
        return met
    assert not all(runs_to_the_end(schedule, as_met, seed) for seed in range(20))


def test_a_forward_only_call_is_ordered_too():
    schedule = forward_only((0, 1, 2), 4)
    order = transfer_order(schedule, schedule.placement)
    assert [t.key for t in order[:3]] == [("act", 0, 1), ("act", 1, 1), ("act", 0, 2)]
    assert all(runs_to_the_end(schedule, in_turns, seed) for seed in range(5))


def test_turns_post_in_order_whoever_offers_and_put_off_the_next_calls():
    order = [Transfer(("act", 0, 1), 0, 1), Transfer(("grad", 0, 0), 1, 0), Transfer(("act", 1, 1), 0, 1)]
    turns, posted = Turns(rank=0), []
    turns.expect(3, order)
    offer = lambda step, key, way: turns.offer(step, key, way, lambda: posted.append((step, key)))  # noqa: E731
    offer(3, ("act", 1, 1), "send")
    offer(4, ("act", 0, 1), "send")            # the next call's: waits for its expect
    assert posted == []
    threading.Thread(target=offer, args=(3, ("grad", 0, 0), "receive")).start()  # a listener thread
    offer(3, ("act", 0, 1), "send")
    for _ in range(100):
        if len(posted) == 3:
            break
        threading.Event().wait(0.01)
    assert posted == [(3, ("act", 0, 1)), (3, ("grad", 0, 0)), (3, ("act", 1, 1))]
    offer(2, ("act", 5, 1), "send")            # an earlier call's (one that failed): at once
    assert posted[-1] == (2, ("act", 5, 1))
    turns.expect(4, order)
    assert posted[-1] == (4, ("act", 0, 1)) and turns.posted == [(("act", 0, 1), "send")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stages", [3, 4])
def test_stage_processes_post_in_the_order_under_every_schedule(tmp_path, stages):
    """The same turns as on GPUs, over gloo: every rank posts the transfers it takes part in exactly in
    the call's order, and the step's loss is the threads' to the bit; also step after step where a
    slow stage's "end" lands while a gradient before it still waits for its turn."""
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             str(stages), "tests/helpers/distributed_turns.py"], cwd=ROOT, capture_output=True,
                            text=True, timeout=110,
                            env={**os.environ, "GPIPE_LANE": "gloo", "GPIPE_TURNS_OUT": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for path in sorted(tmp_path.glob("rank*.jsonl"))
             for line in path.read_text().splitlines()]
    assert len(lines) == (len(SCHEDULES) + 1) * stages  # and 4 steps of 1F1B with a slow middle stage
    for line in lines:
        assert line["transfers"] > 0 and line["in_order"] and line["equal"], line
