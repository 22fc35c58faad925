"""DeepSpeed's public accessors (``deepspeed.utils.safe_get_full_fp32_param`` and friends) on ACCO.

For ZeRO-1 those call ``param.get_full_hp_param(optim_state_key)``, a bound method DeepSpeed's
``link_hp_params`` attaches, when the parameter has ``_hp_mapping``. ACCO attaches its own bound
methods with the same names: each waits for the round in flight (so the committed state is
final), copies this rank's fragment of the fp32 master (or of ``exp_avg`` / ``exp_avg_sq``) into
a zero buffer of the parameter's size and all-reduces it over the data-parallel group. Like
DeepSpeed's, they are collectives: every rank must call them.

Gradients (``safe_get_full_grad`` / ``safe_set_full_grad``, ``safe_update_full_grad_vectorized``). DeepSpeed
returns ``param.grad`` when it is set and otherwise calls ``param.get_full_hp_grad()`` /
``param.set_full_hp_grad(value)``, which ACCO attaches here. What they mean, by where the training loop is:

- between backwards inside a round (any mode): ``param.grad`` is a view into the round's buffer (same
  parameter and communication dtypes), this rank's own sum of the round's micro-batch gradients so far,
  divided by gradient_accumulation_steps, as ZeRO-1's ``.grad`` before its boundary; a write enters the
  round. With bf16 parameters and fp32 communication ``.grad`` is None and the methods below read and write
  the same sum (fp32, local, no collective).
- ``sync`` between the boundary's ``engine.backward`` and ``engine.step()``: the pipeline defers the step's
  job to ``engine.step()`` (``ACCOPipeline._defer_boundary``) and ``.grad`` is None, as in ZeRO-1. The get is
  ZeRO-1's gradient, the average over the data-parallel ranks of their accumulated gradients (each loss
  divided by gradient_accumulation_steps), fp32, unclipped: the very values the step will use (summed in the
  communication dtype as the job's reduce-scatter sums them; the same bits at up to 2 ranks). A collective,
  as DeepSpeed's. The set makes the step use ``value``'s elements of this rank's shard, as ZeRO-1's set
  writes this rank's partition: every rank must call it for that parameter (DeepSpeed's usage: the same
  full value everywhere), since this rank writes ``value`` (times the job's divisor) into its part of the
  parameter and zeros into the parts other ranks own. A non-finite value makes the step skipped on every
  rank (the engine counts it in ``skipped_steps`` and does not step its LR scheduler), as ZeRO-1's overflow
  check does.
- just after a round ended (acco's peek round, the boundary in acco/dpu, a compressed sync round quantized in
  its last backward, or after ``engine.step()``): ``.grad`` is None and the methods raise
  :class:`GradientNotAvailable` (a ValueError, as ZeRO-1's after its step) naming the mode and what is
  allowed: the round's gradients are on the communication side (in acco mixed with the other stage's).
- fp16 (loss scaling) at a sync boundary: refused; the buffer holds scaled gradients of a scale the step may
  still change.

``safe_get_local_grad`` / ``safe_set_local_grad`` are ZeRO-3's: DeepSpeed refuses them for ZeRO-1 and ACCO
parameters alike (an AssertionError: no ``ds_id``).
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
    index: int = 0  # the parameter's position in its group


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


def full_hp_params(params, optimizer, optim_state_key=None) -> list:
    """The whole fp32 master weight (``optim_state_key=None``) or Adam moment (``'exp_avg'`` / ``'exp_avg_sq'``) of
    each of ``params``, on every rank: what ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` return
    for each parameter, with one all-reduce per data-parallel group instead of one per parameter. Each rank copies
    its fragments into a zero fp32 buffer, so every element is summed with zeros only: the same bits as the
    per-parameter reads. A collective: every rank calls it with the same parameters in the same order. Returns
    fp32 tensors of the parameters' shapes, on their device."""
    _drain(optimizer)
    params = list(params)
    out = [None] * len(params)
    by_group: dict = {}
    for i, p in enumerate(params):
        by_group.setdefault(id(p._dp_group), (p._dp_group, []))[1].append(i)
    for group, idx in by_group.values():
        total = sum(params[i].numel() for i in idx)
        full = torch.zeros(total, dtype=torch.float32, device=params[idx[0]].device)
        views, off = [], 0
        for i in idx:
            param, frag = params[i], params[i]._hp_mapping
            view = full[off : off + param.numel()]
            if frag.numel:
                src = _state_tensor(optimizer.pipeline.groups[frag.group_index], optim_state_key)
                view[frag.param_start : frag.param_start + frag.numel].copy_(
                    src[frag.shard_start : frag.shard_start + frag.numel]
                )
            views.append(view)
            off += param.numel()
        dist.all_reduce(full, group=group)
        for i, view in zip(idx, views):
            out[i] = view.view(params[i].shape)
    return out


def _get_full_hp_param(param, optimizer, optim_state_key=None):
    return full_hp_params([param], optimizer, optim_state_key)[0]


def _set_full_hp_param(param, optimizer, value, optim_state_key=None):
    optimizer.pipeline.sync_in_flight()  # local: no collective follows, a peer behind is not waited on
    frag = param._hp_mapping
    if frag.numel:
        dst = _state_tensor(optimizer.pipeline.groups[frag.group_index], optim_state_key)
        flat = value.detach().reshape(-1).to(device=dst.device, dtype=torch.float32)
        dst[frag.shard_start : frag.shard_start + frag.numel].copy_(
            flat[frag.param_start : frag.param_start + frag.numel]
        )


class GradientNotAvailable(ValueError):
    """A gradient accessor called where ACCO holds no gradient of the step to read or write (see the module
    docstring); a ValueError, as DeepSpeed's ZeRO-1 raises outside backward .. step."""


def _param_slice(param, optimizer):
    """(group buffers, this parameter's slice of the round's ACC buffer)."""
    frag = param._hp_mapping
    b = optimizer.pipeline.groups[frag.group_index]
    off, numel = b.layout.offsets[frag.index], b.layout.numels[frag.index]
    return b, b.acc_flat[off : off + numel]


def _check_available(param, optimizer, what: str) -> bool:
    """True at a sync boundary (the step's averaged gradient), False inside a round (this rank's sum so far);
    raises GradientNotAvailable elsewhere."""
    pipeline = optimizer.pipeline
    mode = pipeline.mode
    if pipeline.boundary_pending:
        if getattr(pipeline, "scaler", None) is not None:
            raise GradientNotAvailable(
                f"{what} with fp16.enabled=true at the step's boundary: ACCO's buffer holds the gradients times a "
                "loss scale the step may still change. Allowed: bf16 or fp32 (fp16.enabled=false) for reading or "
                "editing the step's gradient between engine.backward and engine.step."
            )
        return True
    if pipeline.counter.count > 0:
        return False
    if mode == "sync":
        raise GradientNotAvailable(
            f"{what} with optimizer.params.mode='sync' and no micro-batch since the last optimizer step (or a "
            "compressed round whose gradients were quantized in its last backward): the step's gradient is "
            "consumed. Allowed: between engine.backward at the accumulation boundary and engine.step() (the step's "
            "gradient, averaged over the ranks, as ZeRO-1), or between backwards inside a step (this rank's sum so "
            "far); with compression.commit, set compression.fuse_round_end=false to read it at the boundary."
        )
    raise GradientNotAvailable(
        f"{what} with optimizer.params.mode={mode!r} right after a micro-batch that ended a round: its gradients "
        "were handed to the communication side, which reduces them and steps while the next round computes"
        + (" (a commit sums them with the estimate's g~ of the step's other round)" if mode == "acco" else "")
        + ", so there is no step gradient to read or write here. Allowed: optimizer.params.mode='sync' to read or "
        "edit the step's averaged gradient between engine.backward at the boundary and engine.step(), as ZeRO-1; "
        f"in {mode!r}, between backwards inside a round, this rank's sum of the round's micro-batch gradients so far."
    )


def _job_divisor(pipeline, world: int) -> tuple:
    """(the factor end_round scales a short sync step's buffer by, or None; the job's fp32 factor after the
    reduction): the job's gradient is ``sum_r(acc_r * pre) * post``, ZeRO-1's average (round_job)."""
    count, gas = pipeline.counter.count, pipeline.gas
    pre = count / gas if count != gas else None
    post = torch.tensor(gas / (world * count), dtype=torch.float64).to(torch.float32)
    return pre, post


def _get_full_hp_grad(param, optimizer):
    if not _check_available(param, optimizer, "safe_get_full_grad"):
        return _param_slice(param, optimizer)[1].detach().float().view(param.shape)  # local, a copy
    _, acc = _param_slice(param, optimizer)
    pre, post = _job_divisor(optimizer.pipeline, dist.get_world_size(param._dp_group))
    total = acc.detach().clone()
    if pre is not None:
        total.mul_(pre)
    dist.all_reduce(total, group=param._dp_group)
    return (total.float() * post.to(total.device)).view(param.shape)


def _set_full_hp_grad(param, optimizer, value):
    if tuple(value.shape) != tuple(param.shape) and value.numel() != param.numel():
        raise ValueError(
            f"safe_set_full_grad: value of shape {tuple(value.shape)} for a parameter of shape "
            f"{tuple(param.shape)}. Allowed: the full (un-partitioned) gradient, {param.numel()} elements."
        )
    b, acc = _param_slice(param, optimizer)
    flat = value.detach().reshape(-1).to(device=acc.device, dtype=torch.float32)
    if not _check_available(param, optimizer, "safe_set_full_grad"):
        acc.copy_(flat)
        return
    pre, post = _job_divisor(optimizer.pipeline, dist.get_world_size(param._dp_group))
    frag = param._hp_mapping
    mine = torch.zeros_like(flat)
    lo, hi = frag.param_start, frag.param_start + frag.numel
    # the job computes sum_r(acc_r * pre) * post: this rank's part divided by both, the others' parts zero
    factor = (1.0 / float(post)) / (pre if pre is not None else 1.0)
    mine[lo:hi] = flat[lo:hi].double().mul(factor).float()
    acc.copy_(mine)


def hide_step_gradients(optimizer, rounds_before: int) -> None:
    """After a micro-batch or an optimizer step: where a round just ended (its gradients gone to the
    communication side) or a sync boundary waits for ``engine.step()``, set every ``.grad`` to None, so that
    DeepSpeed's gradient accessors ask this module (ZeRO-1's ``.grad`` are None there too) instead of reading
    the next round's zeroed buffer. The next backward's prologue points them at the buffer again."""
    pipeline = optimizer.pipeline
    if pipeline.stats.rounds == rounds_before and not pipeline.boundary_pending:
        return
    for b in pipeline.groups:
        if b.shared:
            for p in b.params:
                p.grad = None


def link_accessors(optimizer) -> None:
    """Attach ``_hp_mapping`` and the accessor methods to every trainable parameter."""
    pipeline = optimizer.pipeline
    for gi, b in enumerate(pipeline.groups):
        shard = b.layout.shard_range(b.rank)
        for pi, (p, off, numel) in enumerate(zip(b.params, b.layout.offsets, b.layout.numels)):
            lo, hi = max(off, shard.start), min(off + numel, shard.stop)
            if hi > lo:
                frag = Fragment(gi, lo - off, lo - shard.start, hi - lo, pi)
            else:
                frag = Fragment(gi, 0, 0, 0, pi)
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
            p.set_full_hp_grad = types.MethodType(
                lambda self, value: _set_full_hp_grad(self, optimizer, value), p
            )
