"""ACCOPipeline: ACCO's two-stream pipeline over a set of parameter groups, engine-agnostic.

The caller (the DeepSpeed optimizer, or a test) drives it with:

- ``on_backward_start()`` before each micro-batch backward: the parameters' ``.grad`` are (again)
  views into the round's gradient buffer, so autograd accumulates into it in place (mixed dtypes:
  hooks fold each gradient into it as backward produces it; ``core.buffers``).
- ``on_micro_batch_end(boundary, hold)`` after each micro-batch backward. ``boundary``: the engine marks
  this micro-batch the last of its optimizer step (None: count, a boundary every
  ``gradient_accumulation_steps``); ``hold``: the optimizer step does not end at this micro-batch (the engine's
  ``no_sync()`` or coalesced reduction), while the rounds that end by count (acco's PEEK rounds, every adaptive
  round) end as they would outside it, so a loop that wraps the micro-batches before its boundary in ``no_sync()``
  (accelerate's ``accumulate()``) runs the rounds of the bare loop; ``boundary`` True with ``hold``: the step ends
  right after this micro-batch without a further backward (:meth:`close_step`, a coalesced reduction's flush), so
  no round ends by count here either (the boundary decides, as outside). With fixed accumulation the COMMIT of a
  step is launched at its boundary and nowhere else
  (``schedule.plan_boundary``), whatever the number of micro-batches the step took; acco's PEEK rounds
  end after their share of micro-batches. With adaptive accumulation rounds end when they have their
  share and the previous round's communication is done; the boundary does not end them.
- ``end_step()`` when the engine ends the step with no further micro-batch (its optimizer step was called
  while the accumulation was still open, or the flush of a coalesced reduction).
- ``on_engine_step()`` each time the engine's optimizer step is called (LR bookkeeping).
- ``sync_in_flight()`` before reading the committed state (accessors, checkpoints): waits for the
  job in flight without changing what the next round computes at.
- ``finish()`` at the end of training: ends the work in flight and loads the committed
  parameters theta into the model. Collective.

Stream contract: the compute side (the caller's thread / current CUDA stream) owns the MODEL and
ACC buffers of the current round (``core.buffers``). A round end hands the ACC buffer (and, with
bf16 parameters and fp32 communication, a parameter buffer the model does not use) to the
communication side (``core.comm`` executor), which reduce-scatters the gradients in place, steps
the sharded AdamW and all-gathers the new parameters in place. The next round end waits for the job
(an event on CUDA: the compute stream waits, the host does not) and re-points the model's
parameters at the gathered buffer; the buffer the model computed at becomes the next ACC (zeroed on
the compute stream, after the kernels that read it). No copy of a full buffer at a round end.

Host reads (CUDA: the host never waits for the job whose parameters the next round needs). A job
leaves its few figures (skip, empty, counts) in a host summary written after the job on the side
stream (``RoundResult``). With ``defer_host_reads`` (the default on CUDA) a summary is read one job
later, at the round end after the one that swapped the job in: by then the compute stream has waited
for that job a round ago, so the read finds it complete unless the host runs more than a round ahead
of the device (then it waits, with a round of work queued on the GPU). The bookkeeping that depends
on those figures (committed/applied steps, skips, stats) is done at that read. The reported grad norm
is not: it is selected on the device when a commit is swapped in, so a step reports the norm of the
commit it waited for (sync: its own) on every device. Nor is a commit's skip: the engine's optimizer step reads
the summaries of the commits swapped in so far (``read_swapped_commits``), so a skip reaches the engine at the
step that swapped its commit in on every device (sync: its own step, as ZeRO-1). What the next job needs from
them, the AdamW step count and the settings of the LR schedule at
that count, is decided on the device: the pipeline keeps the applied-commit count as the side stream
sees it (``applied_dev``) and hands each job a table of AdamW scalars for every count the unread
commits could have left; the job picks its row on the device (``round_job``). ``stats.comm_wait_s``
is the time the host spent in those waits and reads (on CPU: the time the compute thread blocks).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, List, Sequence

import torch
import torch.distributed as dist

from acco_ds.config import ACCOConfig, ACCOConfigError
from acco_ds.core import schedule
from acco_ds.core.buffers import GroupBuffers, GroupLayout
from acco_ds.core.comm import (
    check_reducible,
    make_control_group,
    make_executor,
    new_subgroup,
    release_groups,
)
from acco_ds.core.compressed_comm import Compression
from acco_ds.core.draining import Draining
from acco_ds.core.fused_round_end import BlockOwners, FusedRoundEnd, ResidualRelease
from acco_ds.core.host_step import OffloadSpec
from acco_ds.core.in_flight import InFlight
from acco_ds.core.liveness import BlockBoard
from acco_ds.core.loss_scale import DeviceLossScaler, LossScaleSpec
from acco_ds.core.round_hypers import RoundHypers
from acco_ds.core.round_job import make_host_step, run_round_job
from acco_ds.core.round_scale import RoundScale
from acco_ds.core.round_schedule import RoundSchedule
from acco_ds.core.schedule import Job
from acco_ds.ops.adamw_settings import AdamWSettings

DEFER_HOST_READS_ENV = "ACCO_DS_DEFER_HOST_READS"
"""Set to 1, CPU ranks read each job's host summary one job late, as CUDA ranks always do (a CPU test mode)."""

UNDECLARED = object()
"""``on_backward_start``'s default ``boundary``: the caller does not say what the micro-batch's end will be."""


@dataclass
class PipelineStats:
    """ACCO's own figures (per rank unless said global)."""

    rounds: int = 0
    optimizer_steps: int = 0  # optimizer steps the caller ended (on_engine_step calls), LR-stepped or not
    micro_batches_local: int = 0
    micro_batches_held: int = 0  # micro-batches ended inside no_sync() or a coalesced reduction
    micro_batches_committed: int = 0  # global: micro-batches that entered applied commits
    micro_batches_peeked: int = 0  # global: micro-batches that entered peeks
    micro_batches_discarded: int = 0  # global: gradients of rounds that end no commit (end of run)
    comm_wait_s: float = 0.0
    # seconds the training thread spent inside round ends (``end_round``), its waits for jobs (comm_wait_s) not
    # counted: what it did between two of its own kernel launches. The round job is not part of it: the
    # executor's worker thread runs (CPU) or enqueues (CUDA) it (core.comm)
    round_end_host_s: float = 0.0
    skipped_steps: int = 0  # commits skipped for a non-finite gradient (state and parameters unchanged)
    skipped_peeks: int = 0  # peeks skipped for a non-finite g~ (the estimate is then theta itself)
    empty_commits: int = 0  # commits with no micro-batch on any rank (ended by a drain): no-ops
    fused_round_ends: int = 0  # compressed rounds quantized in their last backward (core.fused_round_end)
    last_round_counts: List[int] = field(default_factory=list)
    # bytes this rank put on / took off the wire in its rounds' gradient exchange and parameter all-gather,
    # counted at the send/receive calls (core.compressed_comm.Traffic); totals and the last round read
    bytes_sent: int = 0
    bytes_received: int = 0
    last_round_bytes_sent: int = 0
    last_round_bytes_received: int = 0
    # seconds this rank's jobs spent in each phase (core.phase_clock: the worker thread's clock on the CPU, the side
    # stream's timing events on CUDA), summed over the rounds read so far
    job_reduce_scatter_s: float = 0.0
    job_norm_s: float = 0.0
    job_step_s: float = 0.0
    job_all_gather_s: float = 0.0
    # optimizer offload (core.host_step): the copies of the step's inputs to the host, and of its output back
    job_to_host_s: float = 0.0
    job_to_device_s: float = 0.0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def dtype_of(name: str, param_dtype: torch.dtype) -> torch.dtype:
    return {"auto": param_dtype, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Parameter and communication dtypes of the buffers and the fused AdamW (fp32 master in any case)."""


def check_dtypes(
    param_dtype: torch.dtype, comm_dtype: torch.dtype, option: str, loss_scale: LossScaleSpec | None = None
) -> None:
    """Raise ACCOConfigError unless the model's parameters and the resolved comm dtype are fp32, bf16 or fp16, fp16
    parameters come with a loss scaler (fp16 gradients underflow without one), and fp16 and bf16 are not mixed (an
    fp16 gradient folded into bf16 loses the precision the loss scale bought; a bf16 one into fp16 overflows)."""
    if param_dtype not in SUPPORTED_DTYPES:
        raise ACCOConfigError(
            f"the model's trainable parameters are {param_dtype}: ACCO keeps parameters in fp32, bf16 or fp16 "
            '(bf16 with "bf16": {"enabled": true}, fp16 with "fp16": {"enabled": true}). Allowed: a float32, '
            "bfloat16 or float16 model (e.g. model.float())."
        )
    if comm_dtype not in SUPPORTED_DTYPES:
        raise ACCOConfigError(
            f"optimizer.params.comm_dtype={option!r} resolves to {comm_dtype}. Allowed: 'auto' (the parameters' "
            "dtype), 'bf16', 'fp16' or 'fp32'."
        )
    if param_dtype == torch.float16 and loss_scale is None:
        raise ACCOConfigError(
            "the model's trainable parameters are torch.float16 but fp16 training is off: fp16 gradients need "
            'loss scaling. Allowed: "fp16": {"enabled": true} (DeepSpeed casts the model and ACCO scales the '
            'loss), or a float32 / bfloat16 model ("bf16": {"enabled": true}).'
        )
    if {param_dtype, comm_dtype} == {torch.float16, torch.bfloat16}:
        raise ACCOConfigError(
            f"optimizer.params.comm_dtype={option!r} resolves to {comm_dtype} with {param_dtype} parameters: fp16 "
            "and bf16 do not mix (a scaled fp16 gradient loses in bf16 the precision its scale bought). "
            "Allowed: comm_dtype 'auto' or 'fp32' (or the parameters' own dtype)."
        )


class ACCOPipeline(RoundSchedule, RoundScale, InFlight, RoundHypers, Draining):
    """See the module docstring. ``hypers`` returns the current AdamW settings per group.

    The facade the optimizer and the tests drive, built from parts with one job each, every one a mixin over this
    object's state (the attributes each owns are listed in its module's docstring):

    - here: the buffers, the executor and the groups it communicates in (set up once, in ``__init__``), the
      compute side's micro-batch start (:meth:`on_backward_start`, a fused round end's start) and the round end
      itself (:meth:`end_round`: the swap-in, the launch of the round's ``run_round_job``, the next buffer);
    - ``core.round_schedule.RoundSchedule``: where rounds and steps end (a state machine over micro-batch ends);
    - ``core.round_scale.RoundScale``: fp16's loss scale of each round and the scaler's update per commit;
    - ``core.in_flight.InFlight``: the job in flight, its swap-in, its summaries and their accounting;
    - ``core.round_hypers.RoundHypers``: the AdamW settings per applied-commit count (the LR schedule);
    - ``core.draining.Draining``: the end of a run, the ranks' agreement on the round count, restart."""

    def __init__(
        self,
        groups_params: Sequence[List[torch.nn.Parameter]],
        hypers: Callable[[], List[AdamWSettings]],
        cfg: ACCOConfig,
        gradient_accumulation_steps: int,
        clip: float,
        dp_group=None,
        tp_group=None,
        tp_sharded: Sequence[Sequence[bool]] | None = None,
        loss_scale: LossScaleSpec | None = None,
        offload: OffloadSpec | None = None,
    ):
        """``dp_group``: the data-parallel group ACCO shards over and communicates in (default: WORLD).
        ``tp_group``: the tensor-parallel group of this rank, when the model is tensor-parallel; then
        each rank's buffers hold its own slice of the parameters, and ``tp_sharded[g][i]`` says whether
        parameter i of group g is split across the tensor-parallel ranks (True) or replicated on each
        (False): the global gradient norm counts a split parameter on every tensor-parallel rank and a
        replicated one once (tensor-parallel rank 0), as DeepSpeed's ZeRO-1 does.
        ``loss_scale``: fp16 training's loss scaler (``core.loss_scale``; docs/ALGORITHM.md, "fp16: loss scaling"):
        the caller multiplies each loss by :meth:`scale_loss`; None without loss scaling.
        ``offload``: optimizer offload (``core.host_step``; docs/OFFLOAD.md): every group's fp32 master shard and
        moments live in host memory and the round's job steps them there (``offload.staged``: with staged copies,
        always on GPU ranks); None keeps them beside the parameters."""
        self.cfg = cfg
        self.mode = cfg.mode
        self.adaptive = cfg.accumulation == "adaptive"
        self.gas = gradient_accumulation_steps
        self.clip = float(clip or 0.0)
        self.dp_group = dp_group
        self.world_size = dist.get_world_size(dp_group)
        self.rank = dist.get_rank(dp_group)
        self._init_hypers(hypers, cfg.peek_lr_scale)
        self._init_schedule(
            schedule.micro_batches_per_round(self.mode, self.gas), cfg.max_micro_batches_per_round
        )
        first = groups_params[0][0]
        self.device = first.device
        comm_dtype = dtype_of(cfg.comm_dtype, first.dtype)
        check_dtypes(first.dtype, comm_dtype, cfg.comm_dtype, loss_scale)
        self.scaler = None if loss_scale is None else DeviceLossScaler(loss_scale, self.device)
        comp = cfg.compression
        if comp.enabled and self.device.type not in ("cpu", "cuda"):
            raise ACCOConfigError(
                f"optimizer.params.compression={{'commit': {comp.commit!r}, 'peek': {comp.peek!r}, "
                f"'all_gather': {comp.all_gather!r}}} on a "
                f"{self.device.type} device: compressed rounds are built for CPU (gloo) and CUDA (NCCL) ranks. "
                "Allowed here: 'none' for commit, peek and all_gather."
            )
        self.groups = [
            GroupBuffers(
                list(ps),
                GroupLayout.build(ps, self.world_size),
                self.rank,
                comm_dtype,
                keep_tilde=self.mode == "acco",
                overlapped=self.mode != "sync",
                state_device="cpu" if offload is not None else None,
            )
            for ps in groups_params
        ]
        self.offload = offload
        for b in self.groups:
            b.install_fold_hooks()
        self._init_compression(comp, comm_dtype)
        # the host step's staging buffers, allocated here for every job to come (core.host_step)
        self.host_step = (
            make_host_step(
                self.groups,
                self.device,
                offload,
                self.compression,
                self.world_size,
                tp_group,
                cfg.comm_timeout_s,
            )
            if offload is not None and offload.staged
            else None
        )
        self._init_groups(dp_group, tp_group, tp_sharded, comm_dtype)
        self.round_index = 0  # rounds launched since the start (global, for names and stats)
        self.commits_launched = 0  # index of the next commit (a peek predicts this one)
        self.memory_state = None  # core.commit_records.MemoryState: the committed state kept in node memory
        self._init_in_flight(self.device.type == "cuda" or os.environ.get(DEFER_HOST_READS_ENV, "0") == "1")
        self.tilde_count = [torch.zeros(1, dtype=torch.float64, device=self.device)]
        # applied commits as the side stream sees them (the jobs run in order and add to it)
        self.applied_dev = [torch.zeros(1, dtype=torch.float64, device=self.device)]
        self.viewing_committed = (
            False  # the model's parameters view theta for evaluation (core.committed_view)
        )
        self.stats = PipelineStats()
        # fused round ends (core.fused_round_end): the one in progress and the block owners of each group (built
        # at the first); the residual releases of the job in flight are core.in_flight's
        self._fused: FusedRoundEnd | None = None
        self._block_owners: List[BlockOwners] | None = None

    def _init_compression(self, comp, comm_dtype: torch.dtype) -> None:
        """The compression of each job kind (``compression``: None where it sends full-precision values) and the
        error-feedback state: ``residuals`` and, fp16, ``residual_scales`` (``core.round_scale``)."""
        # error feedback (compressed rounds): per group, what quantization withheld from the rounds sent so
        # far, full size in the comm dtype; written by the jobs (comm side), read by snapshots when drained
        bits = {"int8": 8, "int4": 4, "none": 8}
        self.compression = {
            job: Compression(
                comp.block_size,
                comp.error_feedback,
                gradients=grads != "none",
                parameters=comp.all_gather != "none",
                gradient_bits=bits[grads],
                parameter_bits=bits[comp.all_gather],
            )
            if grads != "none" or comp.all_gather != "none"
            else None
            for job, grads in ((Job.COMMIT, comp.commit), (Job.PEEK, comp.peek))
        }
        self.residuals: List[torch.Tensor | None] = [
            torch.zeros(b.layout.padded_numel, dtype=comm_dtype, device=self.device)
            if comp.compresses_gradients and comp.error_feedback
            else None
            for b in self.groups
        ]
        # fp16: the loss scale each residual is expressed in (core.loss_scale.express_residual)
        self.residual_scales: List[torch.Tensor | None] = [
            None
            if r is None or self.scaler is None
            else torch.full((1,), float(self.scaler.spec.init_scale), dtype=torch.float64, device=self.device)
            for r in self.residuals
        ]

    def _init_groups(self, dp_group, tp_group, tp_sharded, comm_dtype: torch.dtype) -> None:
        """The executor (the job's group), the control groups of the compute side's agreements, the
        tensor-parallel norm group with its first collective, the drain's block board; then checks that the job's
        group reduces ``comm_dtype``. Collective (every data-parallel and tensor-parallel rank builds the same)."""
        cfg = self.cfg
        self.executor = make_executor(self.device, cfg.comm_timeout_s, dp_group)
        self.control_group = make_control_group(dp_group, cfg.comm_timeout_s)
        self.tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
        self.tp_norm_group = self.tp_control_group = None
        if self.tp_size > 1:
            # groups of their own: the compute side's tensor-parallel collectives use DeepSpeed's group
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            self.tp_norm_group = new_subgroup(tp_group, backend, cfg.comm_timeout_s)
            # its first collective here, on the job's device: NCCL creates a group's communicator lazily, at its
            # first collective, which would otherwise be a job's norm while the compute side runs tensor-parallel
            # collectives on DeepSpeed's group
            dist.all_reduce(torch.zeros(1, device=self.device), group=self.tp_norm_group)
            self.tp_control_group = make_control_group(tp_group, cfg.comm_timeout_s)
            tp_rank = dist.get_rank(tp_group)
            for b, flags in zip(self.groups, tp_sharded or [[True] * len(b.params) for b in self.groups]):
                b.set_norm_ranges(flags, count_replicated=tp_rank == 0)
        self._board = BlockBoard(getattr(self.executor, "monitor", None))
        try:
            check_reducible(self.executor.group, comm_dtype, self.device, cfg.comm_dtype)
        except ACCOConfigError:
            self.executor.close()
            raise

    # -- compute side -------------------------------------------------------------------------
    def on_backward_start(self, boundary=UNDECLARED, hold: bool = False) -> None:
        """Before a micro-batch's backward: ``.grad`` views into the ACC buffer (user code or
        ``engine.zero_grad()`` may have set them to None; the accumulated sum lives in the buffer).

        ``boundary`` / ``hold``: what the caller will pass to :meth:`on_micro_batch_end` after this backward,
        declared now (the DeepSpeed engine knows its boundary before the backward). With them, a micro-batch that
        will end a compressed round (fixed accumulation) quantizes the round's gradients as its backward produces
        them (``core.fused_round_end``); :meth:`on_micro_batch_end` must then end that round as declared.
        Undeclared (the default), the round's job quantizes them.

        sync (DeepSpeed ZeRO-1's semantics): when every ``.grad`` was set to None since the last
        backward (``engine.zero_grad()``) while the step holds micro-batches, their gradients are dropped,
        as ZeRO-1 drops the gradients it accumulates in ``.grad`` before the boundary. The step still ends
        where the engine says. acco/dpu keep them (their rounds are not the engine's accumulation).
        Parameters and gradients of different dtypes never show a ``.grad``: nothing is dropped there."""
        if self.viewing_committed:
            raise RuntimeError(
                "acco_ds: backward while the model shows the committed weights for evaluation "
                "(engine.optimizer.eval() or committed_weights()): the forward ran at the wrong weights. Call "
                "engine.optimizer.train() (the HF Trainer does) or leave the committed_weights() block before "
                "training; engine.train() / module.train() switch back at the next forward."
            )
        if self._fused is not None:
            raise RuntimeError(
                "acco_ds: a backward started while the previous micro-batch's fused round end is unfinished (its "
                "backward failed or on_micro_batch_end was not called): the round's gradients are partly quantized "
                "and cannot be recovered. Restart from a checkpoint."
            )
        # a backward after the boundary's with no engine.step() between: the pending step ends first
        if self.boundary_pending:
            self.end_step()
        if self.mode == "sync" and self.counter.count > 0 and self._grads_cleared():
            for b in self.groups:
                b.acc_flat.zero_()
        for b in self.groups:
            b.point_grads()
        if boundary is not UNDECLARED:
            self._begin_fused_round_end(boundary, hold)

    def adopt_grads(self) -> None:
        """A backward ran without :meth:`on_backward_start` (a bare ``loss.backward()`` through a module called
        directly, no engine hook on its loss): where a ``.grad`` was None at its start, autograd created a fresh
        tensor holding this backward's gradient; it joins the round's buffer and ``.grad`` is ACCO's view again
        (``GroupBuffers.adopt_grads``), as if the start had pointed it there. Compute side, before
        :meth:`on_micro_batch_end`. A deferred sync boundary has no engine.step() yet: its step cannot take
        gradients of the next micro-batch, so that is an error naming the fix."""
        if self.boundary_pending:
            raise RuntimeError(
                "acco_ds: a backward without engine.backward() after the accumulation boundary's backward and "
                "before engine.step(): its gradients would join the finished step. Call engine.step() after the "
                "boundary's backward, or run backward through engine.backward(loss)."
            )
        for b in self.groups:
            b.adopt_grads()

    def _begin_fused_round_end(self, boundary, hold: bool) -> None:
        plan = self._predicted_round_end(boundary, hold)
        if plan is None or not self.cfg.compression.fuse_round_end:
            return
        comp = self.compression[plan.job]
        if comp is None or not comp.gradients:
            return
        if self.mode == "sync" and self.counter.count + 1 != self.gas:
            return  # a short sync step scales its buffer before the job (end_round): that job quantizes
        if self._block_owners is None:
            self._block_owners = [BlockOwners(b, comp.block_size) for b in self.groups]
        ticket = None if self.in_flight is None else self.in_flight[0]
        self._fused = FusedRoundEnd(
            plan,
            self.groups,
            self._block_owners,
            comp,
            self.residuals,
            self._in_flight_releases if ticket is not None else None,
            (lambda: self.executor.done(ticket)) if ticket is not None else (lambda: True),
            self.cfg.comm_timeout_s,
            None if self.scaler is None else (self.residual_scales, self.scaler.job_scale()[0:1]),
        )
        self._fused.begin()

    def _grads_cleared(self) -> bool:
        return all(b.shared for b in self.groups) and all(
            p.grad is None for b in self.groups for p in b.params
        )

    def end_round(self, plan: schedule.RoundEnd | None = None) -> None:
        """End the current round: swap in the job in flight, launch this round's job (``plan``, default
        ``schedule.plan`` of the round), give the next round a zeroed gradient buffer.

        A COMMIT of the round's gradient ``alone`` (acco, ``schedule.plan_boundary``) zeroes the kept g~
        and its count first (the job in flight, which consumed them, has been waited for) and makes the
        next round a prologue. In sync a step of s != GAS micro-batches is scaled by s / GAS before the
        job: the job divides by the micro-batch count, DeepSpeed's ZeRO-1 by W * GAS whatever the count
        (``engine.backward`` divided every loss by GAS); so a short step's gradient is sum / (W * GAS),
        as ZeRO-1's."""
        t0, waited0 = time.perf_counter(), self.stats.comm_wait_s
        try:
            self._end_round(plan)
        finally:
            self.stats.round_end_host_s += time.perf_counter() - t0 - (self.stats.comm_wait_s - waited0)

    def _end_round(self, plan: schedule.RoundEnd | None) -> None:
        if plan is None:
            plan = schedule.plan(self.mode, self.phase_round)
        if plan.wait_previous:
            blocking = self.counter.cap is not None and not self._in_flight_done()
            if blocking:  # at the cap: a draining peer must see that this rank waits for its launch
                self._board.post(self.round_index)
            self._finish_in_flight()
            if blocking:
                self._board.post(None)
        self._read_summaries(keep=1 if self.defer_host_reads else 0)
        if plan.alone:
            for b in self.groups:
                if b.tilde is not None:
                    b.tilde.zero_()
            self.tilde_count[0] = torch.zeros(1, dtype=torch.float64, device=self.device)
        if self.mode == "sync" and 0 < self.counter.count != self.gas:
            for b in self.groups:
                b.acc_flat.mul_(self.counter.count / self.gas)
        prequantized = None
        if self._fused is not None:
            fused, self._fused = self._fused, None
            if (fused.plan.job, fused.plan.alone) != (plan.job, plan.alone):
                fused.abandon()
                raise RuntimeError(
                    f"acco_ds: the round ends with a {plan.job.value} where its last backward was declared to end "
                    f"it with a {fused.plan.job.value}; its gradients were quantized for that one. Restart from a "
                    "checkpoint, or set optimizer.params.compression.fuse_round_end=false."
                )
            prequantized = fused.finish()
            self.stats.fused_round_ends += 1
        releases = (
            [ResidualRelease(self.device) for _ in self.groups]
            if any(r is not None for r in self.residuals)
            else None
        )
        commit_index = self.commits_launched
        roles = [b.start_job(in_place=plan.wait_now) for b in self.groups]
        job = partial(
            run_round_job,
            job=plan.job,
            commit_index=commit_index,
            groups=self.groups,
            roles=roles,
            hyper_table=self._hyper_table(plan.job),
            base_applied=self.state_step,
            applied=self.applied_dev,
            local_count=self.counter.count,
            fixed_count=None if self.adaptive else self.counter.count,
            gas=self.gas,
            clip=self.clip,
            group=self.executor.group,
            norm_group=self.tp_norm_group,
            tilde_count=self.tilde_count,
            compression=self.compression[plan.job],
            residuals=self.residuals,
            bases=[b.model_flat for b in self.groups],
            prequantized=prequantized,
            releases=releases,
            offload=self.host_step,
            **self._loss_scale_args(plan),
        )
        if plan.job is Job.COMMIT and self.memory_state is not None:
            job = self.memory_state.wrap(job, commit_index)
        name = f"round {self.round_index} ({plan.job.value} of step {commit_index})"
        self.in_flight = (self.executor.launch(name, job), plan)
        self._in_flight_releases = releases
        self.stats.rounds += 1
        self.round_index += 1
        self.phase_round = 0 if plan.alone else self.phase_round + 1
        if plan.job is Job.COMMIT:
            self.commits_launched += 1
        self.counter.reset()
        if plan.wait_now:
            self._finish_in_flight()
        self._begin_round_scale()
        for b in self.groups:
            b.new_acc()
            b.point_grads()

    def close(self) -> None:
        """End the worker threads (the executor's, the host step's, the memory state's), then release the gloo
        groups the pipeline created (``core.comm.release_groups``): the pipeline runs no collective after this."""
        self.executor.close()
        if self.host_step is not None:
            self.host_step.close()
        if self.memory_state is not None:
            self.memory_state.close()
        groups = [self.executor.group, self.control_group, self.tp_norm_group, self.tp_control_group]
        if release_groups(groups, busy=self.executor.running()):
            # a group's gloo device (and its event-loop thread) lives as long as a reference to the group
            self.executor.group = self.control_group = self.tp_norm_group = self.tp_control_group = None
