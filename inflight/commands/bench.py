"""``inflight bench ...``: the benchmarks; ``bench.cli`` owns their arguments."""

from __future__ import annotations

NAME = "bench"
HELP = "benchmarks: inflight bench --help"
# bench parses its own arguments (--help included) and pulls in plotting and workloads, so it is imported
# only when this command runs.
PASSTHROUGH = True


def run(argv: list[str]) -> int:
    from bench.cli import main as bench_main

    return int(bench_main(argv) or 0)
