"""``python -m benchmarks.memory``: see ``benchmarks.memory.cli``."""

from benchmarks.memory.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
