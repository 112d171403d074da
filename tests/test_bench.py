"""The benchmark runs end to end and prints its table (timings themselves are not tested)."""
from lab import bench


def test_quick_benchmark_prints_every_row(capsys):
    bench.main(["--quick"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 20
    assert any("speedup K=2 over K=1 at M=32" in row for row in rows)
    assert any("ceiling: both halves" in row for row in rows)
    assert any("bare matrix products" in row for row in rows)
    assert any("K=2 processes over K=1 at M=32" in row for row in rows)
    assert any("small model" in row and "K=2 processes over K=1" in row for row in rows)
    timed = [row for row in rows if "small model: step at" in row or "time per message" in row or "ping-pong" in row]
    assert len(timed) == 4 and " ms, " in timed[0] and all("sending " in row and "a task " in row for row in timed[1:3])
    assert "shared memory: " in timed[3] and "waits asleep: " in timed[3] and "gloo: " in timed[3]
    for row in rows:
        if row in timed:
            continue
        value = row.split("|")[2].strip().strip("*")
        first = value.split()[0]
        assert first.endswith("x") or value.endswith("samples/s")
        assert float(first.rstrip("x")) > 0
        if first.endswith("x"):
            assert "(rounds " in value, "a ratio shows its range over the rounds"
