"""``python -m benchmarks.plan_validation``: see ``benchmarks.plan_validation.cli``."""

from benchmarks.plan_validation.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
