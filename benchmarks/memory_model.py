"""bench_memory's analytic bytes per parameter, re-exported from ``acco_ds/plan/memory_model.py``.

The formulas live in the package, their one home, because ``acco-plan`` (installed with acco_ds)
predicts memory per GPU with them; bench_memory, its table and its plot use them through this
module exactly as before. Edit them there (contract and derivations in that module's docstring).
"""

from acco_ds.plan.memory_model import (  # noqa: F401
    ACCO_MODES,
    ADAM_SHARD,
    CONTENDERS,
    DTYPE_SIZE,
    FP32,
    Buffer,
    acco_held_bytes,
    buffers,
    estimate_rank_bytes,
    goal_bound,
    held,
    peak,
)
