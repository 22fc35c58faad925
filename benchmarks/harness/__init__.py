"""What the benchmarks share: ``link`` (a tc-throttled loopback in a private network namespace),
``nodes`` (two namespaces joined by a rate-limited veth pair), ``runs`` (one contender's launched
run, the compute-only bound, the comm-only probe, and their records), ``sweep`` (seed rounds,
retries, failures), ``seeds`` (statistics and verdicts over seeds), ``analysis`` and ``goals``
(throughput and seed-paired loss rows, both framings), ``tables`` and ``plots`` (Markdown and
figures), ``timing`` (barrier-to-barrier timing of collectives), ``records`` (where results go,
writing and re-reading them)."""
