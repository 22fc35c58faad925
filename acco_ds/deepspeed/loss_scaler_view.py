"""``optimizer.loss_scaler`` as DeepSpeed's ZeRO-1 has it, read off ACCO's loss scaler on the device.

DeepSpeed's ZeRO-1 (``DeepSpeedZeroOptimizer``) keeps one of DeepSpeed's scaler objects in ``loss_scaler``
(deepspeed/runtime/fp16/loss_scaler.py): with dynamic fp16 a ``DynamicLossScaler`` (``cur_scale``, ``cur_iter``,
``last_overflow_iter``, ``scale_factor``, ``scale_window``, ``min_scale``, ``delayed_shift``, ``cur_hysteresis``,
``consecutive_hysteresis``, ``raise_error_at_min_scale``, ``dynamic`` True, ``dtype``); with a static fp16 scale, and
with bf16 or fp32, a ``LossScaler`` (``cur_scale`` and ``loss_scale``: the static scale, 1.0 without fp16;
``dynamic`` False). Users' logging, tools and DeepSpeed's own tests read these, and keep the object to read it again
after later steps.

ACCO's scaler is a state vector on the training device (``core.loss_scale.DeviceLossScaler``). :func:`loss_scaler_view`
gives objects of those DeepSpeed classes (``isinstance`` holds) whose attributes read the pipeline's scaler when
asked: a dynamic scaler's changing fields (``cur_scale``, ``loss_scale``, ``cur_iter``, ``last_overflow_iter``,
``cur_hysteresis``) are one host read of the state each (``DeviceLossScaler.read``, which waits for the compute
stream); the settings and a static scale are host values. Nothing in the training path reads them. The values mean
DeepSpeed's: the state after the commits applied so far. In ``sync`` that is, after ``engine.step()``, ZeRO-1's at
the same step; in ``acco``/``dpu`` a boundary's commit is applied during the next round, so the scaler there follows
one step later (as ``overflow`` reports its skip).

What cannot be served raises :class:`LossScalerReadOnlyError` naming it: assigning any attribute (ZeRO-1 would change
its scale or settings in place; ACCO's scale is decided on the device by the rule and carried by checkpoints) and
``update_scale`` (the pipeline applies the rule to every commit itself). ``scale_loss(loss)`` multiplies by the scale
of the round in progress, as the engine's ``backward`` does (a device tensor; no host read). Pickling or copying a view
gives DeepSpeed's own scaler object holding the current values (``checkpoint.loss_scale.to_deepspeed``).
"""

from __future__ import annotations

import copyreg
import json

import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

# DeepSpeed's DynamicLossScaler halves and doubles the scale (its scale_factor); so does core.loss_scale's rule
SCALE_FACTOR = 2.0


class LossScalerReadOnlyError(AttributeError):
    """An attribute of ``optimizer.loss_scaler`` (or the optimizer's loss scale) was assigned, or the scaler was
    asked to update itself: ACCO's loss scale lives in its pipeline, decided on the device."""


def read_only_error(name: str, action: str = "assigning") -> LossScalerReadOnlyError:
    """The error for ``action`` on ``name`` (an attribute path as the user wrote it)."""
    return LossScalerReadOnlyError(
        f"acco_ds: {action} {name} is refused: ACCO's fp16 loss scale is decided on the training device by "
        "DeepSpeed's rule (fp16.loss_scale, initial_scale_power, loss_scale_window, hysteresis, consecutive_hysteresis, "
        "min_loss_scale in the DeepSpeed config) and carried by checkpoints; optimizer.loss_scaler only reads it. "
        "Allowed: set those config keys, or load a checkpoint that holds the scale to resume from."
    )


class _View:
    """What both views share: the pipeline they read, read-only attributes, a live repr, pickling as a snapshot."""

    _FIELDS: tuple = ()

    def __init__(self, pipeline):
        object.__setattr__(self, "_pipeline", pipeline)

    def __setattr__(self, name, value):
        raise read_only_error(f"optimizer.loss_scaler.{name}")

    def __delattr__(self, name):
        raise read_only_error(f"optimizer.loss_scaler.{name}", action="deleting")

    def update_scale(self, overflow):
        """Refused: the pipeline updates ACCO's scale itself, once per commit (``core.loss_scale``)."""
        raise read_only_error("optimizer.loss_scaler.update_scale()", action="calling")

    def scale_loss(self, loss):
        """``loss`` times the scale of the round in progress (the pipeline's ``scale_loss``: a device tensor, no host
        read); ``loss`` itself without fp16 (ZeRO-1's ``loss * 1.0``, the same values)."""
        return self._pipeline.scale_loss(loss)

    def repr(self) -> dict:
        """The current values by name (DeepSpeed's ``DeepSpeedConfigObject.repr`` gives its scaler's ``__dict__``)."""
        return {name: getattr(self, name) for name in self._FIELDS}

    def __repr__(self):
        return json.dumps(self.repr(), sort_keys=True, indent=4, default=str)

    def __reduce__(self):
        from acco_ds.deepspeed.checkpoint.loss_scale import to_deepspeed

        snapshot = to_deepspeed(self._pipeline.scaler)
        # rebuilt as the DeepSpeed class itself (what copyreg's protocol-0 reduction names): no acco_ds in the pickle
        return copyreg._reconstructor, (type(snapshot), object, None), snapshot.__dict__


class StaticLossScalerView(_View, LossScaler):
    """DeepSpeed's ``LossScaler`` of ZeRO-1 with a static fp16 scale (``fp16.loss_scale`` > 0), or with bf16/fp32
    (scale 1.0): ``cur_scale`` and ``loss_scale`` are that scale, ``dynamic`` is False."""

    _FIELDS = ("cur_scale", "dynamic")

    @property
    def cur_scale(self) -> float:
        scaler = self._pipeline.scaler
        return 1.0 if scaler is None else float(scaler.spec.init_scale)

    @property
    def dynamic(self) -> bool:
        return False


class DynamicLossScalerView(_View, DynamicLossScaler):
    """DeepSpeed's ``DynamicLossScaler`` of ZeRO-1 with dynamic fp16 (``fp16.loss_scale`` 0), read off the device
    state: ``cur_scale`` (= ``loss_scale``), ``cur_iter`` (the commits counted by the rule), ``last_overflow_iter``
    (-1 before any), ``cur_hysteresis``; the settings ``scale_window``, ``min_scale``, ``delayed_shift`` (the
    configured hysteresis), ``consecutive_hysteresis``, ``raise_error_at_min_scale``, ``scale_factor`` (2.0),
    ``dynamic`` (True), ``dtype`` (fp16)."""

    _FIELDS = (
        "cur_scale",
        "cur_iter",
        "last_overflow_iter",
        "cur_hysteresis",
        "scale_factor",
        "scale_window",
        "min_scale",
        "delayed_shift",
        "consecutive_hysteresis",
        "raise_error_at_min_scale",
        "dynamic",
        "dtype",
    )

    def _state(self) -> dict:
        return self._pipeline.scaler.read()

    def _spec(self):
        return self._pipeline.scaler.spec

    @property
    def cur_scale(self) -> float:
        return self._state()["scale"]

    @property
    def cur_iter(self) -> int:
        return int(self._state()["iteration"])

    @property
    def last_overflow_iter(self) -> int:
        return int(self._state()["last_overflow"])

    @property
    def cur_hysteresis(self) -> int:
        return int(self._state()["hysteresis"])

    @property
    def scale_factor(self) -> float:
        return SCALE_FACTOR

    @property
    def scale_window(self) -> int:
        return self._spec().window

    @property
    def min_scale(self) -> float:
        return self._spec().min_scale

    @property
    def delayed_shift(self) -> int:
        return self._spec().hysteresis

    @property
    def consecutive_hysteresis(self) -> bool:
        return self._spec().consecutive_hysteresis

    @property
    def raise_error_at_min_scale(self) -> bool:
        return self._spec().raise_at_min

    @property
    def dynamic(self) -> bool:
        return True

    @property
    def dtype(self) -> torch.dtype:
        return torch.float16

    def repr(self) -> dict:
        """The current values by name, the device state read once."""
        state = self._state()
        out = {name: getattr(self, name) for name in self._FIELDS if name not in _STATE_NAMES}
        out.update(
            cur_scale=state["scale"],
            cur_iter=int(state["iteration"]),
            last_overflow_iter=int(state["last_overflow"]),
            cur_hysteresis=int(state["hysteresis"]),
        )
        return out


_STATE_NAMES = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def loss_scaler_view(pipeline) -> _View:
    """``optimizer.loss_scaler`` for an ``ACCOPipeline``: dynamic fp16 gets a :class:`DynamicLossScalerView`, a static
    fp16 scale and bf16/fp32 a :class:`StaticLossScalerView` (ZeRO-1's classes for the same configurations)."""
    scaler = pipeline.scaler
    if scaler is not None and scaler.spec.dynamic:
        return DynamicLossScalerView(pipeline)
    return StaticLossScalerView(pipeline)
