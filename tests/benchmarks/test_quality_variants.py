"""The quality study's acco variants (``benchmarks.quality.variants``): with every knob at its default the run is the
reference's acco bit for bit, est_scale 0 is sync's trajectory, each knob changes the run, the probe leaves the
trajectory as it is, and bad knobs are refused by name."""

from __future__ import annotations

import pytest

from benchmarks.quality import cli, study, variants
from benchmarks.quality.variants import Variant

STEPS, EVERY = 6, 2
TINY = ["--n-layer", "1", "--n-head", "2", "--d-model", "16", "--context", "16", "--eval-windows", "8"]


@pytest.fixture(scope="module")
def problem():
    a = cli.parse(["--settings", "base", "--out", "/nonexistent/never-written", *TINY])
    return study.Problem(cli.make_setup(a), cli.make_setting("base", STEPS), 0)


@pytest.fixture(scope="module")
def acco(problem):
    return study.run(problem, "acco", EVERY)


def _same(a: dict, b: dict) -> bool:
    keys = ("val_loss", "norm", "train_loss")
    est = ("step", "est_dist", "step_dist")
    return all(a[k] == b[k] for k in keys) and all(a["estimate"][k] == b["estimate"][k] for k in est)


def test_defaults_are_the_reference_acco(problem, acco):
    assert _same(variants.variant_run(problem, Variant(), EVERY), acco)


def test_the_probe_does_not_change_the_run(problem, acco):
    rec = variants.variant_run(problem, Variant(probe_every=2), EVERY)
    assert _same(rec, acco)
    probe = rec["probe"]
    assert probe["step"] == [2, 4]
    assert all(m > 0 for m in probe["mismatch"][1:]) and all(0 < h < 10 for h in probe["half_noise"])


def test_along_measures_where_the_estimate_lies(problem):
    plain = variants.variant_run(problem, Variant(), EVERY)["estimate"]["along"]
    ahead = variants.variant_run(problem, Variant(peek_lr_scale=2.0), EVERY)["estimate"]["along"]
    at_theta = variants.variant_run(problem, Variant(est_scale=0.0), EVERY)["estimate"]["along"]
    assert at_theta[2:] == pytest.approx([1.0] * (STEPS - 3))  # the estimate is theta^t: the whole step along
    assert all(0.5 < a < 1.5 for a in plain[2:])  # the first two commits have LR 0: no step
    assert all(
        a > p + 0.3 for a, p in zip(ahead[2:], plain[2:])
    )  # twice the peek's step: about one step further


def test_est_scale_zero_is_sync(problem):
    sync = study.run(problem, "sync", EVERY)
    rec = variants.variant_run(problem, Variant(est_scale=0.0), EVERY)
    assert rec["val_loss"] == pytest.approx(sync["val_loss"], rel=1e-6)
    assert rec["norm"] == pytest.approx(sync["norm"], rel=1e-5)
    assert all(d == 0 for d in rec["estimate"]["est_dist"])


@pytest.mark.parametrize(
    "knobs",
    [
        dict(est_scale=0.5),
        dict(peek_momentum=0.5),
        dict(peek_lr_scale=1.5),
        dict(commit_weight=0.5),
        dict(estimate_micro_batches=1),
        dict(curvature_lambda=1e9),
        dict(rank_extra=(1, 0)),
    ],
)
def test_every_knob_changes_the_run(problem, acco, knobs):
    rec = variants.variant_run(problem, Variant(**knobs), EVERY)
    assert rec["norm"][:2] == pytest.approx(acco["norm"][:2], rel=0.5)  # the same problem
    assert rec["norm"] != acco["norm"]


@pytest.mark.parametrize(
    "knobs, word",
    [
        (dict(estimate_micro_batches=4), "estimate_micro_batches"),
        (dict(estimate_micro_batches=0), "estimate_micro_batches"),
        (dict(peek_momentum=1.5), "peek_momentum"),
        (dict(commit_weight=-1.0), "commit_weight"),
        (dict(rank_extra=(1,)), "rank_extra"),
        (dict(rank_extra=(-1, 0)), "rank_extra"),
    ],
)
def test_bad_knobs_are_refused_by_name(problem, knobs, word):
    with pytest.raises(ValueError, match=word):
        variants.variant_run(problem, Variant(**knobs), EVERY)


def test_cli_refuses_an_unknown_variant():
    with pytest.raises(SystemExit):
        cli.parse(["--variants", "nope", "--out", "/nonexistent/x"])
