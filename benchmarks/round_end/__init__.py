"""The training thread's work at a round end: device operations and host time (``python -m benchmarks.round_end``)."""
