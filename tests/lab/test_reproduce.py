"""python -m lab.reproduce in --quick mode: the files it writes and their labels (not timings)."""
import csv
import time

import pytest

from engine.device import cpu_cores
from lab import reproduce
from lab.config import SCHEDULE_ORDER
from lab.machine.process_tree import running


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_speedup_quick_writes_labelled_tables(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GPIPE_LAB_DEVICES", "2")  # a 2-core host, whatever this one has
    code = reproduce.main(["speedup", "--quick", "--stages", "1", "2", "4", "--micro-batches", "1", "4",
                           "--out", str(tmp_path)])
    assert code == 0
    rows = read_csv(tmp_path / "speedup.csv")
    # K=1 first, then K by K, so that one start of a K's stage processes serves all its cells
    assert [(r["K"], r["M"]) for r in rows] == [("1", "1"), ("1", "4"), ("2", "1"), ("2", "4"), ("4", "1"), ("4", "4")]
    assert {r["how"] for r in rows if r["K"] in ("1", "2")} == {"measured (threads)"}   # 2 devices: one per stage
    assert {r["how"] for r in rows if r["K"] == "4"} == {"ideal replay"}
    assert all(float(r["speedup vs K=1, same M"]) > 0 for r in rows)
    assert [r["speedup vs K=1, same M"] for r in rows if r["K"] == "1"] == ["1.0", "1.0"]
    four = next(r for r in rows if (r["K"], r["M"]) == ("4", "4"))
    assert four["paper Transformer (vs K=2,M=1)"] == "3.2" and four["paper AmoebaNet (vs K=2,M=1)"] == "1.26"
    assert next(r for r in rows if (r["K"], r["M"]) == ("2", "1"))["vs K=2,M=1"] == "1.0"
    assert float(four["vs K=2,M=1"]) > 0   # a replayed cell: normalized to the replayed K=2, M=1
    markdown = (tmp_path / "speedup.md").read_text()
    assert "# command: python -m lab.reproduce" in markdown and "# host:" in markdown and "| K | M |" in markdown
    assert "checkpoint always" in markdown   # one recompute setting for the whole table, said
    assert "<html>" in (tmp_path / "speedup.html").read_text()[:1000].lower()
    out = capsys.readouterr().out
    assert out.rstrip().endswith(markdown.rstrip().splitlines()[-1])  # the markdown table is printed last
    assert "| 32 | 1.8 | 3.4 | 6.3 |" in out  # the paper's numbers beside it


def test_speedup_with_processes_and_the_transports_comparison(tmp_path):
    """The table with stage processes, every task under bf16 autocast (as a GPU host may ask), then
    threads against processes."""
    assert reproduce.main(["speedup", "--quick", "--transport", "processes", "--stages", "1", "2", "--micro-batches",
                           "4", "--precision", "bf16", "--out", str(tmp_path)]) == 0
    assert "precision bf16" in (tmp_path / "speedup.md").read_text()
    rows = read_csv(tmp_path / "speedup.csv")
    two = "measured (processes)" if cpu_cores() >= 2 else "ideal replay"   # a 1-core host cannot run 2 stages at once
    assert [r["how"] for r in rows] == ["measured (threads)", two]  # K=1 has no transport
    assert reproduce.main(["transports", "--quick", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "transports.csv")
    assert [r["stages run as"] for r in rows] == ["threads", "processes"]
    assert float(rows[0]["communication share"]) == 0 < float(rows[1]["communication share"])
    assert reproduce.main(["transports", "--quick", "--stages-as", "processes", "--out", str(tmp_path)]) == 0
    assert [r["stages run as"] for r in read_csv(tmp_path / "transports.csv")] == ["processes"]


def test_schedules_quick_table_has_every_schedule_with_its_theory(tmp_path):
    assert reproduce.main(["schedules", "--quick", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "schedules.csv")
    assert [(r["schedule"], r["M"]) for r in rows] == [(s, m) for m in ("4", "8")
                                                       for s in SCHEDULE_ORDER]
    assert {r["how"] for r in rows} <= {"measured (threads)", "ideal replay"}
    theory = {(r["schedule"], r["M"]): float(r["bubble, theory"]) for r in rows}
    assert theory[("gpipe", "8")] == theory[("1f1b", "8")] == round(3 / 11, 3)
    assert theory[("interleaved", "8")] == round(3 / 19, 3) and theory[("zb-h1", "8")] == round(3 / 27, 3)
    held = {(r["schedule"], r["M"]): float(r["micro-batches held, theory (max stage)"]) for r in rows}
    assert held[("gpipe", "8")] == 8 and held[("1f1b", "8")] == held[("zb-h1", "8")] == 4


def test_memory_quick_finds_growing_models(tmp_path):
    assert reproduce.main(["memory", "--quick", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "memory.csv")
    assert [r["training"] for r in rows] == [label for label, _, _ in reproduce.fit.LADDER]
    params = [int(r["parameters"]) for r in rows]
    assert params == sorted(params) and params[1] > params[0] and params[-1] > 4 * params[1]
    budget = 3 * 2 ** 20
    assert all(int(r["peak bytes"]) <= budget for r in rows)
    assert "CPU: the budget is applied to each stage's measured" in (tmp_path / "memory.md").read_text()
    one_stage = [r for r in rows if r["K"] == "1"]   # naive and with recompute: the allocator's peak beside the count
    assert len(one_stage) == 2 and all(0.9 <= float(r["count over allocator"]) <= 1.1 for r in one_stage), one_stage
    assert all(r["count over allocator"] == "" for r in rows if r["K"] != "1")


def test_memory_on_gpus_grows_each_measure_against_its_own_naive_row(monkeypatch):
    """With 2 GPUs the allocator's capped peak judges K <= 2 and the engine's count judges every K;
    a row's growth never divides one measure by the other (faked GPUs and searches)."""
    monkeypatch.setattr(reproduce.torch.cuda, "device_count", lambda: 2)

    def largest(base, stages, checkpoint, budget, max_blocks, label="", counted=False, progress=None):
        params = (100 if counted else 80) * stages * (2 if checkpoint == "always" else 1)
        return reproduce.fit.Largest(label, stages, checkpoint, 4, 6, params, budget, ())
    monkeypatch.setattr(reproduce.fit, "largest", largest)
    args = reproduce.parser().parse_args(["memory", "--quick", "--device", "cuda"])
    rows = list(reproduce.memory_rows(args, lambda label: None))
    assert [(r["measured by"], r["K"], r["growth vs naive"]) for r in rows] == [
        (reproduce.ALLOCATOR, 1, 1.0), (reproduce.ALLOCATOR, 1, 2.0), (reproduce.ALLOCATOR, 2, 4.0),
        (reproduce.COUNT, 1, 1.0), (reproduce.COUNT, 1, 2.0), (reproduce.COUNT, 2, 4.0), (reproduce.COUNT, 4, 8.0),
        (reproduce.COUNT, 8, 16.0)]


def test_peers_quick_races_every_implementation(tmp_path):
    assert reproduce.main(["peers", "--quick", "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "peers.csv")
    names = {r["implementation"] for r in rows}
    assert {"one core, no pipeline", "gpipe-lab engine, threads", "gpipe-lab engine, processes",
            "torch.distributed.pipelining ScheduleGPipe"} <= names
    assert all(float(r["max grad diff"]) < 1e-5 for r in rows)
    assert {r["M"] for r in rows} == {"1", "4"}


def test_a_failing_pipelining_worker_is_reported_promptly_and_nothing_is_left_running():
    from lab.engine_time import peers
    processes = peers.PipeliningProcesses(peers.Workload(width=16, blocks=2, batch=8), tuned_malloc=False,
                                          timeout_s=60)
    pids = processes.ranks.pids
    try:
        assert len(processes.ask("step", 2)) == 2  # both ranks answer a real step
        start = time.monotonic()
        with pytest.raises(ValueError, match="unknown command 'jump'; expected 'step', 'grads', 'ping' or 'ends'"):
            processes.ask("jump", 2)
        assert time.monotonic() - start < 5
    finally:
        processes.close()
    assert not [pid for pid in pids if running(pid)]


def test_the_peers_table_pairs_each_round_with_its_baseline():
    from lab.engine_time.peers import BASELINE, Result, table_rows
    results = [Result(BASELINE, 4, (1.0, 2.0, 4.0), 0.0), Result("fast", 4, (0.5, 1.0, 4.0), 0.0)]
    rows = {r["implementation"]: r for r in table_rows(results, batch=8)}
    assert rows["fast"]["speedup vs one core"] == 2.0   # per-round ratios 2, 2, 1: median 2
    assert rows["fast"]["samples/s"] == 8.0              # median step 1 s
    assert rows["fast"]["of ideal"] == round(2.0 / (2 * 4 / 5), 2)


@pytest.mark.parametrize("argv,words", [
    (["speedup", "--device", "cuda"], "no CUDA GPU"),
    (["speedup", "--model", "gpt-5"], "--model 'gpt-5'"),
    (["speedup", "--stages", "1", "16"], "--stages 16"),
    (["memory", "--budget", "0"], "--budget 0"),
    (["transports", "--stages", "9", "--blocks", "2"], "K=9 stages but the transformer has only 4 layers"),
    (["transports", "--rounds", "0"], "--rounds 0"),
    (["schedules", "--virtual", "1"], "--virtual 1"),
])
def test_bad_arguments_get_one_line_and_exit_code_2(argv, words, capsys):
    if "cuda" in argv:
        pytest.importorskip("torch")
        import torch
        if torch.cuda.is_available():
            pytest.skip("this host has CUDA")
    assert reproduce.main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1


def test_a_bad_round_count_in_the_environment_gets_one_line_and_exit_code_2(monkeypatch, capsys):
    monkeypatch.setenv("GPIPE_LAB_ROUNDS", "none")
    assert reproduce.main(["transports", "--quick"]) == 2
    assert "GPIPE_LAB_ROUNDS='none'" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["bogus"], ["speedup", "--transport", "pigeons"]])
def test_unknown_choices_are_one_line_too(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        reproduce.main(argv)
    assert exit_info.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.parametrize("stop", [KeyboardInterrupt(), RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")])
def test_ctrl_c_or_an_error_keeps_finished_rows(tmp_path, monkeypatch, capsys, stop):
    """A third cell that is interrupted, or fails (a GPU out of memory): the two before it are written."""
    real = reproduce.speedup.measure_table

    def stopped(*args, **kwargs):
        for count, cell in enumerate(real(*args, **kwargs)):
            if count == 2:
                raise stop
            yield cell

    monkeypatch.setattr(reproduce.speedup, "measure_table", stopped)
    argv = ["speedup", "--quick", "--stages", "1", "2", "--micro-batches", "1", "4", "--out", str(tmp_path)]
    if isinstance(stop, KeyboardInterrupt):
        assert reproduce.main(argv) == 130
        assert "# interrupted" in (tmp_path / "speedup.md").read_text()
    else:
        with pytest.raises(RuntimeError, match="out of memory"):
            reproduce.main(argv)
        assert "# stopped by an error (RuntimeError: CUDA out of memory" in (tmp_path / "speedup.md").read_text()
    assert len(read_csv(tmp_path / "speedup.csv")) == 2


def test_ctrl_c_while_sizing_for_the_gpu_is_said_in_one_line(monkeypatch, capsys):
    """On a GPU, `check` sizes the model for minutes before any row: a Ctrl-C there (the doctor's
    report sends one to a part out of time) ends with a line saying nothing was measured yet."""
    def sizing(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(reproduce, "check", sizing)
    assert reproduce.main(["speedup", "--quick"]) == 130
    assert "before any row was measured" in capsys.readouterr().err


def test_the_markdown_table_has_every_column_any_row_has():
    """The K=1 cells come first and have no "threads beside" figure: the column is still there."""
    table = reproduce.markdown([{"K": 1, "M": 4}, {"K": 2, "M": 4, "threads beside": "1.2x"}])
    assert table.splitlines() == ["| K | M | threads beside |", "|---|---|---|", "| 1 | 4 |  |", "| 2 | 4 | 1.2x |"]
