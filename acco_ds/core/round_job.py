"""The communication job of one round: reduce-scatter, sharded AdamW (commit or peek), all-gather.

Runs on the communication side (worker thread or side CUDA stream, see ``comm.py``); reads only
buffers the compute side handed over at launch (``GroupBuffers.start_job``) and the comm-side
shard state. Everything happens IN PLACE in the job's buffers (``core.buffers``): the gradients are
reduce-scattered into this rank's slice of the gradient buffer, the fused AdamW reads that slice and
writes the new parameters into this rank's slice of the parameter target (the same slice of the
same buffer when parameter and communication dtypes match), which is then all-gathered in place.

No host reads of device values inside the job: the global count, clipping coefficient and skip
flag stay tensors, so the same code enqueues without a host sync on CUDA. The few figures the
compute side needs afterwards (skip, empty, counts) are copied into a small host tensor, pinned and
written asynchronously on CUDA with an event (``RoundResult.summary``), so reading them waits only
for this job on the side stream, never for the compute stream to drain.

Gradient scaling: the compute side accumulates micro-batch gradients that DeepSpeed's
``engine.backward`` already divided by ``gradient_accumulation_steps`` (GAS). The buffers so hold
``G_i / GAS`` and the average docs/ALGORITHM.md asks for, ``(sum_i G_i) / (sum_i n_i)``, is
``reduced * GAS / total_count``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, List, Sequence

import torch
import torch.distributed as dist

from acco_ds.core.buffers import GroupBuffers
from acco_ds.core.comm import all_gather_single, reduce_scatter_single
from acco_ds.core.commit_inputs import Capture
from acco_ds.core.compressed_comm import (
    Compression,
    Traffic,
    compressed_reduce_scatter_inplace,
    exchange_quantized_difference,
    exchange_quantized_gradients,
)
from acco_ds.core.host_step import HostStep
from acco_ds.core.loss_scale import AT_MIN, EPOCH, LossScaleSpec, express_residual, ready_scale, updated_state
from acco_ds.core.phase_clock import PhaseClock
from acco_ds.core.schedule import Job
from acco_ds.ops.adamw import adamw_step
from acco_ds.ops.adamw_difference import adamw_step_difference
from acco_ds.ops.adamw_settings import KERNEL_FIELDS, AdamWSettings
from acco_ds.ops.norm import sum_of_squares
from acco_ds.ops.quantize import num_blocks
from acco_ds.ops.quantized_sum_step import adamw_step_quantized_sum, quantized_sum_of_squares

_SUMMARY_FIXED = 4  # skipped, empty, count, round_count; then one count per rank

UNSTORED_SUM_MAX_WORLD = 3
"""Largest data-parallel world whose compressed rounds leave the owner's sum of the W quantized chunks unstored
(the norm's pass and the step read the chunks: 2 W bytes per element of the shard, ``acco_ds.ops.quantized_sum_step``)
rather than storing it once and reading it twice (W + 6 bytes in bf16). Fewer bytes up to W = 5, but each pass also
recomputes the sum: on the CPU (benchmarks/results/kernels/quantized_sum_cpu/run1, run2: a commit with bf16
gradients, 1M to 100M elements) the unstored form ran 1.03-1.26x as fast as the stored one at W = 2, 1.10-1.26x at
W = 3 (one run) and 0.92-1.12x at W = 4."""


Hyper = AdamWSettings
"""The AdamW settings type (acco_ds.ops.adamw_settings), under the name some tests still import from here."""


@dataclass
class RoundResult:
    """What a finished job hands back to the compute side.

    ``summary`` (float64, on the host; pinned on CUDA) holds ``[skipped, empty, count, round_count,
    count of rank 0, ..., count of rank W-1]``: skipped is 1 when the gradient was non-finite and
    the step was skipped, empty 1 when no rank had a micro-batch (nothing to step), count the global
    micro-batch count the step divided by (a commit in acco includes the kept g~), round_count this
    round's global micro-batches. On CUDA the job writes it asynchronously and records
    ``summary_ready``; the properties wait for that event (the side stream only)."""

    job: Job
    commit_index: int
    grad_norm: torch.Tensor  # fp32 [1] on the device: global norm of the averaged, unclipped gradient
    summary: torch.Tensor
    summary_ready: Any = None
    traffic: Traffic | None = None  # bytes this rank sent and received in this job (compressed_comm.Traffic)
    # bool [1] on the device, written by the job: no rank had a micro-batch. The compute side selects the norm to
    # report with it once its stream has waited for the job, without reading the summary on the host.
    empty_flag: torch.Tensor | None = None
    # where the job spent its time (core.phase_clock; read it only after wait_summary)
    clock: PhaseClock | None = None
    # bool [1] on the device: the gradient was non-finite (the commit or peek was skipped)
    skipped_flag: torch.Tensor | None = None
    # fp64 [2] on the device: the loss scale this round's gradients were computed under, and its epoch
    # (core.loss_scale); None without loss scaling
    loss_scale: torch.Tensor | None = None
    # a COMMIT with loss scaling: the scaler's state at the launch (the tensor the job read) and the state after this
    # commit's outcome, computed by the job (``DeviceLossScaler.adopt`` takes it at the swap-in); with it, on the host
    # and read with the summary, the new state's count of overflows at the minimum scale (fp64 [1])
    scaler_state: torch.Tensor | None = None
    next_scaler_state: torch.Tensor | None = None
    at_min: torch.Tensor | None = None

    def wait_summary(self) -> None:
        if self.summary_ready is not None:
            self.summary_ready.synchronize()

    def _at(self, i: int) -> float:
        self.wait_summary()
        return float(self.summary[i])

    @property
    def skipped(self) -> bool:
        return self._at(0) != 0.0

    @property
    def empty(self) -> bool:
        return self._at(1) != 0.0

    @property
    def count(self) -> float:
        return self._at(2)

    @property
    def round_count(self) -> float:
        return self._at(3)

    @property
    def rank_counts(self) -> List[int]:
        self.wait_summary()
        return [int(c) for c in self.summary[_SUMMARY_FIXED:].tolist()]


def collectives(group) -> bool:
    """How an uncompressed round moves its gradients and parameters over ``group``: as collectives (True: NCCL,
    ``reduce_scatter_single`` into this rank's slice of the buffer, ``all_gather_single`` in place), else point to
    point (gloo, whose collectives move twice the bytes). The tests swap it to run the collective form on gloo ranks
    (gloo runs both collectives with these aliasings); both forms give the same sums."""
    return dist.get_backend(group) != "gloo"


def reduce_scatter_inplace(full: torch.Tensor, group, traffic: Traffic | None = None) -> None:
    """Sum ``full`` (this rank's flat gradient buffer) over the ranks into this rank's own slice of it,
    in place; the other slices are left with meaningless values.

    Collectives (:func:`collectives`; NCCL): ``reduce_scatter_single`` with the output aliasing this rank's slice of
    the input (NCCL's in-place form). gloo: direct point-to-point exchange of the slices (each rank sends (W-1)/W of the
    buffer, the minimum), one peer at a time through one shard-sized receive buffer, each added into
    this rank's slice (in its dtype; fp32 arithmetic per addition); gloo's own reduce_scatter_tensor
    moves twice those bytes (measured: 10 MB fp32 between 2 ranks on a 400 Mbit/s link, 409 ms vs
    205 ms). ``traffic`` (optional) counts the bytes at each call."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    chunks = full.view(world, -1)
    if world == 1:
        return
    traffic = traffic if traffic is not None else Traffic()
    if collectives(group):
        moved = (world - 1) * chunks[me].numel() * full.element_size()
        traffic.collective(moved, moved)
        reduce_scatter_single(chunks[me], full, op=dist.ReduceOp.SUM, group=group)
        return
    received = torch.empty_like(chunks[me])
    for k in range(1, world):
        dst, src = (me + k) % world, (me - k) % world
        reqs = [
            traffic.send(chunks[dst], group, dst),
            traffic.recv(received, group, src),
        ]
        for req in reqs:
            req.wait()
        chunks[me].add_(received)


class PendingGather:
    """An all-gather whose point-to-point transfers may still be running (:func:`all_gather_inplace` with
    ``wait=False``): :meth:`wait` returns once they are done (at once where there are none); idempotent. Waited by the
    thread that issued it."""

    def __init__(self, reqs: Sequence[Any] = ()):
        self._reqs = list(reqs)

    def wait(self) -> None:
        reqs, self._reqs = self._reqs, []
        for req in reqs:
            req.wait()


def all_gather_inplace(
    full: torch.Tensor, group, traffic: Traffic | None = None, wait: bool = True
) -> PendingGather:
    """Every rank's slice of ``full`` to every rank, in place (NCCL's in-place all-gather; on gloo each
    slice is sent point-to-point straight into the peers' buffers, no staging copy). ``traffic``
    (optional) counts the bytes at each call. ``wait`` False: the point-to-point form returns with its transfers in
    flight; the caller waits the returned :class:`PendingGather` before anything reads ``full`` and before its next
    collective on ``group`` (the collective form is enqueued or done when it returns: nothing left to wait for)."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    chunks = full.view(world, -1)
    if world == 1:
        return PendingGather()
    traffic = traffic if traffic is not None else Traffic()
    if collectives(group):
        moved = (world - 1) * chunks[me].numel() * full.element_size()
        traffic.collective(moved, moved)
        all_gather_single(full, chunks[me], group=group)
        return PendingGather()
    reqs = []
    for k in range(1, world):
        dst, src = (me + k) % world, (me - k) % world
        reqs.append(traffic.send(chunks[me], group, dst))
        reqs.append(traffic.recv(chunks[src], group, src))
    pending = PendingGather(reqs)
    if wait:
        pending.wait()
    return pending


def host_staging(
    groups: Sequence[GroupBuffers], compression: dict, world: int, ranged_norm: bool
) -> List[list]:
    """The host staging buffers the jobs of a pipeline hand their ``offload`` (``core.host_step.HostStep.stage``),
    per group, as ``(name, shape, dtype)`` keys: the step inputs of every job it runs (a COMMIT; in acco, whose groups
    keep a g~, a PEEK too) and the parameter shard the step writes where that is none of them. The choices are those
    of :func:`run_round_job`: ``compression[job]`` (``Compression`` or None) per job; compressed gradients stay
    unsummed up to :data:`UNSTORED_SUM_MAX_WORLD` ranks unless the groups' norms have tensor-parallel ranges
    (``ranged_norm``); the parameter shard is the reduced gradient's own slice (same dtypes, summed gradients), the
    base (one parameter buffer: mixed dtypes in sync, whose target is the model buffer) or a buffer of its own."""
    jobs = [Job.COMMIT] + ([Job.PEEK] if groups[0].tilde is not None else [])
    scalars = [
        ("hyper_tensor", (len(KERNEL_FIELDS),), torch.float32),
        ("scale_tensor", (1,), torch.float32),
        ("noop_flag", (1,), torch.int32),
    ]
    out: List[list] = []
    for b in groups:
        s, P, C = b.layout.shard_numel, b.param_dtype, b.comm_dtype
        keys = set(scalars)
        for job in jobs:
            comp = compression.get(job)
            packed = comp is not None and comp.parameters
            unsummed = (
                comp is not None and comp.gradients and world <= UNSTORED_SUM_MAX_WORLD and not ranged_norm
            )
            if unsummed and job is Job.COMMIT:  # a peek's step reads the sum its norm pass wrote into the g~
                keys |= {
                    ("q", (world, s), torch.int8),
                    ("scales", (world, num_blocks(s, comp.block_size)), torch.float32),
                }
                if b.tilde is not None:
                    keys.add(("tilde", (s,), C))
            else:
                keys.add(("grad", (s,), C))
            if packed:
                keys.add(("base", (s,), P))
            own_slice = b.shared and not unsummed
            on_base = packed and not b.shared and len(b.param_bufs) == 1
            if not (own_slice or on_base):
                keys.add(("out", (s,), P))
        out.append(sorted(keys, key=lambda k: (k[0], k[1], str(k[2]))))
    return out


def make_host_step(
    groups: Sequence[GroupBuffers],
    device: torch.device,
    spec,
    compression: dict,
    world: int,
    tp_group,
    timeout_s: float,
) -> HostStep:
    """The pipeline's ``HostStep`` (``core.host_step``) with every staging buffer its jobs use allocated now
    (:func:`host_staging`) and counted in the groups' ``held_bytes()``; its waits bounded by ``timeout_s`` (the
    pipeline's comm_timeout_s), its errors naming this rank. ``tp_group``: the pipeline's tensor-parallel group or
    None (the norm has ranges on every tensor-parallel rank but the first: ``GroupBuffers.set_norm_ranges``)."""
    ranged = tp_group is not None and dist.get_world_size(tp_group) > 1 and dist.get_rank(tp_group) != 0
    return HostStep(
        len(groups),
        device,
        spec,
        staging=host_staging(groups, compression, world, ranged),
        accounts=groups,
        timeout_s=timeout_s,
        rank=dist.get_rank() if dist.is_initialized() else 0,
    )


def run_round_job(
    *,
    job: Job,
    commit_index: int,
    groups: Sequence[GroupBuffers],
    roles: Sequence[tuple],
    hyper_table: Sequence[Sequence[tuple]],
    base_applied: int,
    applied: List[torch.Tensor],
    local_count: int,
    fixed_count: int | None,
    gas: int,
    clip: float,
    group,
    tilde_count: List[torch.Tensor],
    norm_group=None,
    compression: Compression | None = None,
    residuals: Sequence[torch.Tensor | None] | None = None,
    bases: Sequence[torch.Tensor] | None = None,
    prequantized: Sequence[tuple] | None = None,
    releases: Sequence[Any] | None = None,
    loss_scale: torch.Tensor | None = None,
    unscale_by: torch.Tensor | None = None,
    scaler: tuple[LossScaleSpec, torch.Tensor] | None = None,
    unscale_ready: bool = False,
    residual_scales: Sequence[torch.Tensor | None] | None = None,
    predivide: bool = False,
    tilde_factor: float = 1.0,
    offload: HostStep | None = None,
    commit_inputs: Capture | None = None,
) -> RoundResult:
    """One round's communication. ``roles[i]`` is group i's ``(grad buffer, param target)`` index pair
    from ``GroupBuffers.start_job``.

    AdamW settings, decided on the device: ``applied[0]`` (a device tensor) counts the commits applied
    before this job as the side stream sees them; the job is or predicts commit number
    ``applied[0] + 1``. ``hyper_table[i][k]`` holds group i's AdamW scalars (``hyper_scalars``: LR
    schedule and bias corrections) for ``applied[0] == base_applied + k``; the job picks its row on the
    device, and a COMMIT adds 1 to ``applied[0]`` unless it was skipped or empty. The host so never
    needs to know whether the commits still in flight were applied. ``tilde_count`` is a one-element list holding the global
    count of the g~ kept by the last peek (acco, a device tensor); a PEEK stores into it, a COMMIT
    consumes it. ``fixed_count``: the micro-batches every rank accumulated (fixed accumulation), or None
    to all-gather each rank's ``local_count`` (adaptive; a number, put on the device by a fill).

    ``compression``: None, or this round's gradients are exchanged in int8 blocks
    (``compressed_comm.exchange_quantized_gradients``; the W chunks of the shard are never summed into memory: the
    norm and the step read them, ``ops.quantized_sum_step``, and a peek's pass writes the sum into the g~ it keeps;
    above :data:`UNSTORED_SUM_MAX_WORLD` ranks and with tensor parallelism's norm ranges
    ``compressed_reduce_scatter_inplace`` stores the sum first), with ``residuals[i]`` (the pipeline's
    error-feedback residual of group i, written in place) when ``compression.error_feedback`` (an uncompressed
    COMMIT adds the residual to its buffer and zeroes it: the peeks' quantization error is sent exactly); and/or its new
    parameters are all-gathered as int8 differences to ``bases[i]`` (group i's MODEL buffer at the launch,
    what every replica holds; ``ops.adamw_difference`` then ``compressed_comm.exchange_quantized_difference``).
    ``prequantized[i]``: group i's ``(q, scales)`` rows when the round end already quantized its gradients
    (``core.fused_round_end``; the job owns them and leaves the residual alone). ``releases[i]`` (a
    ``fused_round_end.ResidualRelease``) is released once this job no longer touches group i's residual.

    ``loss_scale`` (fp16, ``core.loss_scale``): fp64 [2] on the device, the scale the round's gradients were computed
    under and its epoch; the reported norm is divided by that scale, the step's gradient by ``unscale_by`` (fp64 [1];
    default: the same scale; sync passes ZeRO-1's, the scale after this step's update) times the clip coefficient,
    computed from the norm divided by ``unscale_by`` as ``DeepSpeedZeroOptimizer.unscale_and_clip_grads`` does. A
    non-finite norm (an fp16 overflow on any rank) skips the job, as any non-finite gradient. With error feedback,
    ``residual_scales[i]`` (fp64 [1]) is the scale group i's residual is in: the job re-expresses it in its own scale
    before adding it (``loss_scale.express_residual``). ``predivide`` (fp16, uncompressed gradients): the buffer is
    divided by the world size before its reduce-scatter, in its dtype, as ZeRO-1 does (``DeepSpeedZeroOptimizer.
    average_tensor``), so that the sum over the ranks overflows where ZeRO-1's does; the average then multiplies by
    the world size back. A COMMIT multiplies the kept g~ by ``tilde_factor`` first (the peek's predivision over
    this commit's: 1/W or W where one of the two rounds is compressed and the other is not). ``scaler`` (a COMMIT):
    the scaler's settings and its state (fp64 [6], on the device; the scaler replaces its state, never writes it in
    place, so the job may read it on its side): the job computes the state after its own outcome
    (``RoundResult.next_scaler_state``, the rule of ``DeviceLossScaler.apply``) and, with ``unscale_ready`` (sync),
    ``unscale_by`` as ``loss_scale.ready_scale`` of that state; the training thread then enqueues none of it.

    ``offload`` (``core.host_step``): the groups' master shards and moments are in host memory; each group's step
    runs there (its inputs copied to the host, the new parameters back) between the norm and its all-gather. Every
    group's inputs are staged right after the norm; then per group: its host step, its copy back, its all-gather,
    so that group i+1's step overlaps group i's all-gather (on gloo the uncompressed all-gather's transfers stay in
    flight meanwhile; the compressed one, ``exchange_quantized_difference``, returns done).

    ``commit_inputs`` (a COMMIT with the memory state's peer copies in the inputs form, ``core.commit_inputs``):
    each group's step inputs are copied there before any group's step runs (a step may overwrite its gradient);
    a step that is not the plain ``adamw_step``, or runs in host memory (offload), marks it as holding none."""
    dev = groups[0].device
    clock = PhaseClock(dev)
    if unscale_ready:
        unscale_by = ready_scale(scaler[0], scaler[1])
    traffic = Traffic()
    packed_params = compression is not None and compression.parameters
    if packed_params and (bases is None or len(bases) != len(groups)):
        raise ValueError("run_round_job: a compressed all-gather needs one base buffer per group")
    # compressed gradients: the W quantized chunks of each shard stay unsummed (norm and step read them), except
    # at W > UNSTORED_SUM_MAX_WORLD and where tensor parallelism's norm ranges need the sum in memory
    world = dist.get_world_size(group)
    unsummed = (
        compression is not None
        and compression.gradients
        and world <= UNSTORED_SUM_MAX_WORLD
        and all(b.norm_ranges is None for b in groups)
    )
    shards: List[Any] = [None] * len(groups)  # each group's QuantizedShard, where unsummed
    for i, (b, (g, _)) in enumerate(zip(groups, roles)):
        release = releases[i].release if releases is not None else None
        touches_residual = residuals is not None and residuals[i] is not None and prequantized is None
        if loss_scale is not None and touches_residual and residual_scales is not None:
            express_residual(residuals[i], residual_scales[i], loss_scale[0:1])
        if compression is None or not compression.gradients:
            if job is Job.COMMIT and residuals is not None and residuals[i] is not None:
                # an uncompressed commit sends what the compressed peeks withheld: the committed gradient is
                # then the exact sum, the peeks' quantization error stays out of the committed state
                b.grad_bufs[g].add_(residuals[i])
                residuals[i].zero_()
            if release is not None:
                release()
            if predivide:
                b.grad_bufs[g].div_(dist.get_world_size(group))
            reduce_scatter_inplace(b.grad_bufs[g], group, traffic)
        else:
            args = (
                b.grad_bufs[g],
                residuals[i] if compression.error_feedback else None,
                group,
                compression.block_size,
                traffic,
                compression.gradient_bits,
                None if prequantized is None else prequantized[i],
                release,
            )
            if unsummed:
                shards[i] = exchange_quantized_gradients(*args)
            else:
                compressed_reduce_scatter_inplace(*args)
            if prequantized is not None:  # sent: free the rows now, as a job frees its own
                prequantized[i] = None
    grads = [b.shard_of(b.grad_bufs[g]) for b, (g, _) in zip(groups, roles)]
    clock.mark("reduce_scatter")

    if fixed_count is not None:
        rank_counts = torch.full((world,), float(fixed_count), dtype=torch.float64, device=dev)
    else:
        rank_counts = torch.empty(world, dtype=torch.float64, device=dev)
        mine = torch.full((1,), float(local_count), dtype=torch.float64, device=dev)
        all_gather_single(rank_counts, mine, group=group)
    count = rank_counts.sum().reshape(1)
    round_count = count

    keeps_tilde = job is Job.PEEK and groups[0].tilde is not None
    adds_tilde = job is Job.COMMIT and groups[0].tilde is not None
    if adds_tilde and tilde_factor != 1.0:
        for b in groups:
            b.tilde.mul_(tilde_factor)
    # unsummed, the norm's pass writes the g~ a peek keeps and the step adds the one a commit uses
    if keeps_tilde:
        if not unsummed:
            for b, grad in zip(groups, grads):
                b.tilde.copy_(grad)
        tilde_count[0] = count.clone()
    elif adds_tilde:
        if not unsummed:
            for b, grad in zip(groups, grads):
                grad.add_(b.tilde)
        count = count + tilde_count[0]

    # a round no rank put a micro-batch in (a drain can end one, see ACCOPipeline._agree_on_round_count)
    # has nothing to average: it is a no-op, not a non-finite skip
    empty = count <= 0
    avg_scale64 = torch.where(
        empty, torch.zeros_like(count), (gas * (world if predivide else 1)) / count.clamp(min=1.0)
    )
    if loss_scale is not None:
        avg_scale64 = avg_scale64 / loss_scale[0:1]
    # the step's factor: sync unscales by the scale after its update, as ZeRO-1 (core.loss_scale.ready_scale)
    step_scale64 = avg_scale64 if unscale_by is None else avg_scale64 * (loss_scale[0:1] / unscale_by)
    avg_scale = step_scale64.to(torch.float32)
    # the norm in fp64 up to its final value, as DeepSpeed's (acco_ds.ops.norm)
    sumsq = torch.zeros(1, dtype=torch.float64, device=dev)
    for b, grad, got in zip(groups, grads, shards):
        if unsummed:  # the sum (+ the kept g~ in a commit; into the g~ in a peek) straight from the chunks
            sumsq += quantized_sum_of_squares(
                got.q, got.scales, compression.block_size, got.order, grad.dtype,
                tilde=b.tilde if adds_tilde else None, tilde_out=b.tilde if keeps_tilde else None,
            )  # fmt: skip
        elif b.norm_ranges is None:
            sumsq += sum_of_squares(grad)
        else:  # tensor parallelism: a replicated parameter counts on one tensor-parallel rank only
            for lo, hi in b.norm_ranges:
                sumsq += sum_of_squares(grad[lo:hi])
    dist.all_reduce(sumsq, op=dist.ReduceOp.SUM, group=group)
    if norm_group is not None:
        dist.all_reduce(sumsq, op=dist.ReduceOp.SUM, group=norm_group)
    clock.mark("norm")
    grad_norm = (sumsq.sqrt() * avg_scale64).to(torch.float32)
    skipped = ~torch.isfinite(grad_norm)
    noop = (skipped | empty).to(torch.int32)
    scale = avg_scale
    if clip > 0.0:
        # DeepSpeed's rule: divide by (norm + 1e-6) / clip when that exceeds 1 (the norm unscaled as the step is)
        clip_norm = grad_norm if unscale_by is None else (sumsq.sqrt() * step_scale64).to(torch.float32)
        ratio = (clip_norm + 1e-6) / clip
        scale = torch.where(ratio > 1.0, avg_scale / ratio, avg_scale)
    scale = torch.nan_to_num(scale, nan=0.0, posinf=0.0, neginf=0.0)

    table = torch.tensor(hyper_table, dtype=torch.float32)  # [groups, candidates, 8]
    if dev.type == "cuda":
        table = table.pin_memory().to(dev, non_blocking=True)
    if table.shape[1] > 1:
        row = (applied[0] - base_applied).clamp(0, table.shape[1] - 1).long()
        table = table.index_select(1, row)
    calls = []  # per group: (buffers, step function, its device inputs, this rank's shard of the target, target)
    for i, (b, grad, (_, p)) in enumerate(zip(groups, grads, roles)):
        target = b.param_bufs[p]
        step = dict(
            hyper_tensor=table[i, 0].contiguous(),
            scale_tensor=scale,
            noop_flag=noop,
        )
        out = b.shard_of(target)
        # the replicas' parameters (may be the target itself: each element is read before it is written)
        base = b.shard_of(bases[i]) if packed_params else None
        bits = compression.parameter_bits if packed_params else 8
        got = shards[i] if unsummed and not keeps_tilde else None  # a peek's sum is in the g~ by now
        commit = job is Job.COMMIT
        if got is not None:
            fn = partial(
                adamw_step_quantized_sum, block_size=compression.block_size, order=got.order, dtype=grad.dtype,
                bits=bits, commit=commit,
            )  # fmt: skip
            tensors = dict(
                q=got.q, scales=got.scales, tilde=b.tilde if adds_tilde else None, base=base, **step
            )
        else:
            source = b.tilde if unsummed else grad
            if packed_params:
                # the step, this rank's quantized difference to what the replicas hold and its application,
                # one pass where the CPU kernel runs
                fn = partial(
                    adamw_step_difference, block_size=compression.block_size, bits=bits, commit=commit
                )
                tensors = dict(grad=source, base=base, **step)
            else:
                fn = partial(adamw_step, commit=commit)
                tensors = dict(grad=source, **step)
        calls.append((b, fn, tensors, out, target))
        if commit_inputs is not None and commit:
            if offload is None:
                commit_inputs.take(i, fn, tensors)
            else:
                commit_inputs.none()
    # offload (core.host_step): every group's inputs go to the host before the first all-gather is issued, so that
    # group i+1's host step runs while group i's all-gather does (CUDA: on this stream; gloo: its transfers left in
    # flight, at most one all-gather at a time, waited before the next is issued and before the job returns)
    staged = [offload.stage(i, c[2], c[3]) for i, c in enumerate(calls)] if offload is not None else None
    in_flight = PendingGather()
    for i, (b, fn, tensors, out, target) in enumerate(calls):
        if offload is None:
            diff = fn(b.master, b.exp_avg, b.exp_avg_sq, out=out, **tensors)
        else:  # the state is in host memory: the inputs went there, the new parameters come back (core.host_step)
            diff = offload.step(staged[i], fn, (b.master, b.exp_avg, b.exp_avg_sq), clock=clock)
        clock.mark("step" if offload is None else "to_device")
        in_flight.wait()  # the previous group's all-gather, before this group's collectives
        if packed_params:
            q, scales = diff
            exchange_quantized_difference(
                target, bases[i], q, scales, group, compression.block_size, traffic, bits
            )
        else:
            in_flight = all_gather_inplace(target, group, traffic, wait=offload is None)
        clock.mark("all_gather")
    in_flight.wait()
    clock.mark("all_gather")
    if job is Job.COMMIT:
        applied[0].add_((~(skipped | empty)).double())

    scaled = {}
    if scaler is not None and job is Job.COMMIT:
        spec, state = scaler
        counted = (loss_scale[1] == state[EPOCH]).reshape(1) & ~empty.reshape(1)
        nxt = updated_state(spec, state, (skipped & ~empty).reshape(1), counted)
        scaled = dict(scaler_state=state, next_scaler_state=nxt)
        extra = [nxt[AT_MIN : AT_MIN + 1]]
    else:
        extra = []
    summary = torch.cat([skipped.double(), empty.double(), count, round_count, rank_counts, *extra])
    ready = None
    if dev.type == "cuda":
        host = torch.empty(summary.shape, dtype=torch.float64, pin_memory=True)
        host.copy_(summary, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(dev))
    else:
        host = summary.clone()
    if extra:
        host, scaled["at_min"] = host[:-1], host[-1:]
    flags = dict(
        empty_flag=empty.reshape(1),
        clock=clock,
        skipped_flag=skipped.reshape(1),
        loss_scale=loss_scale,
        **scaled,
    )
    return RoundResult(job, commit_index, grad_norm, host, ready, traffic, **flags)
