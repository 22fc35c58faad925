"""acco_ds's benchmarks, one subpackage per benchmark, each run as ``python -m benchmarks.<name>``
from the repository root (``--help`` lists its options):

- ``kernels``: the fused AdamW commit / peek and gradient accumulation kernels (CPU or GPU);
- ``e2e``: ACCO against DeepSpeed ZeRO on a bandwidth-limited link, over seeds, both framings;
- ``topology``: two "nodes" (network namespaces), tensor parallelism inside, ACCO across;
- ``memory``: peak memory per rank against ZeRO-1 / ZeRO-2, with the analytic bytes per parameter;
- ``gpu_overlap``: does ACCO's side stream overlap the compute on one GPU;
- ``soak``: thousands of adaptive steps with changing rank speeds (accounting, flat memory);
- ``plan_validation``: acco-plan's predictions against the committed results of the others.

``harness`` holds what several benchmarks share (the throttled link and the two-node network,
the runs and their records, sweeps over seeds, statistics, analysis, tables, plots, timing);
``ranks`` the scripts the DeepSpeed launcher starts once per rank (run as modules,
``--module benchmarks.ranks.<name>``). Results: ``benchmarks/results/<benchmark>/``.
"""
