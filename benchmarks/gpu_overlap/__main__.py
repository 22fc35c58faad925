"""``python -m benchmarks.gpu_overlap``: see ``benchmarks.gpu_overlap.cli``."""

from benchmarks.gpu_overlap.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
