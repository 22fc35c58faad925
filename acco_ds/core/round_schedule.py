"""The round schedule of ``ACCOPipeline``: what ends a round, what ends an optimizer step, what holds.

A state machine over the micro-batches the caller ends (``on_micro_batch_end(boundary, hold)``, ``end_step``,
``close_step``). Its state, owned here and changed only on the compute side (the caller's thread):

- ``counter`` (``schedule.RoundCounter``): the micro-batches of the round in progress and its share;
- ``step_count``: micro-batches of the optimizer step not yet ended by a boundary (local);
- ``phase_round``: rounds since the pipeline (re)started, what ``schedule.plan`` sees (advanced by
  ``ACCOPipeline.end_round``, reset by a drain or a restart);
- ``boundary_pending``: sync, the engine's boundary has passed and the step's job waits for :meth:`end_step`.

Transitions, per micro-batch end: held (``no_sync()``/coalesced reduction) ends only a round that ends by its count
(acco's PEEK rounds, adaptive rounds); a boundary (the caller's, or every ``gradient_accumulation_steps``) ends the
step, and with fixed accumulation launches its COMMIT (``schedule.plan_boundary``; sync defers that launch to
:meth:`end_step` when the boundary was declared, ``_defer_boundary``); otherwise a round ends when it has its share
(and, adaptive, the job in flight is done: ``_may_end``). A round end itself is ``ACCOPipeline.end_round``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from acco_ds.core import schedule


class RoundSchedule:
    """Mixin of ``ACCOPipeline`` (see the module docstring): the compute side's decisions of where rounds and steps
    end. Reads ``mode``, ``adaptive``, ``gas``, ``_fused`` and the job in flight; ends rounds via ``end_round``."""

    boundary_pending = False
    """sync: the engine's boundary has passed and the step's job waits for :meth:`end_step` (``_defer_boundary``)."""

    def _init_schedule(self, share: int, cap: int | None) -> None:
        """The schedule's state at the start: ``share`` micro-batches a round, at most ``cap`` (adaptive)."""
        self.counter = schedule.RoundCounter(share, self.adaptive, cap)
        self.step_count = 0  # micro-batches of the optimizer step not yet ended by a boundary (local)
        self.phase_round = 0  # rounds since the pipeline (re)started: what schedule.plan sees

    def on_micro_batch_end(self, boundary: bool | None = None, hold: bool = False) -> None:
        """After a micro-batch's backward (``core.pipeline``'s module docstring says what ``boundary`` and ``hold``
        mean). A fused round end this micro-batch's start declared must have ended here, else it is abandoned and
        this raises."""
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
