"""``python -m benchmarks.topology``: see ``benchmarks.topology.cli``."""

from benchmarks.topology.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
