"""The torch optimizer ACCO exposes as ``engine.optimizer.optimizer``: a real ``torch.optim.AdamW`` over the fp32
master shards that is never stepped. It holds ``param_groups`` (where DeepSpeed's, HF's and torch's LR
schedulers write lr, betas and weight decay, and where ACCO reads them at each round) and the ``state`` dict
DeepSpeed's ZeRO-1 exposes.

Contract: ``ParamGroupHolder(groups)`` is ``torch.optim.AdamW(groups)`` with the same groups, defaults and
state, built without importing ``torch._dynamo``. torch wraps ``Optimizer.add_param_group`` (called by
``Optimizer.__init__`` for every group) in ``torch._disable_dynamo``, whose first call imports the compiler:
about 2 s of CPU at every rank's start for a compiler nothing here runs (the holder is never stepped or
compiled). The holder calls the function under that wrapper (``__wrapped__``, kept by ``functools.wraps``)
where torch exposes it, else the wrapped one: the same groups either way.
"""

from __future__ import annotations

import torch


class ParamGroupHolder(torch.optim.AdamW):
    """``torch.optim.AdamW`` holding ACCO's param groups (see the module docstring); never stepped."""

    def add_param_group(self, param_group: dict) -> None:
        plain = getattr(torch.optim.Optimizer.add_param_group, "__wrapped__", None)
        if plain is None:
            super().add_param_group(param_group)
        else:
            plain(self, param_group)
