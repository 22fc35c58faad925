"""The round state machine of docs/ALGORITHM.md: which communication job a round end launches, and when a
round may end. Pure logic: no tensors, no collectives.

Rounds are numbered from 0. At the end of round r the pipeline (1) waits for the job in flight, if
any, and swaps its gathered parameters into the model, then (2) launches the job ``plan(r)`` with
round r's gradients; in ``sync`` mode it then waits for that job at once.

- sync:  every round commits its own gradients; no overlap.
- dpu:   every round commits its own gradients while the next round computes at the parameters
         of the previous commit (round r computes at theta^{r-1}).
- acco:  round 0 is the prologue (g~^0 at theta^0). Even rounds end with a PEEK of their g~
         (the estimate theta~^{t+1}); odd rounds end with a COMMIT of g^t + the g~^t kept from the
         peek one round earlier.

The engine decides where an optimizer step ends (docs/ALGORITHM.md, "When the engine ends a step
early"). With fixed accumulation a COMMIT is launched only at the engine's boundary
(``plan_boundary``): sync and dpu rounds, and acco's odd rounds, last until it; acco's even rounds end
with their PEEK after their share of micro-batches (``ends_by_count``). When the boundary falls in an
even acco round (a step of at most GAS/2 micro-batches), that round ends with a COMMIT of its own
gradient alone (``RoundEnd.alone``), waited for at once; the next round is a new prologue at the new
theta. With adaptive accumulation rounds end by count and communication alone; the boundary only
moves the LR schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Job(str, Enum):
    PEEK = "peek"
    COMMIT = "commit"


@dataclass(frozen=True)
class RoundEnd:
    """What the end of one round does."""

    job: Job
    wait_previous: bool  # a job is in flight and must be swapped in first
    wait_now: bool  # sync: no overlap, wait for this job before the next round computes
    commit_index: int  # index t of the commit this job is or predicts (theta^{t+1}); -1 if none
    # acco: a COMMIT of this round's gradient alone (no kept g~); the next round is a prologue
    alone: bool = False


def rounds_per_step(mode: str) -> int:
    """Rounds per optimizer step: two in acco (stage 1 and stage 2), one otherwise."""
    return 2 if mode == "acco" else 1


def plan(mode: str, r: int) -> RoundEnd:
    """The job launched at the end of round ``r`` (0-based)."""
    if r < 0:
        raise ValueError(f"round index must be >= 0, got {r}")
    if mode == "sync":
        return RoundEnd(Job.COMMIT, wait_previous=False, wait_now=True, commit_index=r)
    if mode == "dpu":
        return RoundEnd(Job.COMMIT, wait_previous=r > 0, wait_now=False, commit_index=r)
    if mode == "acco":
        if r % 2 == 0:
            return RoundEnd(Job.PEEK, wait_previous=r > 0, wait_now=False, commit_index=r // 2)
        return RoundEnd(Job.COMMIT, wait_previous=True, wait_now=False, commit_index=r // 2)
    raise ValueError(f"mode must be one of acco, dpu, sync; got {mode!r}")


def plan_boundary(mode: str, r: int) -> RoundEnd:
    """The job launched when the engine ends the optimizer step in round ``r`` (fixed accumulation).

    sync, dpu, and acco's odd rounds: their ``plan``. An even acco round (a prologue, or a stage-2
    round computing g~ at the estimate) ends with a COMMIT of its own g~ alone, after the COMMIT in
    flight (if any) is swapped in, and is waited for at once: the g~ was computed at the estimate of
    the parameters it updates, and the next round restarts the two stages from the new theta."""
    if mode == "acco" and r % 2 == 0:
        if r < 0:
            raise ValueError(f"round index must be >= 0, got {r}")
        return RoundEnd(Job.COMMIT, wait_previous=r > 0, wait_now=True, commit_index=r // 2, alone=True)
    return plan(mode, r)


def ends_by_count(mode: str, r: int, adaptive: bool) -> bool:
    """Whether round ``r`` may end before the engine's boundary, on its count of micro-batches (and, in
    adaptive accumulation, the communication in flight): acco's even rounds (their PEEK) with fixed
    accumulation; every acco and dpu round with adaptive accumulation; never a sync round."""
    if mode == "sync":
        return False
    if adaptive:
        return True
    return mode == "acco" and r % 2 == 0


def micro_batches_per_round(mode: str, gradient_accumulation_steps: int) -> int:
    """The share of micro-batches of one round (fixed: exactly; adaptive: at least)."""
    gas = gradient_accumulation_steps
    if mode == "acco":
        if gas < 2 or gas % 2:
            raise ValueError(
                f"mode='acco' splits each optimizer step's gradient_accumulation_steps micro-batches into "
                f"two rounds, so gradient_accumulation_steps must be even and >= 2; got {gas}. "
                f"Set gradient_accumulation_steps to {max(2, gas + gas % 2)} (and train_batch_size to match)."
            )
        return gas // 2
    return gas


@dataclass
class RoundCounter:
    """Decides when the current round may end.

    fixed: exactly ``share`` micro-batches. adaptive: at least ``share``, then as soon as the job in
    flight is done (or ``cap`` micro-batches are in, when a cap is set)."""

    share: int
    adaptive: bool
    cap: int | None = None
    count: int = 0

    def add(self) -> None:
        self.count += 1

    def may_end(self, in_flight_done: bool) -> bool:
        if self.count < self.share:
            return False
        if not self.adaptive:
            return True
        return in_flight_done or (self.cap is not None and self.count >= self.cap)

    def reset(self) -> None:
        self.count = 0
