"""``python -m bench ...`` from the repository root: benchmarks and research instruments (bench/cli.py)."""

from bench.cli import main

if __name__ == "__main__":  # guarded so that walking the package does not run the command
    raise SystemExit(main())
