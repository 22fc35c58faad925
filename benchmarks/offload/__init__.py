"""Optimizer offload on one GPU: ACCO + offload against DeepSpeed ZeRO-Offload and ZenFlow (docs/GPU.md, docs/OFFLOAD.md).

``python -m benchmarks.offload``: see ``benchmarks.offload.cli``. Pure parts (no torch): ``plan`` (sizes, the
contenders' DeepSpeed configs, the sizing arithmetic), ``goals`` (the goals judged from the results JSON alone;
stdlib only, so that scripts/gpu/goals.py loads it by path), ``report`` (the Markdown table from the JSON).
"""
