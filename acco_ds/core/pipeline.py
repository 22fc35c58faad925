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
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Dict, List, Sequence

import torch
import torch.distributed as dist

from acco_ds.config import ACCOConfig, ACCOConfigError
from acco_ds.core import schedule
from acco_ds.core.buffers import GroupBuffers, GroupLayout
from acco_ds.core.comm import check_reducible, make_control_group, make_executor, new_subgroup
from acco_ds.core.compressed_comm import Compression
from acco_ds.core.fused_round_end import BlockOwners, FusedRoundEnd, ResidualRelease
from acco_ds.core.host_step import OffloadSpec
from acco_ds.core.liveness import BlockBoard
from acco_ds.core.loss_scale import DeviceLossScaler, LossScaleSpec
from acco_ds.core.round_job import RoundResult, all_gather_inplace, make_host_step, run_round_job
from acco_ds.core.schedule import Job, RoundCounter
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


class ACCOPipeline:
    """See the module docstring. ``hypers`` returns the current AdamW settings per group."""

    boundary_pending = False
    """sync: the engine's boundary has passed and the step's job waits for :meth:`end_step` (``_defer_boundary``)."""

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
        self._hypers = hypers
        share = schedule.micro_batches_per_round(self.mode, self.gas)
        self.counter = RoundCounter(share, self.adaptive, cfg.max_micro_batches_per_round)
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
        self.step_count = 0  # micro-batches of the optimizer step not yet ended by a boundary (local)
        self.round_index = 0  # rounds launched since the start (global, for names and stats)
        self.phase_round = 0  # rounds since the pipeline (re)started: what schedule.plan sees
        self.commits_launched = 0  # index of the next commit (a peek predicts this one)
        self.in_flight = None  # (Ticket, RoundEnd)
        self.model_holds = "theta"  # "theta" (committed) or "estimate" (theta~, acco)
        self.committed_steps = 0  # commits swapped in (applied or skipped)
        # applied commits as a 0-dim fp32 CPU tensor, updated in place (the "step" of optimizer.state)
        self.step_tensor = torch.zeros((), dtype=torch.float32)
        self.state_step = 0  # applied commits: the AdamW step count (a property: step_tensor follows it)
        self.engine_steps = 0  # LR-schedule steps: engine steps whose scheduler step ran (no overflow)
        self._hyper_history: Dict[int, List[AdamWSettings]] = {}
        self.tilde_count = [torch.zeros(1, dtype=torch.float64, device=self.device)]
        # applied commits as the side stream sees them (the jobs run in order and add to it)
        self.applied_dev = [torch.zeros(1, dtype=torch.float64, device=self.device)]
        self.defer_host_reads = self.device.type == "cuda" or os.environ.get(DEFER_HOST_READS_ENV, "0") == "1"
        self._unread: deque = deque()  # results swapped in whose summary is not read yet (oldest first)
        self.viewing_committed = (
            False  # the model's parameters view theta for evaluation (core.committed_view)
        )
        self.last_grad_norm: torch.Tensor | None = None
        self.stats = PipelineStats()
        # fused round ends (core.fused_round_end): the one in progress, the block owners of each group (built
        # at the first), and the residual releases of the job in flight
        self._fused: FusedRoundEnd | None = None
        self._block_owners: List[BlockOwners] | None = None
        self._in_flight_releases: List[ResidualRelease] | None = None

    @property
    def state_step(self) -> int:
        """Commits applied to the sharded state (swapped in and read): AdamW's step count."""
        return self._state_step

    @state_step.setter
    def state_step(self, value: int) -> None:
        self._state_step = int(value)
        self.step_tensor.fill_(float(value))

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

    def _predicted_round_end(self, boundary, hold: bool) -> schedule.RoundEnd | None:
        """The round end :meth:`on_micro_batch_end` will make after this micro-batch, given what the caller
        declared; None where it ends no round or is not known before the backward (adaptive accumulation)."""
        if self.adaptive:
            return None
        if hold and boundary:
            return None  # the step ends at close_step, right after this micro-batch
        ends_step = not hold and (self.step_count + 1 >= self.gas if boundary is None else bool(boundary))
        if ends_step:
            return schedule.plan_boundary(self.mode, self.phase_round)
        if (
            schedule.ends_by_count(self.mode, self.phase_round, False)
            and self.counter.count + 1 >= self.counter.share
        ):
            return schedule.plan(self.mode, self.phase_round)
        return None

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

    def on_micro_batch_end(self, boundary: bool | None = None, hold: bool = False) -> None:
        """After a micro-batch's backward (see the module docstring for ``boundary`` and ``hold``)."""
        self._micro_batch_end(boundary, hold)
        if self._fused is not None:
            self._fused.abandon()
            self._fused = None
            raise RuntimeError(
                f"acco_ds: on_micro_batch_end(boundary={boundary!r}, hold={hold!r}) did not end the round that "
                "on_backward_start declared this micro-batch would end (the engine's accumulation boundary or "
                "no_sync() changed during the backward?); the round's gradients were quantized as they arrived and "
                "cannot be recovered. Restart from a checkpoint; declare to on_backward_start what "
                "on_micro_batch_end will be told, or set optimizer.params.compression.fuse_round_end=false."
            )

    def _micro_batch_end(self, boundary: bool | None, hold: bool) -> None:
        self._record_hypers()
        for b in self.groups:
            b.check_grads()
        self.counter.add()
        self.step_count += 1
        self.stats.micro_batches_local += 1
        if hold:
            # no step ends inside no_sync(): only a round that ends by its count (a PEEK, adaptive rounds)
            self.stats.micro_batches_held += 1
            if (self.adaptive or not boundary) and self._may_end():
                self.end_round()
            return
        declared = boundary is not None  # the engine's word: its optimizer step follows (end_step)
        if boundary is None:
            boundary = self.step_count >= self.gas
        if boundary and self._boundary_ends_rounds():
            if not (declared and self._defer_boundary()):
                self._end_step_round()
            return
        if boundary:
            self.step_count = 0
        if self._may_end():
            self.end_round()

    def end_step(self) -> None:
        """The engine ends the optimizer step with no further micro-batch: as a boundary at the last one.
        Nothing happens when the step has no micro-batch left open (its boundary already ended it)."""
        if self.step_count == 0:
            return
        if self._boundary_ends_rounds():
            self._end_step_round()
        else:
            self.step_count = 0

    def _boundary_ends_rounds(self) -> bool:
        """Fixed accumulation: a step's COMMIT is launched at the engine's boundary. Adaptive: rounds end
        on their own (count and communication); the boundary only moves the LR schedule."""
        return not self.adaptive

    def _end_step_round(self) -> None:
        self.boundary_pending = False
        self.end_round(schedule.plan_boundary(self.mode, self.phase_round))
        self.step_count = 0

    def _defer_boundary(self) -> bool:
        """sync, at a boundary the caller declared (the engine's): leave the step's round open
        (``boundary_pending``) and launch its job at :meth:`end_step`, the engine's optimizer step, where ZeRO-1
        steps: in between, the round's buffer holds the step's gradient for DeepSpeed's gradient accessors
        (``acco_ds.deepspeed.accessors``). The same job on the same buffer, launched later: the trajectory does not
        change. Not where this backward quantized the round's gradients (a fused round end: that round ends now).
        Returns whether the round end was deferred."""
        if self.mode != "sync" or self._fused is not None:
            return False
        self.boundary_pending = True
        return True

    def close_step(self) -> None:
        """The engine's accumulation ends with no further micro-batch (the flush of a coalesced reduction): a
        boundary, deferred in sync as at a marked backward (``_defer_boundary``), else :meth:`end_step`."""
        if self.step_count and self._boundary_ends_rounds() and self._defer_boundary():
            return
        self.end_step()

    def _may_end(self) -> bool:
        """Whether the current round ends now, before the engine's boundary (``schedule.ends_by_count``:
        acco's PEEK rounds with fixed accumulation, every round with adaptive accumulation, once they hold
        their share and, adaptive, the job in flight is done). Adaptive accumulation with tensor parallelism: the ranks
        of a tensor-parallel group run collectives in every forward and backward, so they must end their
        rounds at the same micro-batch: the round ends when it may end on every one of them (their
        counts are equal, so only whether each one's job in flight is done differs)."""
        if not schedule.ends_by_count(self.mode, self.phase_round, self.adaptive):
            return False
        may = self.counter.may_end(self._in_flight_done())
        if not (self.adaptive and self.tp_control_group is not None):
            return may
        flag = torch.tensor([1.0 if may else 0.0], dtype=torch.float64)
        self._control_all_reduce(
            flag, dist.ReduceOp.MIN, "the tensor-parallel agreement on a round end", tp=True
        )
        return bool(flag.item())

    def on_engine_step(self, lr_stepped: bool = True) -> None:
        """The engine's optimizer step was called; ``lr_stepped``: its LR scheduler steps right after
        (DeepSpeed skips the scheduler step when the optimizer reports ``overflow``)."""
        self.stats.optimizer_steps += 1
        if lr_stepped:
            self.engine_steps += 1

    def _in_flight_done(self) -> bool:
        return self.in_flight is None or self.executor.done(self.in_flight[0])

    def _record_hypers(self) -> None:
        if self.engine_steps not in self._hyper_history:
            self._hyper_history[self.engine_steps] = list(self._hypers())

    def _hypers_for(self, applied: int) -> List[AdamWSettings]:
        """The AdamW settings of the next commit (and of the peek predicting it) when ``applied``
        commits have been applied: the LR schedule advances once per APPLIED step, so this commit
        uses the settings the engine had after ``applied`` scheduler steps (adaptive rounds may lag
        behind the engine's steps; a skipped commit does not advance the schedule)."""
        self._record_hypers()
        hyp = self._hyper_history.get(applied)
        if hyp is None:
            older = [k for k in self._hyper_history if k <= applied]
            hyp = self._hyper_history[max(older) if older else min(self._hyper_history)]
        return hyp

    def _hyper_table(self) -> List[List[tuple]]:
        """Per group, the AdamW scalars (``hyper_scalars``) of the next job for every applied count it
        may find on the device: ``state_step`` (read) plus 0 .. the commits whose summary is unread."""
        unknown = sum(1 for r in self._unread if r.job is Job.COMMIT)
        if self.in_flight is not None and self.in_flight[1].job is Job.COMMIT:
            unknown += 1
        rows = []
        for applied in range(self.state_step, self.state_step + unknown + 1):
            rows.append([h.hyper_scalars(applied + 1) for h in self._hypers_for(applied)])
        for k in [k for k in self._hyper_history if k < self.state_step]:
            del self._hyper_history[k]
        return [[row[g] for row in rows] for g in range(len(self.groups))]

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
            hyper_table=self._hyper_table(),
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

    # -- fp16 loss scaling (core.loss_scale) ----------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to run backward on: times the scale of the round in progress (fp16), else ``loss`` itself."""
        return loss if self.scaler is None else self.scaler.scale_loss(loss)

    def _loss_scale_args(self, plan: schedule.RoundEnd) -> dict:
        """A job's loss-scale arguments: the scale its gradients were computed under; sync unscales a step by the
        scale after the step's own update, as ZeRO-1 does (``loss_scale.ready_scale``)."""
        if self.scaler is None:
            return {}
        args = {"loss_scale": self.scaler.job_scale(), "residual_scales": self.residual_scales}
        if plan.job is Job.COMMIT:
            args["scaler"] = (self.scaler.spec, self.scaler.state)
            args["unscale_ready"] = self.mode == "sync"
        args["predivide"] = self._predivides(plan.job)
        if plan.job is Job.COMMIT and self.mode == "acco":
            w = float(self.world_size)
            # the kept g~ in this commit's units: predivided by W exactly where the commit's gradients are
            args["tilde_factor"] = (w if self._predivides(Job.PEEK) else 1.0) / (
                w if args["predivide"] else 1.0
            )
        return args

    def _predivides(self, job: Job) -> bool:
        """fp16 rounds whose gradients are reduced uncompressed divide them by W first, as ZeRO-1
        (``run_round_job(predivide=)``); compressed ones sum dequantized fp32 values, which do not overflow."""
        comp = self.compression[job]
        return self.scaler is not None and self.world_size > 1 and (comp is None or not comp.gradients)

    def _begin_round_scale(self) -> None:
        """The round starting now computes under the scaler's current scale, except acco's rounds of g (odd phase):
        they keep the scale of the g~ round their commit adds them to."""
        if self.scaler is not None:
            self.scaler.begin_round(refresh=self.mode != "acco" or self.phase_round % 2 == 0)

    def _apply_loss_scale(self, result: RoundResult) -> None:
        """A commit swapped in: its outcome updates the scaler (on the device, after the compute stream waited for
        its job). An empty commit says nothing about the scale."""
        if self.scaler is None or result.job is not Job.COMMIT or result.loss_scale is None:
            return
        if result.next_scaler_state is not None:
            if self.scaler.adopt(result.scaler_state, result.next_scaler_state):
                return
            result.at_min = None  # the state applied here is not the job's: check() reads it
        if result.skipped_flag is not None and result.empty_flag is not None:
            overflow, empty = result.skipped_flag, result.empty_flag
        else:  # restored from a checkpoint: the summary is on the host and complete
            overflow = torch.tensor([result.skipped], device=self.device)
            empty = torch.tensor([result.empty], device=self.device)
        self.scaler.apply(result.loss_scale, overflow & ~empty, empty)

    def _finish_in_flight(self) -> RoundResult | None:
        """Wait for the job in flight (CUDA: the compute stream waits on its event, the host does not)
        and make its gathered parameters the model's. Its bookkeeping follows when its summary is read
        (at once, or one job later with ``defer_host_reads``)."""
        if self.in_flight is None:
            return None
        ticket, _ = self.in_flight
        t0 = time.perf_counter()
        result: RoundResult = self.executor.wait(ticket)
        self.stats.comm_wait_s += time.perf_counter() - t0
        self.in_flight = None
        self._in_flight_releases = None
        for b in self.groups:
            b.finish_job()
            b.point_params()
        self.viewing_committed = False
        self.model_holds = "theta" if result.job is Job.COMMIT else "estimate"
        if result.job is Job.COMMIT:
            self._report_norm(result)
        self._apply_loss_scale(result)
        self._unread.append(result)
        self._read_summaries(keep=1 if self.defer_host_reads else 0)
        return result

    def _report_norm(self, result: RoundResult) -> None:
        """``last_grad_norm`` once a commit is swapped in (the compute stream has waited for its job): the
        commit's global gradient norm (inf/NaN for a skipped one), or the previous norm when the commit was
        empty. Selected on the device, never read on the host, so the norm of the commit a step waited for is
        reported at that step, as DeepSpeed's ZeRO-1 reports it, even while the summary is read a job later."""
        norm = result.grad_norm
        if self.last_grad_norm is None:
            self.last_grad_norm = norm.clone()
            return
        if result.empty_flag is not None:
            empty = result.empty_flag
        else:  # restored from a checkpoint: the summary is on the host and complete
            empty = torch.tensor([result.empty], device=norm.device)
        self.last_grad_norm = torch.where(empty, self.last_grad_norm.reshape(norm.shape), norm)

    def _read_summaries(self, keep: int = 0) -> None:
        """Read the summaries of the swapped-in jobs, oldest first, all but the newest ``keep``, and do
        their bookkeeping."""
        while len(self._unread) > keep:
            result = self._unread.popleft()
            t0 = time.perf_counter()
            result.wait_summary()
            self.stats.comm_wait_s += time.perf_counter() - t0
            self._account(result)

    def read_swapped_commits(self) -> None:
        """Read the summaries of the commits swapped in so far (and of every job before the newest of them), so
        that their skips and applied steps are counted now: the engine's optimizer step calls it before it asks
        for ``overflow``, and a commit's skip is then reported at the engine step that swapped the commit in, on
        every device, as DeepSpeed's ZeRO-1 reports an overflow at the step that made it.

        With ``defer_host_reads`` (CUDA) this is a host wait for the newest swapped-in commit's job: in sync the
        job the step just waited for (the compute stream waits for it anyway, and ZeRO-1 fp16 reads its overflow
        flag on the host at each step too), in dpu the previous step's commit, which had a round of compute to
        finish. A peek swapped in after the newest commit stays unread (acco's commits are read by then): no
        wait for a job whose communication is still meant to overlap."""
        newest = max((i for i, r in enumerate(self._unread) if r.job is Job.COMMIT), default=None)
        if newest is not None:
            self._read_summaries(keep=len(self._unread) - newest - 1)

    def _account(self, result: RoundResult) -> None:
        skipped, empty, count, round_count, *rank_counts = result.summary.tolist()
        count, round_count = int(count), int(round_count)
        self.stats.last_round_counts = [int(c) for c in rank_counts]
        if result.traffic is not None:
            self.stats.last_round_bytes_sent = result.traffic.sent
            self.stats.last_round_bytes_received = result.traffic.received
            self.stats.bytes_sent += result.traffic.sent
            self.stats.bytes_received += result.traffic.received
        if result.clock is not None:
            for phase, seconds in result.clock.seconds().items():
                name = f"job_{phase}_s"
                setattr(self.stats, name, getattr(self.stats, name) + seconds)
        if result.job is Job.COMMIT:
            self.committed_steps += 1
            if empty:  # nothing to commit: state and parameters unchanged
                self.stats.empty_commits += 1
            elif skipped:
                self.stats.skipped_steps += 1
                self.stats.micro_batches_discarded += count
            else:
                self.state_step += 1
                self.stats.micro_batches_committed += count
            if self.scaler is not None:
                self.scaler.check(None if result.at_min is None else result.at_min.tolist()[0])
        else:
            if skipped and not empty:  # non-finite g~: estimate = theta, commit skips
                self.stats.skipped_peeks += 1
            elif not empty:
                self.stats.micro_batches_peeked += round_count

    # -- draining ------------------------------------------------------------------------------
    def sync_in_flight(self) -> None:
        """Block until the job in flight has finished (its state is then readable); the schedule is
        unchanged: the gathered parameters are still swapped in at the planned round end. The
        summaries of the jobs already swapped in are read (their bookkeeping done)."""
        self._read_summaries()
        if self.in_flight is None:
            return
        ticket = self.in_flight[0]
        self.executor.wait(ticket)
        if ticket.cuda_done is not None:
            ticket.cuda_done.synchronize()

    def finish(self) -> None:
        """End of training (collective): finish the job in flight and load the committed
        parameters into the model. Gradients of rounds that no commit will use are discarded."""
        if self.boundary_pending:  # the boundary has passed: its step is committed, as with engine.step()
            self.end_step()
        if self.adaptive:
            self._agree_on_round_count()
        if self.in_flight is not None:
            self._finish_in_flight()
        self._read_summaries()
        if self.model_holds == "estimate":  # the g~ of the last peek enters no commit
            self.stats.micro_batches_discarded += int(self.tilde_count[0].item())
            self._gather_committed()
        self.stats.micro_batches_discarded += self._global_pending_count()
        self.counter.reset()
        self.step_count = 0
        for b in self.groups:
            b.acc_flat.zero_()
        self.phase_round = 0  # training may go on: it restarts with a prologue at theta
        self._begin_round_scale()

    def _control_all_reduce(self, t: torch.Tensor, op, what: str, tp: bool = False) -> None:
        """All-reduce a CPU tensor on the control group (``tp``: the tensor-parallel one; timeout
        comm_timeout_s); a failure names the lost peer like a failed round does."""
        try:
            dist.all_reduce(t, op=op, group=self.tp_control_group if tp else self.control_group)
        except RuntimeError as err:
            raise self.executor.failure(what, err) from err

    def _global_pending_count(self) -> int:
        t = torch.tensor([float(self.counter.count)], dtype=torch.float64)
        self._control_all_reduce(t, dist.ReduceOp.SUM, "the end-of-run count of pending micro-batches")
        return int(t.item())

    def _agree_on_round_count(self) -> None:
        """Adaptive ranks may be one round apart when the run stops: the ranks behind end rounds
        (with the micro-batches they have) until all have launched the same number. Collective.

        With max_micro_batches_per_round, a peer may be blocked at its cap, waiting for the job of a
        round this rank has not launched, and would never reach a blocking collective. So this rank
        first announces its round count with a non-blocking all-reduce and, until every rank has
        announced, ends a round (never blocking: only when its job in flight is done) whenever a
        blocked peer waits for more rounds than this rank has launched (``BlockBoard``; without a
        store: whenever its job in flight is done, which may end rounds no peer needed). A round no
        rank put a micro-batch in is a no-op. Then no rank is training any more, and the blocking
        agreement below is safe. Ranks that are level end no round: a drain at a point where every
        rank has launched the same rounds leaves training exactly as it was."""
        if self.counter.cap is not None:
            t = torch.tensor([float(self.round_index)], dtype=torch.float64)
            try:
                work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control_group, async_op=True)
                deadline = time.monotonic() + self.cfg.comm_timeout_s
                while not work.is_completed():
                    needed = self._board.needed()
                    behind = needed is None or needed > self.round_index
                    if behind and self.in_flight is not None and self._in_flight_done():
                        self.end_round()
                    elif time.monotonic() > deadline:
                        raise RuntimeError(
                            f"the peers did not join the drain within comm_timeout_s={self.cfg.comm_timeout_s:g} s"
                        )
                    else:
                        time.sleep(0.002)
                work.wait()
            except RuntimeError as err:
                raise self.executor.failure("the agreement on the round count", err) from err
        t = torch.tensor([float(self.round_index)], dtype=torch.float64)
        self._control_all_reduce(t, dist.ReduceOp.MAX, "the agreement on the round count")
        while self.round_index < int(t.item()):
            self.end_round()

    def _gather_committed(self) -> None:
        """Put theta (the fp32 master, cast) into the model's parameters. Collective."""
        for b in self.groups:
            b.shard_of(b.model_flat).copy_(b.master)
            all_gather_inplace(b.model_flat, self.executor.group)
        self.model_holds = "theta"

    @torch.no_grad()
    def restart(self, masters: Sequence[torch.Tensor] | None = None) -> None:
        """Start over from a committed state: nothing in flight, no pending gradients, a new prologue,
        the model at theta. ``masters``: new fp32 master shards, one per group (a loaded checkpoint);
        None takes theta from the weights the model's parameters hold now (a module-only load wrote
        them there). Adam moments and step counts are kept; the error-feedback residuals (compressed
        rounds) are zeroed: what they withheld belongs to the rounds before the restart. Collective."""
        from acco_ds.core.snapshot import drain

        drain(self)
        self.in_flight = None
        self._in_flight_releases = None
        for i, b in enumerate(self.groups):
            viewed = b.params[0].data.data_ptr()
            flat = b.model_flat
            if not flat.data_ptr() <= viewed < flat.data_ptr() + flat.numel() * flat.element_size():
                raise RuntimeError("acco_ds: the model's parameters no longer view ACCO's parameter buffer.")
            b.job = None
            if masters is None:
                b.master.copy_(b.shard_of(flat).float())
            else:
                b.master.copy_(masters[i])
            for buf in {id(t): t for t in b.param_bufs + b.grad_bufs}.values():
                if buf is not flat:
                    buf.zero_()
            b.shard_of(flat).copy_(b.master)
            all_gather_inplace(flat, self.executor.group)
            if b.tilde is not None:
                b.tilde.zero_()
            b.new_acc()
            b.point_params()
            b.point_grads()
        for residual in self.residuals:  # what earlier rounds withheld is dropped with them (a fresh start)
            if residual is not None:
                residual.zero_()
        self.model_holds = "theta"
        self.viewing_committed = False
        self.phase_round = 0
        self._begin_round_scale()
        self.counter.reset()
        self.step_count = 0
        self.boundary_pending = False
        self.tilde_count[0] = torch.zeros(1, dtype=torch.float64, device=self.device)
        self.applied_dev[0] = torch.full(
            (1,), float(self.state_step), dtype=torch.float64, device=self.device
        )

    def close(self) -> None:
        self.executor.close()
        if self.host_step is not None:
            self.host_step.close()
