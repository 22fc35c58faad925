"""``optimizer.loss_scaler`` on ACCO (acco_ds.deepspeed.loss_scaler_view), in one process without an engine: the view
of a device scaler driven through an overflow sequence reads, after every commit outcome, what DeepSpeed's own
DynamicLossScaler reads after the same ``update_scale`` calls (the fields users and DeepSpeed's tests read), from the
object taken once; a static fp16 scale and bf16/fp32 give DeepSpeed's LossScaler's; assignment and ``update_scale``
are refused with an error naming the attribute; a pickled view is DeepSpeed's own scaler object. The engine-level
comparison against ZeRO-1 is tests/deepspeed/test_module_direct.py's."""

from __future__ import annotations

import pickle
import random
from types import SimpleNamespace

import pytest
import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

from acco_ds.core.loss_scale import DeviceLossScaler, LossScaleSpec
from acco_ds.deepspeed.loss_scaler_view import LossScalerReadOnlyError, loss_scaler_view
from tests.core.deepspeed_scaler import deepspeeds_scaler
from tests.ranks.module_direct_worker import DYNAMIC_FIELDS


def pipeline_of(spec: LossScaleSpec | None):
    """What the view reads off an ACCOPipeline: ``scaler`` and ``scale_loss``."""
    scaler = None if spec is None else DeviceLossScaler(spec, torch.device("cpu"))
    return SimpleNamespace(
        scaler=scaler, scale_loss=lambda loss: loss if scaler is None else scaler.scale_loss(loss)
    )


@pytest.mark.parametrize(
    "spec",
    [
        LossScaleSpec(True, 2.0**8, window=2, hysteresis=2, min_scale=1.0),
        LossScaleSpec(True, 2.0**10, window=3, hysteresis=3, consecutive_hysteresis=True, min_scale=4.0),
    ],
    ids=["h2", "h3c"],
)
def test_dynamic_view_reads_deepspeeds_fields(spec, monkeypatch):
    theirs = deepspeeds_scaler(spec, monkeypatch)
    pipeline = pipeline_of(spec)
    view = loss_scaler_view(pipeline)
    assert isinstance(view, DynamicLossScaler) and view.dynamic and view.dtype == torch.float16
    rng = random.Random(0)
    moved = set()
    for _ in range(40):
        assert {k: getattr(view, k) for k in DYNAMIC_FIELDS} == {
            k: getattr(theirs, k) for k in DYNAMIC_FIELDS
        }
        assert view.repr() == {k: getattr(theirs, k) for k in view._FIELDS}
        overflow = rng.random() < 0.3 and theirs.cur_scale > spec.min_scale
        theirs.update_scale(overflow)
        scaler = pipeline.scaler
        scaler.apply(scaler.job_scale(), torch.tensor([overflow]), torch.tensor([False]))
        scaler.begin_round(refresh=True)
        moved.add(theirs.cur_scale)
    assert len(moved) > 2, "the sequence never moved the scale: it proves nothing"
    loss = torch.tensor(3.0, requires_grad=True)
    assert view.scale_loss(loss).item() == 3.0 * theirs.cur_scale
    snapshot = pickle.loads(pickle.dumps(view))
    assert type(snapshot) is DynamicLossScaler
    assert {k: getattr(snapshot, k) for k in DYNAMIC_FIELDS} == {
        k: getattr(theirs, k) for k in DYNAMIC_FIELDS
    }


@pytest.mark.parametrize("spec", [LossScaleSpec(False, 128.0), None], ids=["static128", "no_fp16"])
def test_static_view_is_deepspeeds_loss_scaler(spec):
    view = loss_scaler_view(pipeline_of(spec))
    want = LossScaler(scale=128.0 if spec is not None else 1.0)
    assert isinstance(view, LossScaler) and not isinstance(view, DynamicLossScaler)
    assert (view.cur_scale, view.loss_scale, view.dynamic) == (want.cur_scale, want.loss_scale, want.dynamic)
    assert not hasattr(view, "cur_iter")  # ZeRO-1's static scaler has no iteration counters either
    loss = torch.tensor(2.0, requires_grad=True)
    assert view.scale_loss(loss).item() == 2.0 * want.loss_scale
    snapshot = pickle.loads(pickle.dumps(view))
    assert type(snapshot) is LossScaler and snapshot.cur_scale == want.cur_scale


@pytest.mark.parametrize("spec", [LossScaleSpec(True, 2.0**8), LossScaleSpec(False, 128.0), None])
def test_changes_are_refused_by_name(spec):
    pipeline = pipeline_of(spec)
    view = loss_scaler_view(pipeline)
    before = view.repr()
    for name in ("cur_scale", "scale_window", "cur_hysteresis"):
        with pytest.raises(
            LossScalerReadOnlyError, match=rf"assigning optimizer\.loss_scaler\.{name} is refused"
        ):
            setattr(view, name, 1.0)
    with pytest.raises(
        LossScalerReadOnlyError, match=r"calling optimizer\.loss_scaler\.update_scale\(\) is refused"
    ):
        view.update_scale(True)
    assert view.repr() == before
    if pipeline.scaler is not None:
        assert pipeline.scaler.read()["scale"] == before["cur_scale"]
