"""When a validation-loss curve first reaches a target loss: the "time to the same loss" of a run against a baseline.

Contract:
- ``time_to_loss(steps, wall_times, val_losses, target) -> Crossing``: the curve is the run's evaluations in order,
  evaluation ``i`` at optimizer step ``steps[i]`` (strictly increasing) and training time ``wall_times[i]`` (seconds,
  non-decreasing; ``None`` for a curve recorded without times: then only the step is given) with validation loss
  ``val_losses[i]``. The target is reached at the FIRST evaluation ``i`` whose loss is ``<= target`` (a later rise
  does not undo it; a non-finite loss never reaches it): at evaluation 0 (or right after a non-finite loss), its step
  and time exactly; otherwise the
  step and time are interpolated linearly between evaluations ``i - 1`` (above the target) and ``i``, at the point
  where the straight line between their losses meets the target. When no evaluation reaches it, ``reached`` is
  False, ``step`` and ``time_s`` are None, and ``best_loss`` / ``best_step`` give the lowest finite loss and the
  first step it was seen at (None, None when no loss is finite). A curve that is empty, of unequal lengths, with
  steps not increasing or times decreasing, or a non-finite target raises ``ValueError`` naming what is wrong.
- ``versus_baseline(curves, baseline) -> dict``: ``curves`` maps a run's label to ``{"step": [...], "time_s": [...],
  "val_loss": [...]}`` (``time_s`` may be missing or None); the target is the baseline's FINAL validation loss.
  Returns ``{"baseline", "target", "baseline_crossing", "runs": {label: {"crossing", "x_baseline"}}}`` for every
  other run, ``x_baseline`` = the run's time to the target over the baseline's own time to it (None when either
  did not reach it, a time is missing or the baseline's is 0). ``KeyError`` naming the baseline when it has no
  curve.
Nothing here reads files or knows a mode: acco-train's summary (``acco_ds.cli.job``), the fidelity and e2e
benchmarks and the quality study's samples-to-loss factors (``benchmarks.quality.factors``) all call it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence


@dataclass(frozen=True)
class Crossing:
    """Where a curve first reached ``target`` (see the module docstring)."""

    target: float
    reached: bool
    step: float | None  # interpolated optimizer step; None when not reached
    time_s: float | None  # interpolated training time; None when not reached or the curve has no times
    best_loss: float | None  # the lowest finite loss of the curve
    best_step: int | None  # the first step it was seen at
    at_index: int | None  # the first evaluation at or below the target

    def to_dict(self) -> dict:
        return asdict(self)


def _check(steps: Sequence, wall_times: Sequence | None, val_losses: Sequence, target: float) -> None:
    if not math.isfinite(target):
        raise ValueError(f"time_to_loss: the target must be a finite loss, got {target!r}")
    if len(steps) == 0:
        raise ValueError("time_to_loss: the curve has no evaluation (steps is empty)")
    if len(val_losses) != len(steps):
        raise ValueError(f"time_to_loss: {len(steps)} steps but {len(val_losses)} val_losses")
    if wall_times is not None and len(wall_times) != len(steps):
        raise ValueError(f"time_to_loss: {len(steps)} steps but {len(wall_times)} wall_times")
    for i in range(1, len(steps)):
        if not steps[i] > steps[i - 1]:
            raise ValueError(
                f"time_to_loss: steps must increase, got {steps[i - 1]} then {steps[i]} at index {i}"
            )
        if wall_times is not None and wall_times[i] < wall_times[i - 1]:
            raise ValueError(
                f"time_to_loss: wall_times must not decrease, got {wall_times[i - 1]} then {wall_times[i]} "
                f"at index {i}"
            )


def _at(wall_times: Sequence | None, i: int) -> float | None:
    return None if wall_times is None else float(wall_times[i])


def time_to_loss(
    steps: Sequence, wall_times: Sequence | None, val_losses: Sequence, target: float
) -> Crossing:
    """The first crossing of ``target`` by the curve, interpolated (see the module docstring)."""
    _check(steps, wall_times, val_losses, target)
    finite = [(loss, i) for i, loss in enumerate(val_losses) if math.isfinite(loss)]
    best_loss, best_i = min(finite, key=lambda x: (x[0], x[1])) if finite else (None, None)
    best_step = steps[best_i] if best_i is not None else None
    for i, loss in enumerate(val_losses):
        if not (math.isfinite(loss) and loss <= target):
            continue
        prev = val_losses[i - 1] if i > 0 else math.nan
        if not math.isfinite(prev):  # the first evaluation, or one after a non-finite loss: no line to draw
            return Crossing(target, True, float(steps[i]), _at(wall_times, i), best_loss, best_step, i)
        frac = (prev - target) / (prev - loss)  # prev > target >= loss: in (0, 1]
        step = steps[i - 1] + frac * (steps[i] - steps[i - 1])
        time_s = None
        if wall_times is not None:
            time_s = wall_times[i - 1] + frac * (wall_times[i] - wall_times[i - 1])
        return Crossing(target, True, float(step), time_s, best_loss, best_step, i)
    return Crossing(target, False, None, None, best_loss, best_step, None)


def _crossing(curve: dict, target: float) -> Crossing:
    return time_to_loss(curve["step"], curve.get("time_s"), curve["val_loss"], target)


def versus_baseline(curves: dict, baseline: str) -> dict:
    """Every run's time to ``baseline``'s final validation loss against the baseline's own (module docstring)."""
    if baseline not in curves or not curves[baseline] or not curves[baseline].get("val_loss"):
        raise KeyError(f"versus_baseline: no validation-loss curve for the baseline {baseline!r}")
    target = curves[baseline]["val_loss"][-1]
    base = _crossing(curves[baseline], target)
    runs = {}
    for label, curve in curves.items():
        if label == baseline or not curve or not curve.get("val_loss"):
            continue
        mine = _crossing(curve, target)
        x = None
        if mine.time_s is not None and base.time_s:
            x = mine.time_s / base.time_s
        runs[label] = {"crossing": mine, "x_baseline": x}
    return {"baseline": baseline, "target": target, "baseline_crossing": base, "runs": runs}
