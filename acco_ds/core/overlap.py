"""How much of ACCO's communication overlapped the compute, as figures and, when it did not, in words.

Pure functions of the pipeline's counters (``PipelineStats``) and a few settings: no tensors, no collectives, no
host read of a device value. The DeepSpeed optimizer reports the figures in ``stats()`` and, once per run, after
``CHECK_AFTER_STEPS`` engine steps, logs the notice when one of ``inert_causes`` holds.

Figures (``overlap_figures``):

- ``rounds_per_step``: rounds ended per engine optimizer step (acco: 2 when both stages end, 1 when every step is
  committed alone; dpu and sync: 1; adaptive: as the link allows).
- ``comm_wait_share``: the time the training thread spent waiting for the round jobs and reading their summaries
  (``comm_wait_s``) over the jobs' own time (the phases of ``core.phase_clock``, summed over the jobs read so far):
  0 when the communication was hidden, 1 (or more, capped at 1) when the training thread waited for all of it.
  None before a job's time is known.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

CHECK_AFTER_STEPS = 4
"""Engine optimizer steps after which the overlap is judged (the first steps include a prologue and start-up)."""

WAIT_SHARE_LIMIT = 0.5
"""A training thread that waited for more than this share of the jobs' time hid less than half the communication."""

JOB_PHASES = (
    "job_reduce_scatter_s",
    "job_norm_s",
    "job_step_s",
    "job_all_gather_s",
    "job_to_host_s",
    "job_to_device_s",
)


def job_seconds(stats) -> float:
    """The round jobs' own time so far: the sum of their phases (``PipelineStats.job_*_s``)."""
    return sum(float(getattr(stats, name, 0.0)) for name in JOB_PHASES)


def overlap_figures(stats, engine_steps: int) -> dict:
    """``rounds_per_step`` and ``comm_wait_share`` (module docstring) from ``stats`` (``PipelineStats``) after
    ``engine_steps`` engine optimizer steps; None where nothing is known yet."""
    job_s = job_seconds(stats)
    return {
        "rounds_per_step": stats.rounds / engine_steps if engine_steps > 0 else None,
        "comm_wait_share": min(1.0, stats.comm_wait_s / job_s) if job_s > 0 else None,
    }


@dataclass(frozen=True)
class Setting:
    """What ``inert_causes`` needs to know of the run besides its counters."""

    mode: str  # acco | dpu | sync
    adaptive: bool
    gas: int  # gradient_accumulation_steps
    share: int  # micro-batches of a round (fixed: exactly; adaptive: at least)
    cap: int | None  # max_micro_batches_per_round (adaptive), None without one
    held_micro_batches: int  # micro-batches that ended inside no_sync() / coalesce_grad_reduction()


def inert_causes(stats, engine_steps: int, setting: Setting) -> List[str]:
    """The reasons, each with what to do, why this run overlaps little or no communication with compute; empty
    when it overlaps (or is ``sync``, which never overlaps by design, or too little is known yet)."""
    if setting.mode == "sync" or engine_steps < 1:
        return []
    causes = []
    figures = overlap_figures(stats, engine_steps)
    per_step = stats.micro_batches_local / engine_steps
    if setting.mode == "acco" and not setting.adaptive and figures["rounds_per_step"] <= 1.0:
        if per_step <= setting.share:
            causes.append(
                f"every optimizer step ended after at most {setting.share} micro-batches (gradient_accumulation_steps"
                f"={setting.gas}, {per_step:g} per step on average): acco commits such a step alone, one round "
                "per step and its communication waited for. Mark the boundary only at the last of the step's "
                "gradient_accumulation_steps micro-batches (engine.set_gradient_accumulation_boundary), or raise "
                "gradient_accumulation_steps"
            )
        else:
            causes.append(
                f"one round per optimizer step in acco mode ({figures['rounds_per_step']:g}): the step's first "
                f"{setting.share} micro-batches did not end a round"
                + (
                    f" ({setting.held_micro_batches} micro-batches ended inside no_sync())"
                    if setting.held_micro_batches
                    else ""
                )
                + ". Run the engine's own loop (engine(batch), engine.backward, engine.step)"
            )
    if setting.gas == 1 and not setting.adaptive and setting.mode == "dpu":
        causes.append(
            "gradient_accumulation_steps=1: each round's communication has one micro-batch of compute to hide "
            "behind. Raise gradient_accumulation_steps (a smaller micro-batch keeps the batch), or use "
            '"accumulation": "adaptive"'
        )
    share = figures["comm_wait_share"]
    if share is not None and share > WAIT_SHARE_LIMIT:
        if setting.adaptive and setting.cap is not None and setting.cap <= setting.share:
            causes.append(
                f"adaptive accumulation with max_micro_batches_per_round={setting.cap} and rounds of at least "
                f"{setting.share}: a round has nothing to accumulate while it waits, and the training thread waited "
                f"{share:.0%} of the jobs' time. Raise max_micro_batches_per_round or remove it"
            )
        else:
            causes.append(
                f"the training thread waited {share:.0%} of the round jobs' time: the link is slower than the "
                "compute between two round ends can hide. Raise gradient_accumulation_steps, use "
                '"accumulation": "adaptive", or compress the rounds ("compression": {"commit": "int8", "peek": '
                '"int8"}); acco-plan tells which pays off'
            )
    return causes


def notice(causes: List[str]) -> str:
    """The one-time log line for ``causes`` (non-empty)."""
    return (
        "acco_ds: ACCO overlaps little or no communication with compute in this run: "
        + "; ".join(causes)
        + "."
    )
