"""``python -m benchmarks.e2e``: see ``benchmarks.e2e.cli``."""

from benchmarks.e2e.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
