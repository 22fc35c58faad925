"""DeepSpeed's own dynamic loss scaler with the settings of an ACCO ``LossScaleSpec``, for the tests that hold ACCO's
rule and its DeepSpeed-facing view against it."""

from __future__ import annotations

from deepspeed.runtime.fp16 import loss_scaler
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

from acco_ds.core.loss_scale import LossScaleSpec


def deepspeeds_scaler(spec: LossScaleSpec, monkeypatch, **kw) -> DynamicLossScaler:
    """DeepSpeed's ``DynamicLossScaler`` with ``spec``'s initial scale, window, minimum, hysteresis and consecutive
    hysteresis (``kw``: its other arguments); rank 0 for the rank it asks for to log (through ``monkeypatch``)."""
    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda: 0)
    return DynamicLossScaler(
        init_scale=spec.init_scale,
        scale_window=spec.window,
        min_scale=spec.min_scale,
        delayed_shift=spec.hysteresis,
        consecutive_hysteresis=spec.consecutive_hysteresis,
        **kw,
    )
