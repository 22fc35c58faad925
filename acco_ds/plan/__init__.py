"""``acco-plan``: predict, before a trial run, whether ACCO pays off on a cluster (docs/PLAN.md).

Modules: ``units`` (option values with units), ``comm`` (alpha-beta collectives, hierarchical across
nodes), ``memory_model`` (bytes per parameter of every contender, shared with bench_memory),
``primitives`` (bytes per element and per AdamW step, an adaptive round's length, the gain worth a switch),
``model`` (step time, samples/s, memory without offload: ``predict``), ``recommend`` (mode, accumulation, GAS and
why), ``offload`` and ``recommend_offload`` (``--offload``: the optimizer in host memory, and whether to),
``quality`` (the quality study's samples-to-loss factor: the speed-up in time to ZeRO-1's final loss),
``planner`` (the two composed, with the factor: ``predict`` and ``recommend`` for any inputs), ``hfconfig`` (parameter count of a
transformers config), ``cli`` (the console script).
"""
