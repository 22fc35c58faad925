"""``python -m benchmarks.faults``: see ``benchmarks.faults.cli``."""

from benchmarks.faults.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
