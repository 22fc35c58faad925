"""``python -m benchmarks.fidelity``: see ``benchmarks.fidelity.cli``."""

from benchmarks.fidelity.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
