"""``python -m benchmarks.quality``: see ``benchmarks.quality.cli``."""

from benchmarks.quality.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
