"""The fp16 loss scaler in DeepSpeed's checkpoint layout: ZeRO-1 saves its scaler object under ``loss_scaler`` and
takes it back as it is (``DeepSpeedZeroOptimizer._load_global_state``), so ACCO saves a DeepSpeed scaler object
holding its own state (a ZeRO-1 run resumes with the scale, hysteresis and counters ACCO reached) and reads one from
a ZeRO-1 checkpoint (an ACCO run resumes with ZeRO-1's). ACCO's exact state (the scale's epoch and the scale of the
round in progress) rides in its own "acco" entry (``core.snapshot``)."""

from __future__ import annotations

import logging

from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

from acco_ds.core.loss_scale import DeviceLossScaler

logger = logging.getLogger("acco_ds")


def to_deepspeed(scaler: DeviceLossScaler | None):
    """DeepSpeed's scaler object for ``scaler``'s current state (a host read): a DynamicLossScaler with the scale,
    hysteresis and iteration counters, a static LossScaler, or a static scale of 1 without fp16."""
    if scaler is None:
        return LossScaler(scale=1.0)
    spec, sd = scaler.spec, scaler.state_dict()
    if not spec.dynamic:
        return LossScaler(scale=spec.init_scale)
    out = DynamicLossScaler(
        init_scale=sd["scale"],
        scale_window=spec.window,
        min_scale=spec.min_scale,
        delayed_shift=spec.hysteresis,
        consecutive_hysteresis=spec.consecutive_hysteresis,
        raise_error_at_min_scale=spec.raise_at_min,
    )
    out.cur_hysteresis = int(sd["hysteresis"])
    out.cur_iter = int(sd["iteration"])
    out.last_overflow_iter = int(sd["last_overflow"])
    return out


def load_from_deepspeed(scaler: DeviceLossScaler | None, saved) -> None:
    """Take the scale, hysteresis and iteration counters of ``saved`` (a DeepSpeed scaler object from another
    optimizer's checkpoint) when it is a dynamic scaler and this run scales dynamically; this run's settings
    (window, minimum, ...) stay. Anything else (no fp16 here, a static or missing scaler there) starts from this
    run's configured scale."""
    if scaler is None or not scaler.spec.dynamic:
        return
    if not isinstance(saved, DynamicLossScaler):
        logger.info(
            "acco_ds: the checkpoint holds no dynamic loss scaler (%s): the scale starts at %g",
            type(saved).__name__,
            scaler.spec.init_scale,
        )
        return
    sd = scaler.state_dict()
    sd.update(
        scale=float(saved.cur_scale),
        hysteresis=float(saved.cur_hysteresis),
        iteration=float(saved.cur_iter),
        last_overflow=float(saved.last_overflow_iter),
        overflow_at_min_scale=0.0,
    )
    sd["round_scale"] = [sd["scale"], sd["epoch"]]
    scaler.load_state_dict(sd)
