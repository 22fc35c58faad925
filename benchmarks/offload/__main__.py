"""``python -m benchmarks.offload``: see ``benchmarks.offload.cli``."""

from benchmarks.offload.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
