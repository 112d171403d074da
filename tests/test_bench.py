"""The benchmark runs end to end and prints its table (timings themselves are not tested)."""
from engine import bench


def test_quick_benchmark_prints_every_row(capsys):
    bench.main(["--quick"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 9
    assert any("speedup K=2 over K=1 at M=32" in row for row in rows)
    assert any("ceiling" in row for row in rows)
    for row in rows:
        value = row.split("|")[2].strip().strip("*")
        assert value.endswith(("samples/s", "x")) and float(value.split()[0].rstrip("x")) > 0
