"""Schedules a person writes: text and torch.distributed.pipelining's actions in and out, checks
that name the first problem (a deadlock as its cycle of waits), the unit-cost report, ZB-V, and
written schedules run exactly on threads and on stage processes."""
import collections
import time
from dataclasses import replace
from itertools import accumulate

import pytest
import torch
import torch_schedules
from small_models import grads, mlp
from torch import nn

from engine import GPipe
from engine.schedule import SCHEDULES, Schedule, Task, check, interleaved, loop, one_f_one_b, v_shape, zb_h1, zb_v
from lab.runs.exactness import unpipelined_gradients
from lab.schedules.search import Costs, search
from lab.schedules.writer import format, parse

LOSS = nn.CrossEntropyLoss()
MODES = ("never", "except_last", "always")


def named(name, stages, micro, checkpoint):
    return Schedule(SCHEDULES[name](stages, micro, checkpoint, SCHEDULES[name].fewest_chunks))


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_named_schedule_round_trips_through_text_and_torchs_actions(name):
    for stages in (1, 2, 3, 4):
        for micro in (1, 2, 4, 8):
            if name == "interleaved" and micro % stages:
                continue
            for checkpoint in MODES:
                schedule = named(name, stages, micro, checkpoint)
                back = parse(format(schedule))
                assert back == schedule and back.placement == schedule.placement, format(schedule)
                check(back, micro, checkpoint)
            schedule = named(name, stages, micro, "never")
            back = parse(format(schedule, torch=True))
            assert back == schedule and back.placement == schedule.placement, format(schedule, torch=True)


def test_the_text_format_by_example():
    written = parse("""# 1F1B, K=2, M=3
                       stage 0: F0 F1 B0 F2 B1 B2
                       F0 B0 F1 B1 F2 B2   # the label is optional""")
    assert written == one_f_one_b(2, 3, "never") and written.placement == (0, 1)
    assert format(written) == "stage 0: F0 F1 B0 F2 B1 B2\nstage 1: F0 B0 F1 B1 F2 B2"
    v = zb_v(2, 1, "never")
    assert format(v) == "placement: V\nstage 0: F0@0 F0@3 B0@3 W0@3 B0@0 W0@0\nstage 1: F0@1 F0@2 B0@2 B0@1 W0@2 W0@1"
    assert format(v, torch=True) == "0F0,3F0,3I0,3W0,0I0,0W0\n1F0,2F0,2I0,2I0,2W0,1W0".replace("2I0,2I0", "2I0,1I0")
    assert parse("placement: 0 1 1 0\n" + format(v).split("\n", 1)[1]).placement == v_shape(2, 4)
    assert format(interleaved(2, 2, "never")).startswith("placement: loop\nstage 0: F0@0 F1@0 F0@2")


def test_torchs_actions_read_with_the_placement_where_each_chunk_runs():
    written = parse("0F0,,0F1,1F0,1I0,1W0\n")  # empty cells are idle steps
    assert written.placement == (0, 0) and written[0] == [Task("F", 0, 0), Task("F", 1, 0), Task("F", 0, 1),
                                                          Task("B", 0, 1), Task("W", 0, 1)]
    with pytest.raises(ValueError, match="has no recompute action, so export a schedule made with checkpoint='never'"):
        format(one_f_one_b(2, 2, "always"), torch=True)


def test_torch_reads_the_actions_written_for_it():
    """Each exported action, read back by torch.distributed.pipelining itself, is the same task."""
    from torch.distributed.pipelining.schedules import _Action
    ops = {"F": "F", "I": "B", "B": "B", "W": "W"}  # torch's I is a B with W split off
    for plan in (zb_v(3, 4, "never"), named("interleaved", 2, 4, "never"), one_f_one_b(3, 4, "never")):
        for stage, row in zip(plan, format(plan, torch=True).splitlines()):
            read = [_Action.from_str(cell) for cell in row.split(",")]
            assert [Task(ops[a.computation_type.value], a.microbatch_index, a.stage_index) for a in read] == stage


def test_torchs_own_zb_v_order_reads_checks_and_is_matched_within_half_a_unit():
    """torch.distributed.pipelining's ZB-V (its order for each rank, M >= 2K-1 as it requires) is legal
    here, and the lab's greedy ZB-V takes at most half a unit longer, holding no more."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble
    for stages in (1, 2, 3, 4):
        for micro in range(2 * stages - 1, 2 * stages + 6):
            setting = SimpleNamespace(pp_group_size=stages, _n_microbatches=micro, num_stages=2 * stages)
            rows = [",".join(str(action) for action in ScheduleZBVZeroBubble._calculate_single_rank_operations(
                setting, rank) if action is not None) for rank in range(stages)]
            theirs, ours = check(parse("\n".join(rows)), micro, "never"), check(zb_v(stages, micro, "never"), micro,
                                                                               "never")
            assert ours.makespan <= theirs.makespan + 0.5 and ours.held <= theirs.held, (stages, micro, theirs, ours)


BAD = [  # (text, M, checkpoint, the message)
    ("F0 B0\nF0 B0 B0", 1, "never", "stage 1 runs B0 twice"),
    ("F0 B0\nF0", 1, "never", "stage 1 never runs B0"),
    ("B0 F0\nF0 B0", 1, "never", "stage 0 runs B0 before F0"),
    ("F0 R0 B0\nF0 B0", 1, "never", "stage 0 runs R0, a recompute of micro-batch 0, which kept its activations under "
                                    "checkpoint='never'"),
    ("F0 B0 F1 R1 B1\nF0 B0 F1 R1 B1", 2, "except_last", "stage 0 runs R1, a recompute of micro-batch 1, which kept"),
    ("F0 B0\nF0 B0", 1, "always", "stage 0 never runs R0: checkpoint='always' keeps only its input, so its backward "
                                  "needs the recompute first"),
    ("F0 B0 R0\nF0 R0 B0", 1, "always", "stage 0 runs B0 before R0"),
    ("F0 B0 W0\nF0 B0", 1, "never", "stage 1 never runs W0: once W is split off, every B leaves its weight gradient"),
    ("F0 W0 B0\nF0 B0 W0", 1, "never", "stage 0 runs W0 before B0"),
    ("F0 F1 B0 B1\nF0 B0", 1, "never", "stage 0 runs F1: expected F, R, B or W, and a micro-batch 0..0$"),
    ("placement: 0 0\nF0@0 B0@0\nF0@1 B0@1", 1, "never", r"the placement \(0, 0\) puts no chunk on stage 1"),
    ("placement: 0 1 2\nF0@0 B0@0\nF0@1 B0@1", 1, "never", r"the placement \(0, 1, 2\) puts a chunk on stage 2, but "
                                                            r"there are stages 0..1"),
    ("placement: 0 1 1 0\nF0@0 B0@0 F0@1\nF0@2 B0@2", 1, "never", r"stage 0 runs F0@1, but the placement \(0, 1, 1, "
                                                                  r"0\) does not put chunk 1 on stage 0"),
    ("stage 0: F0 B0 F1 B1\nstage 1: F0 F1 B1 B0", 2, "never",
     "the schedule deadlocks: stage 0 waits for B0 from stage 1, which waits for F1 from stage 0"),
    ("F0 F1 B0 B1\nF0 B0 F1 B1\nF0 F1 B0 B1", 2, "never",  # stage 0 waits too, but outside the cycle
     "the schedule deadlocks: stage 1 waits for B0 from stage 2, which waits for F1 from stage 1$"),
    ("placement: V\nF0@0 F0@3 B0@3 B0@0\nF0@2 F0@1 B0@2 B0@1", 1, "never",
     "the schedule deadlocks: stage 1 waits for F0@1 from itself"),
]


@pytest.mark.parametrize("text,micro,checkpoint,message", BAD)
def test_every_check_names_the_first_problem(text, micro, checkpoint, message):
    with pytest.raises(ValueError, match=message):
        check(parse(text), micro, checkpoint)


@pytest.mark.parametrize("text,message", [
    ("stage 1: F0 B0", "'stage 1': expected 'stage 0:' \\(stages in order\\) or 'placement:'"),
    ("F0 X1", "'X1' is not a task: expected F, R, B or W"),
    ("placement: zigzag\nF0 B0", "placement: zigzag: expected 'loop', 'V' or one stage number per chunk"),
    ("placement: V\nF0 B0\nF0 B0 F0@2",
     r"F0 on stage 0 names no chunk, but the stage holds chunks \[0, 3\]: write F0@0"),
    ("# nothing", "no stages: expected one line of tasks per stage"),
])
def test_text_that_is_not_a_schedule_is_refused_with_what_was_expected(text, message):
    with pytest.raises(ValueError, match=message):
        parse(text)


def test_the_unit_cost_report():
    report = check(one_f_one_b(4, 8, "never"), 8, "never")  # F=1, B=2: 3(M+K-1) units, bubble (K-1)/(M+K-1)
    assert report.makespan == 33 and report.bubble == pytest.approx(3 / 11) and report.held == 4
    assert check(zb_h1(4, 8, "never"), 8, "never") == (27, pytest.approx(3 / 27), 4)  # (K-1)/(3M+K-1)
    assert check(interleaved(4, 8, "never", 2), 8, "never").makespan == 28.5  # the fill passes half-chunks
    gpipe = check(named("gpipe", 4, 8, "never"), 8, "never")
    assert gpipe.makespan == 33 and gpipe.held == 8


def test_zb_v_is_legal_v_placed_within_1f1bs_memory_and_beats_zb_h1():
    for stages in range(1, 7):
        for micro in range(1, 13):
            for checkpoint in MODES:
                schedule = zb_v(stages, micro, checkpoint)
                assert schedule.placement == v_shape(stages, 2 * stages)
                assert check(schedule, micro, checkpoint).held <= stages
            ours, h1 = check(zb_v(stages, micro, "never"), micro, "never"), check(zb_h1(stages, micro, "never"), micro,
                                                                                   "never")
            assert ours.bubble <= h1.bubble + 1e-12, (stages, micro)
    assert v_shape(4, 8) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert check(zb_v(4, 8, "never"), 8, "never") == (25.5, pytest.approx(1.5 / 25.5), 4)


def float64_step(stages, schedule, checkpoint="never", chunks=4, **options):
    torch.manual_seed(1)
    x, y = torch.randn(24, 16, dtype=torch.float64), torch.randint(0, 3, (24,))
    model = mlp(dtype=torch.float64)
    pipe = GPipe(model, stages, chunks=chunks, threads_per_stage=1, schedule=schedule, checkpoint=checkpoint, **options)
    loss = pipe.step(x, y, LOSS)
    pipe.close()
    return grads(model), loss, pipe.trace


def reference():
    torch.manual_seed(1)
    x, y = torch.randn(24, 16, dtype=torch.float64), torch.randint(0, 3, (24,))
    return unpipelined_gradients(mlp(dtype=torch.float64), x, y, LOSS)


def test_zb_v_and_written_schedules_give_the_unpipelined_gradients_bitwise_across_k():
    whole = reference()
    for checkpoint in ("never", "always"):
        runs = {}
        for stages in (1, 2, 3, 4):
            zbv, _, trace = float64_step(stages, "zb-v", checkpoint, virtual_stages=2)
            assert {(e.stage, e.chunk) for e in trace.events} \
                == {(s, c) for c, s in enumerate(v_shape(stages, 2 * stages))}
            written = parse(format(one_f_one_b(stages, 4, checkpoint)))
            runs[stages] = zbv, float64_step(stages, written, checkpoint)[0]
        for got in runs.values():
            for ours, first in zip(got, runs[1]):
                assert all(torch.equal(a, b) for a, b in zip(ours, first))
            assert max((a - b).abs().max().item() for a, b in zip(got[0], whole)) < 1e-10


def some_recomputed(stages, micro):
    """1F1B with only stage 0's even micro-batches recomputed: a plan no single mode makes."""
    plan = one_f_one_b(stages, micro, "never")
    plan[0] = [t for task in plan[0] for t in ([Task("R", task.micro, 0)] if task.op == "B" and task.micro % 2 == 0
                                               else []) + [task]]
    return Schedule(plan)


def test_recompute_per_stage_and_as_written_gives_the_unpipelined_gradients_bitwise():
    """Recompute chosen per stage for every built-in schedule, and per micro-batch by a written
    schedule's R's ("as_written"): the gradients are those without recompute, bit for bit, and
    within 1e-10 of one device; the trace shows R exactly where it was asked for."""
    whole = reference()
    for name, kind in SCHEDULES.items():
        plain = float64_step(2, name, "never", virtual_stages=kind.fewest_chunks)[0]
        got, _, trace = float64_step(2, name, ("always", "never"), virtual_stages=kind.fewest_chunks)
        assert all(torch.equal(a, b) for a, b in zip(got, plain)), name
        assert max((a - b).abs().max().item() for a, b in zip(got, whole)) < 1e-10, name
        assert {e.stage for e in trace.events if e.op == "R"} == {0}, name
    got, _, trace = float64_step(2, some_recomputed(2, 4), "as_written")
    assert sorted((e.stage, e.micro) for e in trace.events if e.op == "R") == [(0, 0), (0, 2)]
    assert max((a - b).abs().max().item() for a, b in zip(got, whole)) < 1e-10
    with pytest.raises(ValueError, match="'as_written' recomputes what a written schedule's R tasks say, but "
                                         "schedule='1f1b' is built by rule"):
        GPipe(mlp(), 2, chunks=4, schedule="1f1b", checkpoint="as_written")
    with pytest.raises(ValueError, match=r"checkpoint=\('always', 'never', 'never'\) names 3 modes for 2 stages"):
        GPipe(mlp(), 2, chunks=4, checkpoint=["always", "never", "never"])


def test_torchs_whole_backward_beside_split_ones_is_a_b_and_its_w():
    """torch.distributed.pipelining's B is a whole backward; mixed with I and W (split ones) it is
    the lab's B followed by its W, so every micro-batch's weights get their gradient."""
    mixed = parse("0F0,0F1,0B0,0I1,0W1\n1F0,1F1,1B0,1I1,1W1")
    assert [[str(t) for t in tasks] for tasks in mixed] == [["F0", "F1", "B0", "W0", "B1", "W1"]] * 2
    assert check(mixed, 2, "never").held == 2
    got = float64_step(2, mixed, "never", chunks=2)[0]
    assert max((a - b).abs().max().item() for a, b in zip(got, reference())) < 1e-10
    assert [[str(t) for t in tasks] for tasks in parse("0F0,0B0\n1F0,1B0")] == [["F0", "B0"]] * 2


def test_torchs_communication_and_overlapped_actions_read_as_the_compute_they_carry():
    """A compute-and-comms row as torch writes it (DualPipeV's overlapped pairs, SEND/RECV/UNSHARD
    actions): the engine does its own sends, and runs an overlapped pair one task after the other."""
    written = zb_v(2, 4, "never")
    rows = format(written, torch=True).splitlines()
    noisy = [rows[0].replace("0F1,", "0UNSHARD,0F1,0SEND_F1,").replace("3F0,3I0,", "(3F0;3I0)OVERLAP_F_B,"),
             rows[1].replace("2F0,", "1RECV_F0,2F0,1SEND_B0,2RESHARD,")]
    assert noisy != rows and "OVERLAP_F_B" in noisy[0]
    assert parse("\n".join(noisy)) == written


@pytest.mark.parametrize("name", sorted(torch_schedules.SHAPES))
def test_schedules_torch_writes_import_check_and_run_exactly(name):
    """torch.distributed.pipelining's own schedules (made by its classes), in both of its CSV forms,
    read as they are: they pass the check, and run with the unpipelined gradients within 1e-10
    (float64), on 2 and 3 stages of two chunks each."""
    whole = reference()
    for stages, micro in ((2, 4), (3, 6)):
        for form in ("compute_only", "compute_comms"):
            written = parse(torch_schedules.exported(name, stages, micro, form))
            assert written.placement == (loop(stages, 2 * stages) if torch_schedules.SHAPES[name] == "loop"
                                         else v_shape(stages, 2 * stages)), (stages, form)
            check(written, micro, "never")
            got = float64_step(stages, written, "never", chunks=micro)[0]
            assert max((a - b).abs().max().item() for a, b in zip(got, whole)) < 1e-10, (stages, form)


def test_a_deadlock_torch_refuses_without_saying_where_is_named_by_the_check():
    """What notebook 12 says of torch.distributed.pipelining: it refuses the deadlock when it adds
    its sends and receives, naming no stage; the check names the cycle."""
    deadlock = parse("stage 0: F0 B0 F1 B1\nstage 1: F0 F1 B1 B0")
    with pytest.raises(AssertionError, match="Malformed compute schedule, can't schedule sends/recvs"):
        torch_schedules.lowered(format(deadlock, torch=True))
    with pytest.raises(ValueError, match="stage 0 waits for B0 from stage 1, which waits for F1 from stage 0"):
        check(deadlock, 2, "never")


def test_stages_labelled_in_another_order_are_read_in_stage_order():
    text = format(one_f_one_b(3, 4, "never"))
    upside_down = "\n".join(reversed(text.splitlines()))
    assert parse(upside_down) == parse(text)


def test_a_chunk_named_on_two_stages_without_a_placement_is_told_so():
    with pytest.raises(ValueError, match="chunk 1 is named on stage 0 and on stage 1: a chunk of layers lives on one"):
        parse("stage 0: F0@0 F0@1 B0@1 B0@0\nstage 1: F0@1 B0@1")


def test_a_pipe_refuses_a_written_schedule_that_cannot_run():
    deadlock = parse("stage 0: F0 B0 F1 B1\nstage 1: F0 F1 B1 B0")
    with pytest.raises(ValueError, match="stage 0 waits for B0 from stage 1, which waits for F1 from stage 0"):
        GPipe(mlp(), 2, chunks=2, checkpoint="never", schedule=deadlock)
    with pytest.raises(ValueError, match="the schedule has 2 stages but balance makes 3"):
        GPipe(mlp(), 3, chunks=2, checkpoint="never", schedule=parse(format(one_f_one_b(2, 2, "never"))))
    with pytest.raises(ValueError, match="stage 0 never runs F2: written for M=2, not 3"):
        GPipe(mlp(), 2, chunks=3, checkpoint="never", schedule=parse(format(one_f_one_b(2, 2, "never"))))
    with pytest.raises(ValueError, match=r"gives the stages \[1, 2\] chunks: every stage holds the same number"):
        GPipe(mlp(), 2, chunks=1, schedule=Schedule([[Task("F", 0, 0)], [Task("F", 0, 1)]], (0, 1, 1)))
    three_and_one = parse("placement: 0 0 0 1\nstage 0: F0@0 F0@1 F0@2 B0@2 B0@1 B0@0\nstage 1: F0@3 B0@3")
    with pytest.raises(ValueError, match=r"gives the stages \[3, 1\] chunks"):   # divisible, still unequal
        GPipe(mlp(), 2, chunks=1, checkpoint="never", schedule=three_and_one)
    pipe = GPipe(mlp(), 2, chunks=4, checkpoint="never", schedule=parse(format(one_f_one_b(2, 4, "never"))))
    with pytest.raises(ValueError, match="written for M=4 micro-batches, but this mini-batch makes 3"):
        pipe.step(torch.randn(3, 16), torch.randint(0, 3, (3,)), LOSS)


@pytest.mark.timeout(240)
def test_written_schedules_on_stage_processes_equal_threads_bitwise():
    from lab.processes.pool import ProcessPool
    torch.manual_seed(1)
    x, y = torch.randn(24, 16, dtype=torch.float64), torch.randint(0, 3, (24,))
    for stages in (2, 3):
        pool = ProcessPool(stages)
        try:
            torchs = [(parse(torch_schedules.exported(name, stages, 4, "compute_comms")), "never")
                      for name in sorted(torch_schedules.SHAPES)
                      if name != "ScheduleDualPipeV" or stages == 2]  # DualPipeV: M >= 2K
            for schedule, checkpoint in [("zb-v", "always"), (parse(format(zb_h1(stages, 4, "never"))), "never"),
                                         ("1f1b", ("always",) + ("never",) * (stages - 1)),
                                         (some_recomputed(stages, 4), "as_written"),
                                         (search(stages, 4, Costs((1.0,) * (stages - 1) + (3.0,), (1.0,) * stages,
                                                                  (1.0,) * stages)).schedule, "never"), *torchs]:
                options = dict(balance=stages, chunks=4, schedule=schedule, checkpoint=checkpoint,
                               **({"virtual_stages": 2} if schedule == "zb-v" else {}))
                pool.build("small_models:mlp", dict(dtype=torch.float64), **options)
                loss = pool.step(x, y, nn.functional.cross_entropy)
                model = mlp(dtype=torch.float64)
                pipe = GPipe(model, threads_per_stage=1, **options)
                assert torch.equal(loss, pipe.step(x, y, LOSS)), (stages, schedule)
                assert all(torch.equal(a, b) for a, b in zip(pool.gradients(), grads(model))), (stages, schedule)
                assert all(torch.equal(returned, loss) for returned in pool.losses), "every rank returns the loss"
                assert torch.equal(pool.forward(x), pipe(x))
            deadlock = parse("\n".join(["F0 B0 F1 B1"] + ["F0 F1 B1 B0"] * (stages - 1)))
            start = time.monotonic()
            with pytest.raises(ValueError, match="the schedule deadlocks: stage 0 waits for B0 from stage 1"):
                pool.build("small_models:mlp", {}, balance=stages, chunks=2, checkpoint="never", schedule=deadlock)
            assert time.monotonic() - start < 5, "every rank refuses it before it runs"
        finally:
            pool.close()


def rank_dependent(texts):
    """Rank r's schedule, texts[r], read where it is unpickled: in each stage process."""
    import torch.distributed as dist
    return parse(texts[dist.get_rank()])


class PerRank(Schedule):
    """A schedule that reaches each stage process as that rank's own text: ranks whose pipes follow
    different orders, each legal alone (what the static check cannot see)."""

    def __init__(self, texts):
        super().__init__(parse(texts[0]))
        self.texts = texts

    def __reduce__(self):
        return rank_dependent, (self.texts,)


@pytest.mark.timeout(120)
def test_a_deadlock_at_run_time_is_reported_on_every_rank_with_the_waits_within_5_s():
    from engine import StageFailed
    from lab.processes.pool import ProcessPool
    torch.manual_seed(1)
    x, y = torch.randn(8, 16), torch.randint(0, 3, (8,))
    pool = ProcessPool(2)
    try:  # rank 0 follows the first order, rank 1 the second: stage 0 waits for B0, stage 1 for F1
        orders = ["stage 0: F0 B0 F1 B1\nstage 1: F0 B0 F1 B1", "stage 0: F0 F1 B0 B1\nstage 1: F0 F1 B1 B0"]
        pool.build("small_models:mlp", {}, balance=2, chunks=2, checkpoint="never", schedule=PerRank(orders))
        start = time.monotonic()
        with pytest.raises(StageFailed, match="deadlock: stage 0 waits for B0 from stage 1; stage 1 waits for F1 "
                                              "from stage 0"):
            pool.step(x, y, nn.functional.cross_entropy)  # an answer from every rank, or it would time out
        assert time.monotonic() - start < 30  # a liveness bound: ten times the stall (2 s) plus its reports
        pool.build("small_models:mlp", {}, balance=2, chunks=2, checkpoint="never")
        assert pool.step(x, y, nn.functional.cross_entropy).item() > 0, "the pool works on"
    finally:
        pool.close()


def test_ranks_that_all_wait_are_no_deadlock_while_a_message_is_still_on_its_way():
    """The run-time rule on two ranks sharing one Store: rank 0 sent rank 1 a message that rank 1 has
    not read yet (a large payload on a slow link), and both wait: no deadlock. Once rank 1 has read
    it, or it landed and waits for its turn (turns.py), and rank 1 still waits, the waits are a
    deadlock, reported with both."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from engine.distributed.transport import ProcessTransport, Ranks

    def rank(number, store, reports, held):
        transport = ProcessTransport.__new__(ProcessTransport)
        transport.ranks, transport.store, transport.step = Ranks(number, 2), store, 0
        transport.placement, transport._traffic = [0, 1], collections.Counter()
        transport.report_failure, transport.lane = reports.append, SimpleNamespace(held=lambda step: held)
        return transport

    for how in ("read", "waits for its turn"):
        store, reports, held = dist.HashStore(), [], {}
        first, second = rank(0, store, reports, {}), rank(1, store, reports, held)
        first._traffic[(0, "sent", 1)] = 1                         # an activation on its way to rank 1
        posted = first._stuck((0, "grad", 0, 0), None)             # rank 0 waits for B0's gradient
        second_posted = second._stuck((0, "act", 1, 1), None)      # rank 1 waits for F1: F0's still arriving
        assert reports == [] and first._stuck((0, "grad", 0, 0), posted) == posted
        if how == "read":                                          # read; rank 1 still waits for F1
            second._traffic[(0, "received", 0)] = 1
        else:
            held[0] = 1
        second._stuck((0, "act", 1, 1), second_posted)
        assert reports == ["deadlock: stage 0 waits for B0 from stage 1; stage 1 waits for F1 from stage 0"], how


def test_a_schedule_is_checked_on_its_models_own_costs_and_message_time():
    """check() with each stage's measured task times and a message's time between stages, as the
    writer's replay uses them: 1F1B, K=2, M=1, stage 1 three times slower forward, 0.5 per message."""
    from lab.schedules import writer as schedule_writer
    plan = one_f_one_b(2, 1, "never")
    costs = {(0, "F"): 1.0, (0, "B"): 2.0, (1, "F"): 3.0, (1, "B"): 2.0}
    own = lambda stage, task: costs[(stage, task.op)]
    assert check(plan, 1, "never").makespan == 6.0                                # unit costs: F 1, B 2
    assert check(plan, 1, "never", own).makespan == 1 + 3 + 2 + 2                 # F0, F0, B0, B0 in turn
    assert check(plan, 1, "never", own, latency=0.5).makespan == 1 + 0.5 + 3 + 2 + 0.5 + 2   # two hops
    events = [{"stage": k, "op": op, "start": 0.0, "end": costs[(k, op)]} for k, op in costs]
    messages = [{"direction": "send", "start": 0.0, "end": 0.2}, {"direction": "receive", "start": 1.0, "end": 1.3},
                {"direction": "send", "start": 2.0, "end": 2.2}]
    assert schedule_writer.message_seconds(messages) == pytest.approx(0.5) and schedule_writer.message_seconds([]) == 0
    replay = schedule_writer.replayed(Schedule(plan), events, 1, schedule_writer.message_seconds(messages))
    assert replay.makespan == pytest.approx(9.0)


def test_torchs_own_malformed_1f1b_order_is_said_to_be_torchs_with_its_line():
    """torch 2.13's Schedule1F1B numbers its last rank's forwards 1 to M: the verdict names the line
    and task that break it, says the text came malformed from torch, and how to get a correct one."""
    from lab.schedules import writer as schedule_writer
    text = "0F0,0F1,0B0,0F2,0B1,0F3,0B2,0B3,0REDUCE_GRAD\n1F1,1B0,1F2,1B1,1F3,1B2,1F4,1B3,1REDUCE_GRAD"
    line = schedule_writer.examine(text, 4, "never").line
    assert line.startswith("✗ stage 1 runs F4: expected F, R, B or W, and a micro-batch 0..3 (line 2). This is "
                           "torch.distributed.pipelining's own order, malformed as torch writes it"), line
    renumbered = "\n".join([text.splitlines()[0], "1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3,1REDUCE_GRAD"])
    assert schedule_writer.examine(renumbered, 4, "never").legal
    assert "torch" not in schedule_writer.examine("F1 B0\nF0 B0", 1, "never").line  # the lab's own text


def test_the_writers_verdicts_predictions_and_guards():
    from lab.schedules import writer as schedule_writer
    text = schedule_writer.preset("zb-v", 2, 2, "never")
    assert text == format(zb_v(2, 2, "never"))
    verdict = schedule_writer.examine(text, 2, "never")
    assert verdict.legal and verdict.line == ("✓ legal: makespan 6.5 units, bubble 8%, "
                                              "at most 2 micro-batches held on a stage")
    assert schedule_writer.examine(format(zb_v(2, 2, "never"), torch=True), 2, "never").line == verdict.line
    assert schedule_writer.examine("F0 B0\nF0", 1, "never").line == "✗ stage 1 never runs B0 (line 2)"
    assert schedule_writer.examine("# two stages\nstage 1: F0\nstage 0: F0 B0", 1, "never").line.endswith("(line 2)")
    theory = schedule_writer.unit_cost(verdict.schedule)
    assert theory.makespan == 6.5 and theory.bubble == pytest.approx(verdict.report.bubble)
    events = [{"stage": k, "op": op, "start": 0.0, "end": seconds} for k in (0, 1)
              for op, seconds in (("F", 1.0), ("B", 2.0), ("B", 2.0))]
    assert schedule_writer.replayed(verdict.schedule, events, 1).makespan == theory.makespan  # F=1, B=2 split in half
    with pytest.raises(ValueError, match="interleaved"):
        schedule_writer.preset("interleaved", 2, 3, "never")
    for huge in ("F0@99999999999 B0", "99999999999F0,0B0"):  # refused before the engine lays out that many chunks
        assert schedule_writer.examine(huge, 1, "never").line == "✗ chunk 99999999999 is named, but 2 tasks cannot " \
                                                                 "cover so many chunks"
    assert schedule_writer.examine("F0 " * 40_000, 1, "never").line.startswith("✗ 120000 characters")
    reference = schedule_writer.Ran("GPipe", theory, [], 0.0, "GPipe's gradients")  # a model with dropout
    written_ = replace(reference, label="written", difference=2e-8)
    assert [schedule_writer.gradients_cell(r) for r in (written_, reference)] == ["2.0e-08", "the reference"]
    assert schedule_writer.gradients_caption([written_, reference]) == (
        "Largest gradient difference: each schedule's, from GPipe's gradients; the model has dropout, whose masks "
        "only a pipeline draws alike.")


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_built_in_schedule_is_laid_out_and_offered_by_the_lab(name):
    """Each entry of the one registry reaches every place that names schedules: the unit-cost
    diagram (W tasks costed where the schedule splits its backward), lab.train's choices, the
    schedule writer's presets; the lab races the ones marked `compared`."""
    from lab import train
    from lab.config import SCHEDULE_ORDER
    from lab.schedules import writer as schedule_writer
    from lab.timelines import replay
    kind = SCHEDULES[name]
    line = replay.unit_cost(4, 8, "never", schedule=name, virtual=kind.fewest_chunks)
    assert ("W" in {e.op for e in line.bars}) == kind.splits_backward and 0 < line.bubble < 1
    assert train.parser().parse_args(["--schedule", name]).schedule == name
    assert name in schedule_writer.PRESETS and (name in SCHEDULE_ORDER) == kind.compared


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedules_formulas_agree_with_its_own_task_lists(name):
    """A registry entry's unit-cost bubble and micro-batches held per stage (the lab's predictions)
    are what its task lists give: laid out at unit costs, and counted (a forward takes one in, its
    backward, or its W where the backward is split, lets it go; a chunk is 1/v of its stage)."""
    from lab import theory
    from lab.timelines import replay
    kind = SCHEDULES[name]
    for stages, micro in ((1, 1), (2, 4), (3, 6), (4, 8), (4, 16)):
        v = kind.fewest_chunks
        plan = Schedule(kind(stages, micro, "never", v))
        last = "W" if kind.splits_backward else "B"
        counted = [max(accumulate((t.op == "F") - (t.op == last) for t in tasks)) / v for tasks in plan]
        assert [theory.peak_in_flight(name, stages, micro, k, v) for k in range(stages)] == counted
        laid_out = replay.unit_cost(stages, micro, "never", schedule=name, virtual=v).bubble
        assert theory.schedule_bubble(name, stages, micro, v) == pytest.approx(laid_out, abs=1e-12)
