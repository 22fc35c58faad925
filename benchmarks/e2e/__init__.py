"""The end-to-end benchmark: ACCO against DeepSpeed ZeRO on a tc-throttled link, heterogeneous
workers, several seeds, both framings of the comm-bound claim (``python -m benchmarks.e2e``;
``cli`` runs the sweep, ``goals``, ``table`` and ``plots`` report it)."""
