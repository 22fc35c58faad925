"""Flat buffers and the shard layout of one parameter group.

Layout: the group's trainable parameters, in order, are packed into one flat vector of ``numel``
elements, padded with zeros to ``padded_numel``, a multiple of ``world_size * ALIGN`` so that
every rank's shard has the same size and starts on a 64-byte boundary (ALIGN fp32 elements).
Rank ``r`` owns ``[r * shard_numel, (r + 1) * shard_numel)``. This is DeepSpeed ZeRO-1's layout
(contiguous slices of one flat vector, rank order), which is what ``zero_to_fp32`` reassembles.

Full-size buffers and their roles. At any time each full buffer has one role:

- MODEL (param dtype): the model's ``Parameter.data`` are views into it; the compute side reads it.
- ACC (comm dtype): the compute side accumulates the round's micro-batch gradients into it.
- JOB: handed to the communication side at a round end with the round's gradients. The job
  reduce-scatters them IN PLACE (this rank's reduced shard ends in its own slice), the fused AdamW
  reads that slice and writes the new parameters into the slice of the job's parameter target,
  which is then all-gathered IN PLACE. When the job is swapped in, its parameter target becomes
  MODEL.
- free: none of the above (only between a swap-in and the next ACC).

Storage, by dtypes and mode (N = padded_numel, S = shard_numel, D = dtype size):

- param dtype == comm dtype (the default: bf16/bf16, fp32/fp32): ONE pool of interchangeable
  buffers. A job's parameter target is its own gradient buffer (the reduce-scatter leaves only this
  rank's slice live, and the new parameters overwrite exactly that slice before the all-gather), so a
  buffer goes ACC -> JOB -> MODEL -> ACC: no copy at a round end. acco/dpu hold 3 buffers (the model
  computes on one, accumulates into another, while the third is on the wire); sync holds 2 (nothing
  overlaps). The parameters' ``.grad`` are views into the ACC buffer, so autograd accumulates each
  micro-batch's gradient in place (``point_grads``); no ``.grad`` tensor exists beside the buffer.
- param dtype != comm dtype (bf16 parameters, fp32 communication): a gradient buffer cannot hold the
  parameters, so parameters and gradients have pools of their own: 2 param + 2 grad buffers in
  acco/dpu (the new parameters are gathered into the param buffer the model does not use), 1 + 1 in
  sync (gathered into the model's own buffer while the compute waits). ``.grad`` cannot be a view of
  another dtype: a post-accumulate-grad hook folds each parameter's gradient into ACC as backward
  produces it and frees it (``install_fold_hooks``).
- the last micro-batch of a compressed round (either layout, ``core.fused_round_end``): the same hooks hand
  each parameter's gradient to the fused round end (``begin_fused_fold``; same dtypes: the ``.grad`` are None
  for that backward), which folds it into ACC and quantizes the blocks it covers whole in one pass.

Shards (this rank's S elements, comm side only except while drained): the fp32 master weights,
``exp_avg``, ``exp_avg_sq``; in acco the reduced g~ sum the last peek kept (``tilde``), in the comm
dtype it was reduced in. Nothing else is held: no fp32 gradient shard, no reduce or output shard.

Per rank: same dtype, acco/dpu: 3 N D + 12 S (+ S D in acco); sync: 2 N D + 12 S. Mixed (bf16
parameters, fp32 communication), acco/dpu: 2 N 2 + 2 N 4 + 12 S (+ 4 S); sync: N 2 + N 4 + 12 S.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import torch

from acco_ds.ops.accumulate import accumulate_grads

ALIGN = 16  # elements; 64 B of fp32, 32 B of bf16: keeps every shard start vector-aligned


def padded_numel(numel: int, world_size: int) -> int:
    """Length of a group's flat buffers: ``numel`` rounded up to a multiple of ``world_size * ALIGN`` (at least one)."""
    unit = world_size * ALIGN
    return max(unit, -(-numel // unit) * unit)


@dataclass(frozen=True)
class GroupLayout:
    """Where each parameter of a group lives in the flat vector, and which slice rank r owns."""

    offsets: tuple
    numels: tuple
    shapes: tuple
    numel: int
    padded_numel: int
    world_size: int

    @classmethod
    def build(cls, params: Sequence[torch.Tensor], world_size: int) -> GroupLayout:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        offsets, numels, shapes, off = [], [], [], 0
        for p in params:
            offsets.append(off)
            numels.append(p.numel())
            shapes.append(tuple(p.shape))
            off += p.numel()
        return cls(
            tuple(offsets), tuple(numels), tuple(shapes), off, padded_numel(off, world_size), world_size
        )

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> range:
        return range(rank * self.shard_numel, (rank + 1) * self.shard_numel)

    def real_shard_range(self, rank: int) -> range:
        """The part of rank's shard that holds parameters (padding excluded); may be empty."""
        r = self.shard_range(rank)
        return range(r.start, max(r.start, min(r.stop, self.numel)))


class GradReplacedError(RuntimeError):
    """A parameter's ``.grad`` is no longer ACCO's view into the accumulation buffer."""


class GroupBuffers:
    """The buffers of one parameter group on one rank (see the module docstring for roles/ownership).

    ``param_bufs`` / ``grad_bufs`` are the full buffers (the same list when the dtypes match);
    ``model`` indexes ``param_bufs``, ``acc`` indexes ``grad_bufs``, ``job`` is the ``(grad, param)``
    pair of indices handed to the communication side, or None. Role changes happen on the compute
    side only: :meth:`start_job`, :meth:`finish_job`, :meth:`new_acc`."""

    def __init__(
        self,
        params: List[torch.nn.Parameter],
        layout: GroupLayout,
        rank: int,
        comm_dtype: torch.dtype,
        keep_tilde: bool,
        overlapped: bool,
        state_device: torch.device | str | None = None,
    ):
        """``state_device``: where the fp32 master shard and both moments live; None (the default) beside the
        parameters. ``"cpu"`` with GPU parameters is optimizer offload (``core.host_step``): the round's job then
        steps them on the host; every other buffer, the kept g~ included, stays on the parameters' device."""
        self.params = params
        self.layout = layout
        self.rank = rank
        dev = params[0].device
        pdtype = params[0].dtype
        for p in params:
            if p.dtype != pdtype or p.device != dev:
                raise TypeError(
                    f"all trainable parameters of a group must share dtype and device; saw {p.dtype} on "
                    f"{p.device} and {pdtype} on {dev}. Cast the model (e.g. model.to(torch.bfloat16)) first."
                )
        n, s = layout.padded_numel, layout.shard_numel
        self.device = dev
        self.state_device = dev if state_device is None else torch.device(state_device)
        self.param_dtype = pdtype
        self.comm_dtype = comm_dtype
        self.shared = pdtype == comm_dtype
        self.overlapped = overlapped
        if self.shared:
            self.param_bufs = [
                torch.zeros(n, dtype=pdtype, device=dev) for _ in range(3 if overlapped else 2)
            ]
            self.grad_bufs = self.param_bufs
        else:
            count = 2 if overlapped else 1
            self.param_bufs = [torch.zeros(n, dtype=pdtype, device=dev) for _ in range(count)]
            self.grad_bufs = [torch.zeros(n, dtype=comm_dtype, device=dev) for _ in range(count)]
        self.model = 0
        self.acc = 1 if self.shared else 0
        self.job: tuple | None = None
        with torch.no_grad():
            model_flat = self.param_bufs[0]
            for p, off, numel in zip(params, layout.offsets, layout.numels):
                model_flat[off : off + numel].copy_(p.detach().reshape(-1))
                p.data = model_flat[off : off + numel].view(p.shape)  # the original storage is freed here
        sd = self.state_device
        self.master = self.shard_of(self.param_bufs[self.model]).to(device=sd, dtype=torch.float32, copy=True)
        self.exp_avg = torch.zeros(s, dtype=torch.float32, device=sd)
        self.exp_avg_sq = torch.zeros(s, dtype=torch.float32, device=sd)
        self.tilde = torch.zeros(s, dtype=comm_dtype, device=dev) if keep_tilde else None
        self._fold_handles: list = []
        self._fuser = None  # core.fused_round_end: where the gradients of a fused round end go
        self.norm_ranges: list | None = None  # None: the whole shard counts in the gradient norm
        # (flat, its per-parameter views, their data pointers) for every full buffer: the buffers live as long
        # as the group, so the views are made once (a view per parameter per call cost the host ~15 us each)
        self._view_cache = [
            (f, *self._make_views(f)) for f in {id(f): f for f in self.param_bufs + self.grad_bufs}.values()
        ]
        self.point_params()
        self.point_grads()

    # -- views ----------------------------------------------------------------------------------
    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        r = self.layout.shard_range(self.rank)
        return flat[r.start : r.stop]

    def _make_views(self, flat: torch.Tensor) -> tuple:
        views = [
            flat[off : off + numel].view(shape)
            for off, numel, shape in zip(self.layout.offsets, self.layout.numels, self.layout.shapes)
        ]
        return views, [v.data_ptr() for v in views]

    def _views(self, flat: torch.Tensor) -> tuple:
        """(views, data pointers): every parameter's view into ``flat``, made once per full buffer (any other
        flat, e.g. the committed weights, gets new views). The views are shared: callers must not change
        their metadata (``resize_``, ``set_``, ``.data =``), only their values."""
        for cached, views, ptrs in self._view_cache:
            if cached is flat:
                return views, ptrs
        return self._make_views(flat)

    @property
    def model_flat(self) -> torch.Tensor:
        return self.param_bufs[self.model]

    @property
    def acc_flat(self) -> torch.Tensor:
        return self.grad_bufs[self.acc]

    def point_params(self, flat: torch.Tensor | None = None) -> None:
        """Make every model parameter a view into ``flat`` (default: the MODEL buffer); no copy."""
        views, _ = self._views(self.model_flat if flat is None else flat)
        for p, view in zip(self.params, views):
            p.data = view

    def point_grads(self) -> None:
        """Same dtypes: make every parameter's ``.grad`` a view into the ACC buffer (autograd then
        accumulates into it in place). Mixed dtypes: ``.grad`` stays None between backwards."""
        if not self.shared:
            return
        views, ptrs = self._views(self.acc_flat)
        for p, view, ptr in zip(self.params, views, ptrs):
            g = p.grad
            if g is None or g.data_ptr() != ptr:
                p.grad = view

    def adopt_grads(self) -> None:
        """Same dtypes, after a backward that started with ``.grad`` not pointed at the ACC buffer: a ``.grad`` that
        is another tensor holds that backward's gradient (autograd created it where ``.grad`` was None); add it
        into the parameter's view of the ACC buffer and make ``.grad`` the view again. A ``.grad`` that is the view
        already accumulated in place. Mixed dtypes: nothing to do (the fold hooks ran in that backward too)."""
        if not self.shared:
            return
        views, ptrs = self._views(self.acc_flat)
        for p, view, ptr in zip(self.params, views, ptrs):
            g = p.grad
            if g is not None and g.data_ptr() != ptr:
                view.add_(g.reshape(view.shape))
                p.grad = view

    def check_grads(self) -> None:
        """After a backward (same dtypes): every ``.grad`` must still be ACCO's view (or None, when
        the parameter got no gradient and user code reset it). Raises GradReplacedError otherwise."""
        if not self.shared:
            return
        _, ptrs = self._views(self.acc_flat)
        for p, ptr in zip(self.params, ptrs):
            g = p.grad
            if g is not None and g.data_ptr() != ptr:
                raise GradReplacedError(
                    f"acco_ds: the .grad of a parameter of shape {tuple(p.shape)} was replaced by another tensor "
                    "during this micro-batch. ACCO accumulates gradients in place in its communication buffer "
                    "through .grad views; do not assign .grad, call backward with create_graph=True, or clip or "
                    "rescale .grad yourself (set DeepSpeed's gradient_clipping instead). Use engine.backward(loss)."
                )

    def install_fold_hooks(self) -> None:
        """Mixed dtypes: fold each parameter's gradient into the ACC buffer as soon as autograd has
        accumulated it, then free it, so no full set of ``.grad`` tensors ever exists."""
        if self.shared or self._fold_handles:
            return
        self._install_hooks()

    def _install_hooks(self) -> None:
        for index, p in enumerate(self.params):
            self._fold_handles.append(p.register_post_accumulate_grad_hook(self._make_fold(index)))

    def _make_fold(self, index: int):
        off = self.layout.offsets[index]

        def fold(p: torch.Tensor) -> None:
            if p.grad is not None:
                if self._fuser is not None:
                    self._fuser(index, p.grad)
                else:
                    accumulate_grads(self.acc_flat, [p.grad], [off], 1.0)
                p.grad = None

        return fold

    def remove_fold_hooks(self) -> None:
        for h in self._fold_handles:
            h.remove()
        self._fold_handles = []

    def begin_fused_fold(self, fuser) -> None:
        """The next backward's gradients go to ``fuser(parameter index, grad)`` (``core.fused_round_end``) instead
        of the buffer: same dtypes, every ``.grad`` is set to None (autograd then hands each parameter its
        gradient of this backward alone) and the hooks are installed until :meth:`end_fused_fold`; mixed dtypes,
        the fold hooks route it there."""
        if self._fuser is not None:
            raise RuntimeError("acco_ds: a fused round end is already in progress for this group")
        self._fuser = fuser
        if self.shared:
            for p in self.params:
                p.grad = None
            self._install_hooks()

    def end_fused_fold(self) -> None:
        """Back to the plain accumulation (same dtypes: the hooks removed; the next backward's prologue points
        the ``.grad`` at the new ACC buffer)."""
        if self._fuser is None:
            return
        self._fuser = None
        if self.shared:
            self.remove_fold_hooks()

    def set_norm_ranges(self, counted: Sequence[bool], count_replicated: bool) -> None:
        """Tensor parallelism: which parts of this rank's shard enter the gradient norm. ``counted[i]``:
        parameter i is split across the tensor-parallel ranks (always counted); the others are replicated
        and counted only where ``count_replicated`` (one tensor-parallel rank). ``norm_ranges`` becomes a
        list of merged ``(lo, hi)`` ranges relative to the shard start; padding is never counted."""
        if count_replicated:
            self.norm_ranges = None
            return
        shard = self.layout.shard_range(self.rank)
        ranges: list = []
        for split, off, numel in zip(counted, self.layout.offsets, self.layout.numels):
            lo, hi = max(off, shard.start), min(off + numel, shard.stop)
            if not split or hi <= lo:
                continue
            lo, hi = lo - shard.start, hi - shard.start
            if ranges and ranges[-1][1] == lo:
                ranges[-1] = (ranges[-1][0], hi)
            else:
                ranges.append((lo, hi))
        self.norm_ranges = ranges

    # -- roles (compute side) -------------------------------------------------------------------
    def start_job(self, in_place: bool) -> tuple:
        """Hand the ACC buffer to a job; return ``(grad_index, param_index)``: the buffer the job
        reduces and the one it gathers the new parameters into. ``in_place`` (sync, the compute waits):
        mixed dtypes gather into the MODEL buffer itself."""
        if self.job is not None:
            raise RuntimeError("acco_ds: a job is already in flight for this group")
        g = self.acc
        if self.shared:
            target = g
        elif in_place or len(self.param_bufs) == 1:
            target = self.model
        else:
            target = 1 - self.model
        self.job = (g, target)
        self.acc = None
        return self.job

    def finish_job(self) -> None:
        """The job in flight has been waited for: its parameter target becomes MODEL."""
        g, target = self.job
        self.model = target
        self.job = None

    def new_acc(self) -> None:
        """Give ACC a buffer no other role holds and zero it (on the compute side)."""
        busy = set()
        if self.job is not None:
            busy.add(self.job[0])
            if self.shared:
                busy.add(self.job[1])
        if self.shared:
            busy.add(self.model)
        free = [i for i in range(len(self.grad_bufs)) if i not in busy]
        if not free:
            raise RuntimeError(f"acco_ds: no free gradient buffer (model {self.model}, job {self.job})")
        self.acc = free[0]
        self.grad_bufs[self.acc].zero_()

    def restore_roles(self, job_in_flight: bool) -> None:
        """A canonical role assignment for a restored state (the caller fills the buffers): MODEL in
        buffer 0, a finished job's parameters (and, same dtypes, its gradients) in buffer 1, ACC in the
        next free buffer."""
        self.model = 0
        self.job = (1, 1) if job_in_flight else None
        if self.shared:
            self.acc = 2 if job_in_flight else 1
        else:
            self.acc = 0

    def job_param_flat(self) -> torch.Tensor | None:
        return None if self.job is None else self.param_bufs[self.job[1]]

    # -- sizes ----------------------------------------------------------------------------------
    def state_numel(self) -> int:
        """Elements of sharded optimizer state held by this rank (master + exp_avg + exp_avg_sq)."""
        return self.master.numel() + self.exp_avg.numel() + self.exp_avg_sq.numel()

    host_staging_bytes: int | None = None
    """Bytes of host staging buffers the staged host step holds for this group (``core.host_step.HostStep`` keeps it
    current; they are allocated when the pipeline is built); None without a staged host step."""

    def held_bytes(self) -> dict:
        """Bytes this group holds, per buffer kind (what bench_memory's analytic columns predict): ``full`` and
        ``shards`` on the parameters' device, ``host_shards`` the optimizer state in host memory (offload; 0
        without it) and, only with a staged host step (offload), ``host_staging``: its buffers in host memory."""
        full = {id(t): t for t in self.param_bufs + self.grad_bufs}.values()
        shards = [self.master, self.exp_avg, self.exp_avg_sq] + (
            [self.tilde] if self.tilde is not None else []
        )
        offloaded = self.state_device != self.device
        here = [t for t in shards if not (offloaded and t.device == self.state_device)]
        away = [t for t in shards if offloaded and t.device == self.state_device]
        held = {
            "full": sum(t.numel() * t.element_size() for t in full),
            "shards": sum(t.numel() * t.element_size() for t in here),
            "host_shards": sum(t.numel() * t.element_size() for t in away),
        }
        if self.host_staging_bytes is not None:
            held["host_staging"] = self.host_staging_bytes
        return held
