"""``acco-plan``: predict, before a trial run, whether ACCO pays off on a cluster (docs/PLAN.md).

Modules: ``units`` (option values with units), ``comm`` (alpha-beta collectives, hierarchical across
nodes), ``memory_model`` (bytes per parameter of every contender, shared with bench_memory),
``model`` (step time, samples/s, memory: ``predict``), ``recommend`` (mode, accumulation, GAS and
why), ``offload`` and ``recommend_offload`` (``--offload``: the optimizer in host memory, and whether to),
``hfconfig`` (parameter count of a transformers config), ``cli`` (the console script).
"""
