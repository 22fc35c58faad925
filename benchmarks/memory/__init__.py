"""The memory benchmark: peak memory per rank of acco / dpu / sync against DeepSpeed ZeRO-1 and
ZeRO-2, beside the analytic bytes per parameter of ``acco_ds.plan.memory_model``
(``python -m benchmarks.memory``; ``cli`` runs the cases, ``runs`` launches one, ``table`` and
``plot`` report them; each rank runs ``benchmarks.ranks.memory``)."""
