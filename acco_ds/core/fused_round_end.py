"""The fused round end of a compressed round: its gradients quantized as its last micro-batch's backward produces
them (docs/ALGORITHM.md, "Kernels").

Without it, a compressed round's job (``acco_ds.core.compressed_comm.exchange_quantized_gradients``) reads the
whole gradient buffer once more, with the error-feedback residual, to quantize it. With it, when the pipeline
knows before a micro-batch's backward that this micro-batch ends the round (fixed accumulation: the engine's
boundary, or a PEEK round's count; ``ACCOPipeline.on_backward_start``), each parameter's gradient is folded into
the buffer by ``acco_ds.ops.fold_quantize.fold_quantize`` as autograd produces it: the blocks the parameter covers
whole are quantized in that pass, straight from ``buffer + grad`` and the residual, and the buffer is not written
there; the blocks it shares with a neighbour (or the padding), and those of parameters that got no gradient, are
accumulated as usual and quantized at the round end by one ``quantize_listed_blocks`` pass. The job then sends the
rows it is handed (``run_round_job(prequantized=...)``). The bits are those of the unfused round: q, scales and
residual (tests/core/test_fused_round_end.py).

Streams and ownership:

- The folds run in the gradient hooks, on the compute side (the caller's thread on CPU; the autograd engine's
  device thread, on the compute stream, on CUDA). They write the round's ACC buffer (owned by the compute side),
  the residual and this round's q / scales rows (allocated here, on the compute stream, at the first fold).
- The residual belongs to the communication side while a job that reads or writes it is in flight: every job
  releases each group's residual (:class:`ResidualRelease`) once it is done with it (right after its
  quantization, before its exchange: the wait never covers the network). The first fold of a group waits for
  that release of the job in flight (CPU: the compute thread waits; CUDA: the host waits only until the worker
  thread has enqueued the release, then the compute stream waits on its event), and raises after comm_timeout_s
  when the job neither released the residual nor finished.
- At the round end (:meth:`FusedRoundEnd.finish`, compute side) the leftover blocks are quantized and the rows are
  handed to the job, which owns them from then on (on CUDA it records its stream on them before the compute side
  drops its references).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from acco_ds.core.buffers import GroupBuffers
from acco_ds.core.compressed_comm import Compression
from acco_ds.core.loss_scale import express_residual
from acco_ds.core.schedule import RoundEnd
from acco_ds.ops.fold_quantize import FoldTarget, covered_blocks, quantize_listed_blocks
from acco_ds.ops.quantize import num_blocks


class ResidualRelease:
    """When one job is done with one group's error-feedback residual. The job calls :meth:`release` (on the
    communication side: the worker thread, or the side stream as current stream while the job is enqueued);
    the compute side calls :meth:`wait` before writing the residual."""

    def __init__(self, device: torch.device):
        self.device = device
        self._set = threading.Event()
        self._cuda_event = None

    def release(self) -> None:
        if self._set.is_set():
            return
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._cuda_event = event
        self._set.set()

    def wait(
        self,
        job_finished: Callable[[], bool],
        timeout_s: float,
        *,
        rank: int = 0,
        group: int = 0,
        phase: str = "",
    ) -> None:
        """Until the residual is released: on CUDA the current stream waits for the job's event (the job is
        enqueued by then); on CPU the calling thread waits for the worker thread, or stops waiting once the job
        has finished without releasing (it failed: its error surfaces where the round end waits for it).

        Raises RuntimeError naming ``rank``, ``group`` (the parameter group's index) and ``phase`` (what the
        caller was about to do) when the job neither released the residual nor finished within ``timeout_s``
        (comm_timeout_s): the job may still write the residual, so the caller must not."""
        deadline = time.monotonic() + timeout_s
        while not self._set.wait(0.01):
            if job_finished():
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"acco_ds: rank {rank}: {phase or 'a write of the residual'} waited comm_timeout_s={timeout_s:g}"
                    f" s for the communication job in flight to release parameter group {group}'s error-feedback "
                    "residual; the job has neither released it nor finished (a peer lost or stalled, or the job "
                    "is stuck), and writing the residual now would race the job's own write of it. If no peer is "
                    "lost and your link is that slow, raise optimizer.params.comm_timeout_s."
                )
        if self._cuda_event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._cuda_event)


def _rank(buffers: GroupBuffers) -> int:
    """This process's global rank where the default group is up, else its rank in the group's data-parallel layout."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else buffers.rank


class BlockOwners:
    """Which parameter of a group covers each quantization block whole (-1: none: a block shared by two
    parameters, or by a parameter and the padding, or padding only). Built once per group and block size."""

    def __init__(self, buffers: GroupBuffers, block_size: int):
        layout = buffers.layout
        self.chunk = layout.shard_numel
        self.blocks_per_chunk = num_blocks(self.chunk, block_size)
        self.total = layout.world_size * self.blocks_per_chunk
        owner = torch.full((self.total,), -1, dtype=torch.int64)
        for i, (off, numel) in enumerate(zip(layout.offsets, layout.numels)):
            for _, _, inner_first, inner_stop in covered_blocks(off, numel, self.chunk, block_size):
                owner[inner_first:inner_stop] = i
        self.owner = owner
        self._leftovers: Dict[bytes, torch.Tensor] = {}

    def leftover(self, folded: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The blocks the folds did not quantize (int64, sorted, on ``device``) when the parameters flagged in
        ``folded`` (bool, one per parameter, on the host) got their gradient folded. Cached per pattern."""
        key = folded.numpy().tobytes()
        got = self._leftovers.get(key)
        if got is None:
            covered = (self.owner >= 0) & folded[self.owner.clamp(min=0)]
            got = torch.nonzero(~covered).reshape(-1)
            if device.type == "cuda":
                got = got.pin_memory().to(device, non_blocking=True)
            else:
                got = got.to(device)
            if len(self._leftovers) >= 8:
                self._leftovers.pop(next(iter(self._leftovers)))
            self._leftovers[key] = got
        return got


class FusedRoundEnd:
    """One fused round end in progress: from ``ACCOPipeline.on_backward_start`` of the round's last micro-batch to
    its round end (see the module docstring). ``plan``: the round end the pipeline predicted; ``releases``: the
    residual releases of the job in flight (one per group), or None when none is in flight."""

    def __init__(
        self,
        plan: RoundEnd,
        groups: Sequence[GroupBuffers],
        owners: Sequence[BlockOwners],
        compression: Compression,
        residuals: Sequence[torch.Tensor | None],
        releases: Sequence[ResidualRelease] | None,
        job_finished: Callable[[], bool],
        timeout_s: float,
        loss_scale: tuple | None = None,
    ):
        """``loss_scale`` (fp16): ``(residual_scales, round_scale)``, the scale each group's residual is in and the
        round's (fp64 [1] tensors): a residual is re-expressed in the round's scale before its first fold."""
        self.plan = plan
        self.groups = list(groups)
        self.owners = list(owners)
        self.compression = compression
        self.residuals = [r if compression.error_feedback else None for r in residuals]
        self.releases = releases
        self.job_finished = job_finished
        self.timeout_s = timeout_s
        self.loss_scale = loss_scale
        self.folded = [[False] * len(b.params) for b in self.groups]
        self.targets: List[FoldTarget | None] = [None] * len(self.groups)

    def begin(self) -> None:
        """Route every group's gradients of this backward to :meth:`fold` (``GroupBuffers.begin_fused_fold``)."""
        for i, b in enumerate(self.groups):
            b.begin_fused_fold(lambda index, grad, group=i: self.fold(group, index, grad))

    def _target(self, group: int) -> FoldTarget:
        """The group's fold target: its q / scales rows allocated (and the residual's release waited for) at its
        first fold."""
        target = self.targets[group]
        if target is None:
            if self.releases is not None and self.residuals[group] is not None:
                self.releases[group].wait(
                    self.job_finished,
                    self.timeout_s,
                    rank=_rank(self.groups[group]),
                    group=group,
                    phase=f"the first gradient fold of the round that ends with a {self.plan.job.value} "
                    f"(commit index {self.plan.commit_index})",
                )
            if self.loss_scale is not None and self.residuals[group] is not None:
                residual_scales, round_scale = self.loss_scale
                express_residual(self.residuals[group], residual_scales[group], round_scale)
            b, own = self.groups[group], self.owners[group]
            dev = b.device
            rows = (
                torch.empty(b.layout.padded_numel, dtype=torch.int8, device=dev),
                torch.empty(own.total, dtype=torch.float32, device=dev),
            )
            comp = self.compression
            target = FoldTarget(
                b.acc_flat, own.chunk, self.residuals[group], *rows, comp.block_size, comp.gradient_bits
            )
            self.targets[group] = target
        return target

    def fold(self, group: int, index: int, grad: torch.Tensor) -> None:
        """Parameter ``index`` of group ``group`` received its gradient of this micro-batch (a gradient hook)."""
        if self.folded[group][index]:
            raise RuntimeError(
                "acco_ds: a parameter received a second gradient in the micro-batch that ends a compressed round "
                "(a second backward through it before engine.step()?). The round was being quantized as its "
                "gradients arrived; run one backward per micro-batch, or set "
                "optimizer.params.compression.fuse_round_end=false."
            )
        target = self._target(group)
        target.fold(
            grad if grad.is_contiguous() else grad.contiguous(), self.groups[group].layout.offsets[index]
        )
        self.folded[group][index] = True

    def abandon(self) -> None:
        """Stop routing gradients here (the hooks of the default layout removed)."""
        for b in self.groups:
            b.end_fused_fold()

    def finish(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """At the round end (compute side): quantize the blocks no fold covered, stop routing gradients here, and
        return each group's ``(q, scales)`` rows for the job (flat: the buffer's length and ``W * blocks``)."""
        self.abandon()
        out = []
        for i, (b, own) in enumerate(zip(self.groups, self.owners)):
            target = self._target(i)
            q, scales = target.q, target.scales
            left = own.leftover(torch.tensor(self.folded[i], dtype=torch.bool), b.device)
            quantize_listed_blocks(
                b.acc_flat,
                own.chunk,
                self.residuals[i],
                q,
                scales,
                self.compression.block_size,
                left,
                self.compression.gradient_bits,
            )
            out.append((q, scales))
        self.targets = None  # the job owns the rows now (and frees them once sent)
        return out
