"""The optimizer's word on overlap: ``stats()``'s figures and the one-time notice when ACCO hides little or no
communication (``acco_ds.core.overlap``), said on global rank 0 through DeepSpeed's logger."""

from __future__ import annotations

import torch.distributed as dist
from deepspeed.utils import logger

from acco_ds.core import overlap


def setting_of(pipeline) -> overlap.Setting:
    """What ``overlap.inert_causes`` needs to know of ``pipeline`` (``core.pipeline.ACCOPipeline``)."""
    return overlap.Setting(
        mode=pipeline.mode,
        adaptive=pipeline.adaptive,
        gas=pipeline.gas,
        share=pipeline.counter.share,
        cap=pipeline.counter.cap,
        held_micro_batches=pipeline.stats.micro_batches_held,
    )


def figures(optimizer) -> dict:
    """``rounds_per_step`` and ``comm_wait_share`` over the run so far (``overlap_figures``; a resumed run's counters
    include the steps before the checkpoint)."""
    stats = optimizer.pipeline.stats
    return overlap.overlap_figures(stats, stats.optimizer_steps)


def after_step(optimizer) -> None:
    """Called at every engine optimizer step: at the ``CHECK_AFTER_STEPS``-th, judge the overlap once and, when one
    of ``inert_causes`` holds, keep the notice in ``optimizer.overlap_notice`` and log it on global rank 0."""
    if optimizer.steps_taken != overlap.CHECK_AFTER_STEPS:
        return
    stats = optimizer.pipeline.stats
    causes = overlap.inert_causes(stats, stats.optimizer_steps, setting_of(optimizer.pipeline))
    if not causes:
        return
    optimizer.overlap_notice = overlap.notice(causes)
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.warning(optimizer.overlap_notice)
