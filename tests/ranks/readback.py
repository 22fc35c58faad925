"""The committed fp32 weights and Adam moments of every parameter, read back on every rank as the rank scripts
compare them.

For an ACCO engine, :func:`full_state` reads them with ``acco_ds.deepspeed.accessors.full_hp_params``: one
all-reduce per step and key, where DeepSpeed's public per-parameter accessors (``safe_get_full_fp32_param`` /
``safe_get_full_optimizer_state``, which on ACCO call the same function for one parameter) make one per parameter.
The bits are the same (each element is summed with zeros only); on 2 cores the per-parameter collectives were
about half a rank's time in the trajectory launches. Any other engine (DeepSpeed's own ZeRO-1, the baselines)
goes through the public accessors, parameter by parameter. :func:`check_public_accessors` compares the two ways
on an ACCO engine, so the public path stays under test wherever a rank script reads the batched way."""

from __future__ import annotations

import torch
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

from acco_ds.deepspeed.accessors import full_hp_params
from tests.ranks import toy

KEYS = (None, "exp_avg", "exp_avg_sq")


def _is_acco(engine) -> bool:
    return hasattr(engine.optimizer, "pipeline")


def full_states(engine, params, key=None) -> list:
    """Each parameter's whole fp32 weight (``key=None``) or moment (``'exp_avg'`` / ``'exp_avg_sq'``), a tensor of
    its shape, on every rank. A collective."""
    params = list(params)
    if _is_acco(engine):
        return full_hp_params(params, engine.optimizer, key)
    return _public_states(params, key)


def _public_states(params, key) -> list:
    """DeepSpeed's public accessors, one collective per parameter."""
    if key is None:
        return [safe_get_full_fp32_param(p) for p in params]
    return [safe_get_full_optimizer_state(p, key) for p in params]


def full_state(engine, params, key=None) -> torch.Tensor:
    """:func:`full_states`, flat fp32 on the CPU, in parameter order."""
    return toy.flat(full_states(engine, params, key)).cpu()


def check_public_accessors(engine, params) -> None:
    """On an ACCO engine, raise AssertionError unless DeepSpeed's public accessors give the bits of
    :func:`full_state` for the weights and both moments. A collective; nothing on other engines."""
    if not _is_acco(engine):
        return
    for key in KEYS:
        public = toy.flat(_public_states(params, key)).cpu()
        if not torch.equal(full_state(engine, params, key), public):
            raise AssertionError(f"the public accessors differ from the batched read-back for key={key!r}")


def full_dict(engine, named, key=None) -> dict:
    """:func:`full_states` of ``named`` (``(name, parameter)`` pairs) as ``{name: tensor}``, each a copy."""
    named = list(named)
    return {
        n: t.detach().clone() for (n, _), t in zip(named, full_states(engine, [p for _, p in named], key))
    }
