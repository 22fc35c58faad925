"""``python -m benchmarks.soak``: see ``benchmarks.soak.cli``."""

from benchmarks.soak.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
