"""The collectives DeepSpeed's communication backend bound when it started, for a caller that wraps them.

``deepspeed.comm``'s torch backend (``deepspeed.comm.comm.cdb``, a ``TorchBackend``) keeps
``torch.distributed.all_gather_into_tensor`` and ``reduce_scatter_tensor`` as attributes taken at its
initialisation (``all_gather_function``, ``reduce_scatter_function``) and calls those: wrapping the
``torch.distributed`` functions afterwards does not reach ZeRO's all-gather of the parameters. The other
collectives it calls by attribute at call time. DeepSpeed 0.19.8.
"""

from __future__ import annotations

from typing import List, Tuple


def bound_collectives() -> List[Tuple[object, str, str]]:
    """``(holder, attribute, torch.distributed name)`` of each collective DeepSpeed's backend holds bound; empty
    when DeepSpeed's communication is not initialised (or holds none of them)."""
    try:
        from deepspeed.comm import comm as ds_comm
    except ImportError:  # pragma: no cover - DeepSpeed is a dependency
        return []
    cdb = getattr(ds_comm, "cdb", None)
    out = []
    for attr, name in (
        ("all_gather_function", "all_gather_into_tensor"),
        ("reduce_scatter_function", "reduce_scatter_tensor"),
    ):
        if cdb is not None and callable(getattr(cdb, attr, None)):
            out.append((cdb, attr, name))
    return out
