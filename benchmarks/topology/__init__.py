"""The two-node topology benchmark: two network namespaces joined by a rate-limited veth pair,
tensor parallelism inside a node, ACCO's data parallelism across (``python -m benchmarks.topology``;
``cli`` runs the sweep, ``runs`` launches one launcher per node, ``report`` analyses and renders)."""
