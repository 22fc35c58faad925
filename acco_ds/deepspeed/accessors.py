"""DeepSpeed's public accessors (``deepspeed.utils.safe_get_full_fp32_param`` and friends) on ACCO.

For ZeRO-1 those call ``param.get_full_hp_param(optim_state_key)``, a bound method DeepSpeed's
``link_hp_params`` attaches, when the parameter has ``_hp_mapping``. ACCO attaches its own bound
methods with the same names: each waits for the round in flight (so the committed state is
final), copies this rank's fragment of the fp32 master (or of ``exp_avg`` / ``exp_avg_sq``) into
a zero buffer of the parameter's size and all-reduces it over the data-parallel group. Like
DeepSpeed's, they are collectives: every rank must call them.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Fragment:
    """This rank's part of one parameter: ``param_range`` in the flattened parameter,
    ``shard_range`` in the rank's shard of the group."""

    group_index: int
    param_start: int
    shard_start: int
    numel: int


def _state_tensor(buffers, key):
    if key is None:
        return buffers.master
    if key == "exp_avg":
        return buffers.exp_avg
    if key == "exp_avg_sq":
        return buffers.exp_avg_sq
    raise ValueError(
        f"optim_state_key={key!r}: ACCO keeps 'exp_avg' and 'exp_avg_sq' (or None for the fp32 weight)"
    )


def _drain(optimizer) -> None:
    """Make the committed state final before a collective read. In adaptive accumulation a rank may
    have launched one round more than a peer; waiting for that job while the peer blocks in the
    all-reduce below would deadlock, so the ranks first agree on the round count (snapshot.drain)."""
    from acco_ds.core.snapshot import drain

    drain(optimizer.pipeline)


def _get_full_hp_param(param, optimizer, optim_state_key=None):
    _drain(optimizer)
    full = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
    frag = param._hp_mapping
    if frag.numel:
        src = _state_tensor(optimizer.pipeline.groups[frag.group_index], optim_state_key)
        full[frag.param_start : frag.param_start + frag.numel].copy_(
            src[frag.shard_start : frag.shard_start + frag.numel]
        )
    dist.all_reduce(full, group=param._dp_group)
    return full.view(param.shape)


def _set_full_hp_param(param, optimizer, value, optim_state_key=None):
    optimizer.pipeline.sync_in_flight()  # local: no collective follows, a peer behind is not waited on
    frag = param._hp_mapping
    if frag.numel:
        dst = _state_tensor(optimizer.pipeline.groups[frag.group_index], optim_state_key)
        flat = value.detach().reshape(-1).to(device=dst.device, dtype=torch.float32)
        dst[frag.shard_start : frag.shard_start + frag.numel].copy_(
            flat[frag.param_start : frag.param_start + frag.numel]
        )


def _get_full_hp_grad(param, optimizer):
    raise NotImplementedError(
        "safe_get_full_grad is not available with ACCO: gradients live in ACCO's communication buffers, "
        "summed over a round, not in per-parameter .grad. Read engine.get_global_grad_norm() instead."
    )


def link_accessors(optimizer) -> None:
    """Attach ``_hp_mapping`` and the accessor methods to every trainable parameter."""
    pipeline = optimizer.pipeline
    for gi, b in enumerate(pipeline.groups):
        shard = b.layout.shard_range(b.rank)
        for p, off, numel in zip(b.params, b.layout.offsets, b.layout.numels):
            lo, hi = max(off, shard.start), min(off + numel, shard.stop)
            if hi > lo:
                frag = Fragment(gi, lo - off, lo - shard.start, hi - lo)
            else:
                frag = Fragment(gi, 0, 0, 0)
            p._hp_mapping = frag
            p._dp_group = optimizer.dp_process_group
            p.get_full_hp_param = types.MethodType(
                lambda self, optim_state_key=None: _get_full_hp_param(self, optimizer, optim_state_key), p
            )
            p.set_full_hp_param = types.MethodType(
                lambda self, value, optim_state_key=None: _set_full_hp_param(
                    self, optimizer, value, optim_state_key
                ),
                p,
            )
            p.get_full_hp_grad = types.MethodType(lambda self: _get_full_hp_grad(self, optimizer), p)
