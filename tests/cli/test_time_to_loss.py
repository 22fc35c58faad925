"""acco_ds.cli.time_to_loss on hand-made curves, acco_ds.cli.val_curve's evaluations with a stand-in engine, and
acco-train's summary lines on the time to the baseline's final validation loss (acco_ds.cli.job)."""

from __future__ import annotations

import math

import pytest

from acco_ds.cli.job import baseline_label, time_to_baseline_loss, time_to_loss_lines
from acco_ds.cli.time_to_loss import time_to_loss, versus_baseline
from acco_ds.cli.val_curve import ValCurve

STEPS = [0, 10, 20, 30]
TIMES = [0.0, 5.0, 10.0, 15.0]


def test_interpolates_between_the_evaluations_around_the_crossing():
    c = time_to_loss(STEPS, TIMES, [5.0, 4.0, 3.0, 2.0], target=2.5)
    assert c.reached and c.at_index == 3
    assert c.step == pytest.approx(25.0) and c.time_s == pytest.approx(12.5)
    c = time_to_loss(STEPS, TIMES, [5.0, 4.0, 3.0, 2.0], target=3.75)  # a quarter of the way from 10 to 20
    assert c.step == pytest.approx(12.5) and c.time_s == pytest.approx(6.25)


def test_times_follow_the_wall_clock_not_the_steps():
    c = time_to_loss(STEPS, [0.0, 1.0, 9.0, 10.0], [5.0, 4.0, 2.0, 1.0], target=3.0)
    assert c.step == pytest.approx(15.0) and c.time_s == pytest.approx(5.0)


def test_reached_exactly_at_an_evaluation():
    c = time_to_loss(STEPS, TIMES, [5.0, 4.0, 3.0, 2.0], target=3.0)
    assert c.step == pytest.approx(20.0) and c.time_s == pytest.approx(10.0)


def test_reached_at_the_first_evaluation():
    c = time_to_loss(STEPS, TIMES, [2.0, 1.5, 1.0, 0.5], target=2.5)
    assert c.reached and c.at_index == 0 and c.step == 0 and c.time_s == 0.0


def test_never_reached_gives_the_best_loss_and_its_first_step():
    c = time_to_loss(STEPS, TIMES, [5.0, 3.0, 3.0, 3.5], target=2.5)
    assert not c.reached and c.step is None and c.time_s is None
    assert c.best_loss == 3.0 and c.best_step == 10


def test_non_monotone_curve_first_crossing_counts():
    """A curve that dips under the target, rises above it and comes down again: the first crossing."""
    c = time_to_loss(STEPS, TIMES, [5.0, 2.0, 4.0, 1.0], target=3.0)
    assert c.at_index == 1 and c.step == pytest.approx(10 * 2 / 3) and c.time_s == pytest.approx(5 * 2 / 3)


def test_a_non_finite_loss_never_reaches_and_the_next_point_is_taken_exactly():
    c = time_to_loss(STEPS, TIMES, [5.0, math.nan, 2.0, 1.0], target=3.0)
    assert c.at_index == 2 and c.step == 20 and c.time_s == 10.0
    c = time_to_loss(STEPS, TIMES, [math.nan] * 4, target=3.0)
    assert not c.reached and c.best_loss is None and c.best_step is None


def test_without_times_only_the_step():
    c = time_to_loss(STEPS, None, [5.0, 4.0, 3.0, 2.0], target=2.5)
    assert c.step == pytest.approx(25.0) and c.time_s is None


@pytest.mark.parametrize(
    ("steps", "times", "losses", "target", "says"),
    [
        ([], [], [], 1.0, "no evaluation"),
        ([0, 10], [0.0, 1.0], [1.0], 1.0, "2 steps but 1 val_losses"),
        ([0, 10], [0.0], [1.0, 2.0], 1.0, "2 steps but 1 wall_times"),
        ([0, 0], [0.0, 1.0], [1.0, 2.0], 1.0, "steps must increase"),
        ([0, 10], [1.0, 0.5], [1.0, 2.0], 1.0, "wall_times must not decrease"),
        ([0, 10], [0.0, 1.0], [1.0, 2.0], math.nan, "finite loss"),
    ],
)
def test_bad_curves_are_refused_naming_what_is_wrong(steps, times, losses, target, says):
    with pytest.raises(ValueError, match=says):
        time_to_loss(steps, times, losses, target)


def _curve(losses, times=TIMES, steps=STEPS):
    return {"step": list(steps), "time_s": list(times), "val_loss": list(losses)}


def test_versus_baseline_target_is_the_baselines_final_loss_and_its_own_first_crossing():
    # the baseline dips to its final 2.0 at step 20 already (non-monotone): its own time is 10 s, not 15 s
    curves = {
        "zero1": _curve([5.0, 3.0, 2.0, 2.0]),
        "acco": _curve([5.0, 3.0, 2.5, 1.5], times=[0.0, 4.0, 8.0, 12.0]),
        "dpu": _curve([5.0, 4.0, 3.0, 2.5]),
    }
    v = versus_baseline(curves, "zero1")
    assert v["target"] == 2.0 and v["baseline_crossing"].time_s == pytest.approx(10.0)
    acco = v["runs"]["acco"]
    assert acco["crossing"].step == pytest.approx(25.0) and acco["crossing"].time_s == pytest.approx(10.0)
    assert acco["x_baseline"] == pytest.approx(1.0)
    assert not v["runs"]["dpu"]["crossing"].reached and v["runs"]["dpu"]["x_baseline"] is None
    with pytest.raises(KeyError, match="'sync'"):
        versus_baseline(curves, "sync")


def _summary(curves: dict, steps: int = 30, eval_every: int = 10) -> dict:
    s = {
        "options": {"eval_every": eval_every},
        "runs": {k: {"val_curve": c, "steps": steps} for k, c in curves.items()},
    }
    s["time_to_loss"] = time_to_baseline_loss(s)
    return s


def test_summary_lines_say_the_times_the_ratio_and_whether_acco_got_there_sooner():
    s = _summary(
        {
            "acco": _curve([5.0, 3.0, 2.5, 1.5], times=[0.0, 3.0, 6.0, 9.0]),
            "dpu": _curve([5.0, 4.0, 3.0, 2.5]),
            "zero1": _curve([5.0, 3.0, 2.5, 2.0]),
        }
    )
    t = s["time_to_loss"]
    assert t["baseline"] == "zero1" and t["baseline_crossing"]["time_s"] == pytest.approx(15.0)
    assert t["runs"]["acco"]["x_baseline"] == pytest.approx(7.5 / 15.0)
    lines = time_to_loss_lines(s)
    assert lines[0].startswith("time to zero1's final validation loss 2.0000 (first crossing")
    assert "every 10 steps" in lines[0]
    assert lines[1] == "  zero1 (the baseline): 15.0 s, step 30"
    assert lines[2] == "  acco: 7.5 s, step 25; time to zero1's loss 0.50x zero1's"
    assert lines[3] == "  dpu: never reached (best 2.5000 at step 30)"
    assert "acco got there sooner in wall time than zero1 (7.5 s against 15.0 s, 0.50x)" in lines[-1]
    assert "dpu did not get there within its 30 steps" in lines[-1]


def test_later_and_no_baseline():
    s = _summary(
        {"sync": _curve([5.0, 3.0, 2.5, 2.0]), "acco": _curve([5.0, 3.0, 2.5, 2.0], times=[0, 6, 12, 18])}
    )
    assert s["time_to_loss"]["baseline"] == "sync"
    assert (
        "acco got there later in wall time than sync (18.0 s against 15.0 s, 1.20x)"
        in time_to_loss_lines(s)[-1]
    )
    assert baseline_label(["acco", "dpu"]) is None
    assert _summary({"acco": _curve([5.0, 2.0, 1.0, 0.5])})["time_to_loss"] is None
    assert time_to_loss_lines({"runs": {}, "time_to_loss": None}) == []


def test_a_baseline_without_a_finite_final_loss_is_said():
    s = _summary({"zero1": _curve([5.0, 3.0, 2.5, math.nan]), "acco": _curve([5.0, 3.0, 2.5, 2.0])})
    assert "error" in s["time_to_loss"]
    assert time_to_loss_lines(s)[0].startswith("acco-train: no time to zero1's final validation loss")


class _Opt:
    """ACCO's evaluation switch, as far as ValCurve uses it."""

    def __init__(self, log):
        self.log, self.committed_steps = log, 0

    def eval(self):
        self.log.append("eval")

    def train(self):
        self.log.append("train")


class _Engine:
    def __init__(self, log):
        self.optimizer = _Opt(log)
        self.global_steps = 0


def test_val_curve_evaluates_once_per_multiple_passed_and_leaves_its_time_out():
    log = []
    engine = _Engine(log)
    losses = iter([5.0, 4.0, 3.0, 2.9, 2.0])

    def evaluate():
        log.append("evaluate")
        return next(losses)

    curve = ValCurve(engine, evaluate, every=10)
    curve.at(0, 0.0)
    for step in (1, 9):  # no multiple of 10 passed
        engine.optimizer.committed_steps = step
        assert curve.on_step(step, lambda: 1.0) == 0.0
    engine.optimizer.committed_steps = 10
    spent = curve.on_step(10, lambda: 2.0)
    assert spent >= 0.0 and log[-3:] == ["eval", "evaluate", "train"]
    engine.optimizer.committed_steps = 31  # a jump past 20 and 30: two evaluations, one point
    curve.on_step(31, lambda: 7.0)
    assert log.count("evaluate") == 4 and log.count("eval") == 3
    curve.at(31, 8.0)  # the end, at a step already recorded: not twice
    # the second evaluation of the same parameters (made for the collectives) is not recorded again
    assert curve.curve() == {"step": [0, 10, 31], "time_s": [0.0, 2.0, 7.0], "val_loss": [5.0, 4.0, 3.0]}
    assert curve.seconds >= spent


def test_val_curve_off_and_resumed():
    engine = _Engine([])
    curve = ValCurve(engine, lambda: 1.0, every=0)
    assert curve.on_step(10, lambda: 1.0) == 0.0 and curve.curve()["step"] == []
    curve = ValCurve(engine, lambda: 1.0, every=10, start=45)
    assert curve.on_step(48, lambda: 1.0) == 0.0
    engine.optimizer.committed_steps = 52
    curve.on_step(52, lambda: 3.0)  # passed 50, which the checkpoint at 45 did not hold
    assert curve.curve()["step"] == [52]
