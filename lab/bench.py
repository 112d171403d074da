"""Benchmark of the engine on this host: prints one table of measured throughputs and ratios.

    python -m lab.bench            # full size: 8 x Linear(1024,1024)+ReLU, batch 2048, and the
                                   # small model (8 x Linear(256)+ReLU, batch 64) threads vs processes
    python -m lab.bench --quick    # small sizes, for a smoke run
    python -m lab.bench --small    # only the small model's rows
    python -m lab.bench --overhead # only the engine's own time on a near-empty model (lab/engine_time/overhead.py)
    python -m lab.bench --search   # only a found schedule beside GPipe, 1F1B, ZB-H1, ZB-V (lab/schedules/search.py)
    python -m lab.bench --host-time  # only the host's share of a task, engine beside plain PyTorch
                                     # (lab/engine_time/host_time.py)

Every configuration is timed once per round, round after round, so that a noisy host slows all
of them alike. Rates are medians over the rounds; a ratio is the median of the per-round ratios.
"""
from __future__ import annotations

import argparse
import platform

import torch

from engine.device import cpu_cores
from lab.engine_time import host_time, overhead
from lab.engine_time.throughput import SMALL, overhead_rows, run, small_rows
from lab.machine.host import keep_freed_cpu_memory
from lab.processes.pool import ProcessPool
from lab.schedules import search as schedule_search


def format_table(rows: list[tuple[str, str, str]]) -> str:
    """A markdown table of the rows."""
    lines = ["| measurement | result | target / note |", "|---|---|---|"]
    lines += [f"| {what} | {value} | {target} |" for what, value, target in rows]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model and batch: a smoke run, not a measurement")
    parser.add_argument("--small", action="store_true", help="only the small model's rows (a minute or two)")
    parser.add_argument("--overhead", action="store_true",
                        help="only the engine's own time per call, task and message, beside torch's (about a minute)")
    parser.add_argument("--search", action="store_true",
                        help="only a schedule found for a Transformer with unequal stages, beside the built-in "
                             "ones, predicted and measured (about 30 s)")
    parser.add_argument("--host-time", action="store_true",
                        help="only Python calls, ATen operators and microseconds per task of a Transformer stage, "
                             "beside plain PyTorch's (about 20 s)")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per configuration (medians are shown)")
    parser.add_argument("--checkpoint", default="except_last", choices=["always", "except_last", "never"])
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc malloc as it is (by default freed memory is kept for reuse, "
                             "see lab.machine.host.keep_freed_cpu_memory)")
    args = parser.parse_args(argv)
    tuned = not args.default_malloc and keep_freed_cpu_memory()
    width, layers, batch = (64, 4, 128) if args.quick else (1024, 8, 2048)
    small = dict(width=32, layers=4, batch=16, chunks=4, repeats=100) if args.quick else SMALL
    rounds = 1 if args.quick else args.rounds
    widths = (16,) if args.quick else (16, 64)
    if args.host_time:  # this process and a stage process of its own: none of the pools below
        print(f"# the host's share of a task: {rounds} round(s); counts are the same on every host")
        print(format_table(host_time.rows(widths, rounds)))
        return
    if args.search:  # threads of this process: none of the pools below
        print(f"# a found schedule beside the built-in ones: {rounds} round(s), one step of each in turn")
        print(format_table(schedule_search.race(rounds=rounds)))
        return
    print(f"# engine benchmark, the near-empty model only: {rounds} round(s)" if args.overhead else
          f"# engine benchmark, the small model only: {rounds} round(s) (x3 for its short steps)" if args.small else
          f"# engine benchmark: {layers} x (Linear({width},{width}) + ReLU), batch {batch}, "
          f"checkpoint={args.checkpoint}, {rounds} round(s), median samples/s")
    print(f"# host: {platform.processor() or platform.machine()}, {cpu_cores()} cores; torch {torch.__version__}; "
          f"malloc {'keeps freed memory (all rows)' if tuned else 'glibc defaults'}")
    with ProcessPool(2, threads_per_stage=1, keep_freed_memory=tuned) as pool, \
            ProcessPool(2, threads_per_stage=1, keep_freed_memory=tuned, spin=0.0) as sleepy_pool, \
            ProcessPool(2, threads_per_stage=1, keep_freed_memory=tuned, lane="gloo") as gloo_pool, \
            ProcessPool(1, threads_per_stage=1, keep_freed_memory=tuned) as first_half, \
            ProcessPool(1, threads_per_stage=1, keep_freed_memory=tuned) as second_half:
        lanes, halves = {"shared memory": pool, "shared memory, waits asleep": sleepy_pool, "gloo": gloo_pool}, \
            (first_half, second_half)
        count, micros = (200, (1, 4, 16)) if args.quick else (2000, overhead.MICROS)
        if args.overhead:
            print(format_table(overhead_rows(pool, tuned, rounds, count, micros)))
        elif args.small:
            print(format_table(small_rows(small, rounds, lanes, halves)))
        else:
            table = run(width, layers, batch, rounds, args.checkpoint, small, lanes, halves)
            table += overhead_rows(pool, tuned, rounds, count, micros) + host_time.rows(widths, rounds)
            print(format_table(table))


if __name__ == "__main__":
    main()
