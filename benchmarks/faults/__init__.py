"""The fault benchmark: a node lost under torchrun's elastic agent (``python -m benchmarks.faults``)."""
