"""The benchmark runs end to end and prints its table (timings themselves are not tested); its
accounting of a step in processes is checked on a trace made by hand."""
import re
import time

import pytest
import torch
from torch import nn

from engine.device import cpu_cores
from engine.trace import Event, Message, Trace
from lab import bench
from lab.engine_time import messages, peers
from lab.engine_time.call_ends import Ends, median_ends


def test_quick_benchmark_prints_every_row(capsys):
    bench.main(["--quick"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    near_empty = [row for row in rows if "near-empty" in row]
    host = [row for row in rows if "host time per task" in row]
    rows = [row for row in rows if row not in near_empty + host]
    assert len(rows) == 27
    assert len(host) == 6 and sum("threads:" in row for row in host) == sum("processes:" in row for row in host) == 3
    own = [row for row in near_empty if "engine's own time" in row]
    assert {row.split(",")[1].split(":")[0].strip() for row in own} \
        >= {"gpipe-lab engine", "torch.distributed.pipelining ScheduleGPipe"}
    assert len(own) == 3 + peers.torchgpipe_available() and all(" us per call (" in row for row in own)
    assert all(" before the first layer, " in row and " after its last gradient)" in row for row in own)
    assert sum("a message " in row for row in own) == 2     # processes and torch's ranks; threads pass references
    assert [row.split("|")[1].strip() for row in near_empty[len(own):]] == [
        "near-empty K=2, M=1: a call's own time",
        "near-empty K=2, M=1: our step vs torch.distributed.pipelining's",
        "near-empty K=2, M=16: our step vs torch.distributed.pipelining's",
        "near-empty K=2, processes, M=1: the call outside its two stages' tasks"]
    assert any("two halves at once" in row for row in rows)
    assert any("speedup K=2 over K=1 at M=32" in row for row in rows)
    assert any("ceiling: both halves" in row for row in rows)
    assert any("if messages and the call's ends were free" in row for row in rows)
    assert any("bare matrix products" in row for row in rows)
    assert any("K=2 processes over K=1 at M=32" in row for row in rows)
    assert any("small model" in row and "K=2 processes over K=1" in row for row in rows)
    timed = [row for row in rows if "small model: step at" in row or "time per message" in row or "ping-pong" in row]
    [starts] = [row for row in rows if "starting a ProcessPool(2)" in row]
    assert "forked " in starts and ", fresh " in starts
    accounts = [row for row in rows if any(what in row for what in ("with nothing to wait for", "outside its flow",
                                                                      "reading a message", "out of shared memory"))]
    assert len(accounts) == 4 and "with a send " in accounts[0] and "after the last task " in accounts[1]
    assert "right after a task" in accounts[2]
    assert ("written by the other process" if cpu_cores() >= 2 else "needs 2 cores") in accounts[3]  # a 1-core host
    assert len(timed) == 4 and " ms, " in timed[0] and all("sending " in row and "a task " in row for row in timed[1:3])
    assert "shared memory: " in timed[3] and "waits asleep: " in timed[3] and "gloo: " in timed[3]
    for row in rows:
        if row in timed or row in accounts or row == starts:
            continue
        value = row.split("|")[2].strip().strip("*")
        first = value.split()[0]
        assert first.endswith("x") or value.endswith("samples/s")
        assert float(first.rstrip("x")) > 0
        if first.endswith("x"):
            assert "(rounds " in value, "a ratio shows its range over the rounds"


def hand_made_trace() -> Trace:
    """Two stages, two micro-batches, times in seconds: stage 0's B1 waits for its gradient (sent at
    52 ms, after stage 0's F1 ended at 25 ms); stage 0's gap from F0 to F1 holds a 2 ms send, stage
    1's from F0 to F1 a 1 ms read, its gap from F1 to B1 neither."""
    events = [Event(0, 0, "F", 0.000, 0.010, "cpu"), Event(0, 1, "F", 0.015, 0.025, "cpu"),
              Event(1, 0, "F", 0.014, 0.028, "cpu"), Event(1, 1, "F", 0.030, 0.040, "cpu"),
              Event(1, 1, "B", 0.041, 0.050, "cpu"), Event(0, 1, "B", 0.055, 0.060, "cpu")]
    messages = [Message(0, 1, "send", "act", 0, 8, 0.010, 0.012), Message(1, 0, "receive", "act", 0, 8, 0.013, 0.014),
                Message(0, 1, "send", "act", 1, 8, 0.025, 0.027), Message(1, 0, "receive", "act", 1, 8, 0.028, 0.029),
                Message(1, 0, "send", "grad", 1, 8, 0.050, 0.052), Message(0, 1, "receive", "grad", 1, 8, 0.053, 0.054)]
    return Trace(stages=2, micro_batches=2, events=events, messages=messages, wall=0.065)


def test_unwaited_gaps_leave_out_the_waits_and_count_the_messages_inside():
    gaps = messages.unwaited_gaps(hand_made_trace())
    assert gaps == [pytest.approx((0.005, 0.002, 0.0)), pytest.approx((0.002, 0.0, 0.001)),
                    pytest.approx((0.001, 0.0, 0.0))]  # stage 0's F1 -> B1 is left out: it waited
    assert messages.gap_parts([hand_made_trace()]) == ("with a send 5000 us (the message 2000), n=1; "
                                                    "with a read 2000 us (the message 1000), n=1; "
                                                    "with neither 1000 us, n=1")


def test_call_parts_account_for_busy_time_the_last_stage_start_and_the_ends():
    said = messages.call_parts([hand_made_trace()], [0.070])
    assert said == ("busy 25000, 33000 us (by stage); the last stage starts at 14000 us; after the last task "
                    "5000 us; planning and the trace 5000 us")


def test_small_prints_only_the_small_model_rows(capsys, monkeypatch):
    """--small measures the small model's rows alone (what they hold: the --quick test above)."""
    measured = []
    monkeypatch.setattr(bench, "small_rows",
                        lambda *args: measured.append(args) or [("small model: a row", "1.0x", "")])
    monkeypatch.setattr(bench, "run", lambda *args: pytest.fail("--small measured the whole table"))
    bench.main(["--quick", "--small"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert rows == ["| small model: a row | 1.0x |  |"] and "the small model only" in out
    small, rounds, lanes, halves = measured[0]
    assert small["width"] == 32 and rounds == 1 \
        and set(lanes) == {"shared memory", "shared memory, waits asleep", "gloo"}


def test_the_engines_own_time_is_the_intercept_and_slope_less_the_layers_work():
    """lab.engine_time.overhead's arithmetic on step times made up to a known line: a call costs 2 ms whatever
    its M, a micro-batch 1 ms, of which plain PyTorch's layers (4 ms per micro-batch on one core,
    the whole model) take 2 ms on each of the two stages; one preempted step does not tilt the line."""
    from lab.engine_time import overhead
    ms = 1e-3
    line = {m: 2 * ms + 3 * ms * m for m in overhead.MICROS}
    assert overhead.fitted({**line, 4: line[4] + 50 * ms}) == pytest.approx((2 * ms, 3 * ms))
    medians = {peers.BASELINE: {m: 4 * ms * m for m in overhead.MICROS}, "ours": line,
               peers.PipeliningProcesses.name: {m: 1 * ms + 4 * ms * m for m in overhead.MICROS}}
    parts = overhead.parts(medians)
    assert parts["ours"] == pytest.approx({"call": 2 * ms, "micro-batch": 3 * ms, "pipeline per micro-batch": 1 * ms})
    ends = dict.fromkeys(["ours", "gpipe-lab engine, processes", peers.PipeliningProcesses.name], (1e-4, 2e-4))
    rows = overhead.rows({**medians, "gpipe-lab engine, processes": line}, {"gpipe-lab engine, processes": 30.0}, ends)
    assert rows[2][1] == ("300 us per call (100 before the first layer, 200 after its last gradient), 1000 us per "
                          "micro-batch (500 per task, messages included); a message 30 us one way")
    assert "(the line's intercept, fill and drain included: 2000 us)" in rows[2][2]
    assert rows[3][1] == (f"ours 1000 us, {peers.PipeliningProcesses.name} 1000 us, "
                          f"gpipe-lab engine, processes 1000 us")  # 5 ms steps at M=1 against plain PyTorch's 4
    assert rows[-2:] == [
        ("near-empty K=2, M=1: our step vs torch.distributed.pipelining's", "processes 1.00x",
         ">= 1.0x: torch's step time over ours"),
        ("near-empty K=2, M=64: our step vs torch.distributed.pipelining's",
         f"processes {(1 + 4 * 64) / (2 + 3 * 64):.2f}x", ">= 1.0x: torch's step time over ours")]


def test_call_ends_are_the_times_before_the_first_layer_and_after_its_last_gradient():
    """lab.engine_time.call_ends on a step that waits 2 ms before its first layer and 3 ms after its backward, over
    two micro-batches: at least those waits (sleeps last at least that long on any host), and the
    first forward and last gradient, not the others, bound them."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)), torch.randn(8, 4)

    def step():
        time.sleep(0.002)
        for half in x.chunk(2):
            model(half).sum().backward()
            time.sleep(0.001)
        time.sleep(0.002)
    ends = Ends(model[0])
    start = time.perf_counter()
    before, after = ends.timed(step)
    whole = time.perf_counter() - start
    assert before >= 0.002 and after >= 0.003 and before + after + 0.001 <= whole  # the second half's wait is inside
    ends.close()
    assert not model[0]._forward_pre_hooks and median_ends(model[0], step, 3) >= (0.002, 0.003)
    with pytest.raises(ValueError, match="ReLU has no trainable parameter"):
        Ends(model[1])
    with pytest.raises(RuntimeError, match="never ran the watched layer"):
        Ends(model[0]).timed(lambda: None)


def test_search_prints_the_found_schedule_beside_the_built_in_ones(capsys):
    """`--search`: how the schedule was found, then one row per schedule with its prediction, its
    measured median and range, its gradients, and its ratio to 1F1B's step round by round."""
    bench.main(["--search", "--rounds", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| search on ")]
    assert [row.split("|")[1].rsplit(": ", 1)[1].strip() for row in rows] == [
        "how", "searched", "GPipe", "1F1B", "zero bubble (ZB-H1)", "zero bubble V (ZB-V)"]
    assert all(re.search(r"predicted [\d.]+ ms; measured [\d.]+ ms \([\d.]+ to [\d.]+\); gradients within", row)
               for row in rows[1:]), rows
    assert "x 1F1B's step" in rows[1] and "every order searched" in rows[0]
