"""``python -m benchmarks.kernels``: see ``benchmarks.kernels.cli``."""

from benchmarks.kernels.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
