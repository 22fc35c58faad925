"""The loss scaler's rule (acco_ds.core.loss_scale, on device tensors) and the reference's (core.reference's
RefLossScaler, plain Python) against DeepSpeed's own DynamicLossScaler.update_scale, on random overflow sequences
and settings: the scale, the hysteresis and the iteration counters after every update; the epoch counts the scale's
changes; an uncounted outcome changes nothing; the minimum scale raises where DeepSpeed's raises."""

from __future__ import annotations

import random

import pytest
import torch

from acco_ds.core.loss_scale import (
    AT_MIN,
    EPOCH,
    HYSTERESIS,
    ITERATION,
    LAST_OVERFLOW,
    SCALE,
    DeviceLossScaler,
    LossScaleError,
    LossScaleSpec,
    ready_scale,
    updated_state,
)
from acco_ds.core.reference import RefLossScaler
from tests.core.deepspeed_scaler import deepspeeds_scaler

SPECS = [
    LossScaleSpec(True, 2.0**16, window=3, hysteresis=2, min_scale=1.0),
    LossScaleSpec(True, 2.0**10, window=1, hysteresis=1, min_scale=4.0),
    LossScaleSpec(True, 2.0**8, window=2, hysteresis=3, consecutive_hysteresis=True, min_scale=1.0),
    LossScaleSpec(True, 2.0**20, window=5, hysteresis=2, consecutive_hysteresis=False, min_scale=0.25),
]


def flag(v: bool) -> torch.Tensor:
    return torch.tensor([v])


@pytest.mark.parametrize(
    "spec", SPECS, ids=lambda s: f"w{s.window}h{s.hysteresis}c{int(s.consecutive_hysteresis)}"
)
@pytest.mark.parametrize("seed", range(4))
def test_rule_is_deepspeeds(spec, seed, monkeypatch):
    rng = random.Random(seed)
    theirs = deepspeeds_scaler(spec, monkeypatch, raise_error_at_min_scale=False)
    no_raise = LossScaleSpec(**{**spec.__dict__, "raise_at_min": False})
    ref = RefLossScaler(no_raise)
    state = torch.tensor(no_raise.initial_state(), dtype=torch.float64)
    changes = 0
    for _ in range(60):
        overflow = rng.random() < 0.3
        before = theirs.cur_scale
        theirs.update_scale(overflow)
        ref.update(overflow)
        state = updated_state(no_raise, state, flag(overflow), flag(True))
        changes += theirs.cur_scale != before
        got = [state[i].item() for i in (SCALE, HYSTERESIS, ITERATION, LAST_OVERFLOW, EPOCH)]
        want = [theirs.cur_scale, theirs.cur_hysteresis, theirs.cur_iter, theirs.last_overflow_iter, changes]
        assert got == want, (got, want)
        assert [ref.scale, ref.hysteresis, ref.iteration, ref.last_overflow, ref.epoch] == want
    assert changes > 2, "the sequence never moved the scale: it proves nothing"


def test_uncounted_outcome_changes_nothing():
    spec = SPECS[0]
    state = torch.tensor(spec.initial_state(), dtype=torch.float64)
    for overflow in (True, False):
        assert torch.equal(updated_state(spec, state, flag(overflow), flag(False)), state)


def test_static_scale_never_moves():
    spec = LossScaleSpec(False, 128.0)
    state = torch.tensor(spec.initial_state(), dtype=torch.float64)
    for overflow in (True, True, False, True):
        state = updated_state(spec, state, flag(overflow), flag(True))
    assert state[SCALE].item() == 128.0


def test_ready_scale_is_the_grown_scale_of_a_good_step():
    spec = LossScaleSpec(True, 64.0, window=2, hysteresis=2)
    state = torch.tensor(spec.initial_state(), dtype=torch.float64)
    seen = []
    for _ in range(5):
        seen.append(ready_scale(spec, state).item())
        state = updated_state(spec, state, flag(False), flag(True))
    assert seen == [64.0, 64.0, 128.0, 128.0, 256.0]


def test_minimum_scale_raises_once_the_host_reads_it():
    spec = LossScaleSpec(True, 4.0, window=100, hysteresis=1, min_scale=2.0)
    scaler = DeviceLossScaler(spec, torch.device("cpu"))
    scaler.apply(scaler.job_scale(), flag(True), flag(False))  # 4 -> 2
    scaler.check()
    assert scaler.scale == 2.0
    scaler.begin_round(refresh=True)
    scaler.apply(scaler.job_scale(), flag(True), flag(False))  # at the minimum: DeepSpeed raises
    assert scaler.state[AT_MIN].item() == 1.0 and scaler.scale == 2.0
    with pytest.raises(LossScaleError, match="min_loss_scale=2"):
        scaler.check()
    scaler.check()  # said once


def test_stale_commit_leaves_the_scaler_alone():
    """A commit computed under a scale that has changed since says nothing about the scale in force."""
    spec = LossScaleSpec(True, 1024.0, window=100, hysteresis=1)
    scaler = DeviceLossScaler(spec, torch.device("cpu"))
    first, second = scaler.job_scale(), scaler.job_scale()  # two rounds under 1024
    scaler.apply(first, flag(True), flag(False))
    assert scaler.scale == 512.0
    scaler.apply(second, flag(True), flag(False))  # stale: still 512
    assert scaler.scale == 512.0
    scaler.begin_round(refresh=True)
    assert float(scaler.round_scale) == 512.0
    scaler.apply(scaler.job_scale(), flag(True), flag(False))
    assert scaler.scale == 256.0


def test_empty_commit_is_not_counted():
    spec = LossScaleSpec(True, 1024.0, window=1, hysteresis=1)
    scaler = DeviceLossScaler(spec, torch.device("cpu"))
    before = scaler.state.clone()
    scaler.apply(scaler.job_scale(), flag(False), flag(True))
    assert torch.equal(scaler.state, before)


def test_state_dict_round_trip():
    spec = SPECS[2]
    a = DeviceLossScaler(spec, torch.device("cpu"))
    for overflow in (True, False, False, True):
        a.apply(a.job_scale(), flag(overflow), flag(False))
        a.begin_round(refresh=True)
    b = DeviceLossScaler(spec, torch.device("cpu"))
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.state, b.state) and torch.equal(a.job_scale(), b.job_scale())
    assert float(a.round_scale) == float(b.round_scale)
