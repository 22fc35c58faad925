"""acco-plan's samples-to-loss factor (acco_ds.plan.quality, planner, recommend): the regime closest to the plan, the
time-to-the-same-loss speed-up = samples/s speed-up / f, what is said where ACCO never reached ZeRO-1's loss, the
across-lengths factor where the within-run one is a lower bound (a crossing, a lower and an upper bound), the
variant of --peek-lr-scale, the packaged factors file and the errors of a bad one. The regimes are hand-made; one
test reads the packaged file."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from acco_ds.plan import cli, planner, quality
from acco_ds.plan.model import PlanInputs
from acco_ds.plan.recommend import recommend as base_recommend

ROOT = Path(__file__).resolve().parents[2]


def _setting(steps, tokens, lr, mean, reached=True, group="x"):
    m = {
        "factor": {"mean": mean, "min": mean - 0.01, "max": mean + 0.01, "n": 3},
        "lower_bound": not reached,
        "not_reached_seeds": [] if reached else ["0", "1", "2"],
        "sync_final_val_loss_mean": 2.47,
        "best_val_loss_mean": 2.50,
    }
    return {"group": group, "steps": steps, "tokens_per_step": tokens, "peak_lr": lr, "modes": {"acco": m}}


FACTORS = {
    "source": {"path": "benchmarks/results/quality/runX/quality.json", "study": "runX", "date": "2026-12-01"},
    "base_setting": "base",
    "settings": {
        "base": _setting(150, 4096, 2e-3, 1.10, group="base"),
        "lr_x2": _setting(150, 4096, 4e-3, 1.50),  # another LR: never chosen (the plan knows no LR)
        "gas2": _setting(150, 2048, 2e-3, 0.90),
        "gas8": _setting(150, 8192, 2e-3, 1.20),
        "steps600": _setting(600, 4096, 2e-3, 1.02),
    },
    "_file": "hand-made",
}


def test_regime_is_the_base_setting_when_the_plan_knows_nothing():
    r = quality.choose(FACTORS)
    assert r["setting"] == "base" and "base setting" in r["why"] and r["reached"]


@pytest.mark.parametrize(
    ("tokens", "steps", "setting"),
    [
        (2048, None, "gas2"),
        (2500, None, "gas2"),  # |ln(2500/2048)| < |ln(2500/4096)|
        (1e6, None, "gas8"),  # far beyond every setting: the largest
        (4096, None, "base"),  # ties with steps600 in tokens: the base setting
        (None, 500, "steps600"),
        (4096, 150, "base"),
    ],
)
def test_regime_closest_in_tokens_per_step_and_run_length(tokens, steps, setting):
    r = quality.choose(FACTORS, tokens, steps)
    assert r["setting"] == setting
    assert "closest to the plan's" in r["why"]


def test_regime_distance_adds_both_ratios():
    # 8192 tokens and 600 steps: gas8 is |ln 1| + |ln 4| = 1.39 away, steps600 |ln 2| + |ln 1| = 0.69
    assert quality.choose(FACTORS, 8192, 600)["setting"] == "steps600"


def test_time_to_loss_speedup_is_the_samples_speedup_over_the_factor():
    v = quality.verdict(1.45, quality.choose(FACTORS))
    assert v["time_speedup"] == pytest.approx(1.45 / 1.10) and v["factor"] == 1.10
    assert quality.verdict(None, quality.choose(FACTORS))["time_speedup"] is None


def test_never_reached_gives_no_number_and_says_so():
    f = copy.deepcopy(FACTORS)
    f["settings"]["base"] = _setting(150, 4096, 2e-3, 1.0, reached=False, group="base")
    r = quality.choose(f)
    assert not r["reached"] and quality.verdict(1.45, r)["time_speedup"] is None
    text = quality.describe(r)
    assert (
        "never reached sync's (ZeRO-1's math) final validation loss within the 150 steps in 3 of 3 seeds"
        in text
    )
    assert "more than 1.00x the steps" in text
    assert "quality study runX, setting base: 150 steps, 4,096 tokens/step" in text


def test_describe_names_the_regime_the_factor_and_where_it_comes_from():
    text = quality.describe(quality.choose(FACTORS, 2048))
    assert text.startswith("quality study runX, setting gas2: 150 steps, 2,048 tokens/step, peak LR 0.002")
    assert "acco needs 0.90x the steps of ZeRO-1 to reach its final validation loss (mean of 3 seeds" in text
    assert "benchmarks/results/quality/runX/quality.json, 2026-12-01" in text


# a 100M-parameter model on 4 x 8 GPUs whose round fits in half a step: fixed ACCO gains 10-30% samples/s
INPUTS = PlanInputs(
    params=1e8, t_micro_batch=0.06, micro_batch=8, gas=4, nodes=4, gpus_per_node=8, intra_bw=2e11,
    inter_bw=1.25e10, tokens_per_micro_batch=8 * 512,
)  # fmt: skip


def _with_factor(mean, reached=True):
    f = copy.deepcopy(FACTORS)
    f["settings"]["base"] = _setting(150, 4096, 2e-3, mean, reached=reached, group="base")
    f["settings"] = {"base": f["settings"]["base"]}
    return f


def test_the_recommendation_decides_on_the_time_to_the_same_loss():
    plan = planner.predict(INPUTS)
    plain = base_recommend(plan, INPUTS)  # samples/s alone
    gain = plan.row("acco").samples_per_s / plan.row("zero1").samples_per_s
    assert plain["mode"] == "acco" and 1.1 < gain < 1.3
    good = planner.recommend(plan, INPUTS, _with_factor(0.95))
    assert good["mode"] == "acco" and f"In time to ZeRO-1's final loss: {gain / 0.95:.2f}x" in good["reason"]
    t = good["time_to_loss"]
    assert t["contender"] == "acco" and t["time_speedup"] == pytest.approx(gain / 0.95)
    bad = planner.recommend(plan, INPUTS, _with_factor(gain / 1.01))  # 1% left in time to the loss
    assert bad["mode"].startswith("zero1") and "in time to the same loss, below the 5%" in bad["reason"]
    assert bad["time_to_loss"]["time_speedup"] == pytest.approx(1.01)
    unknown = planner.recommend(plan, INPUTS, _with_factor(1.0, reached=False))
    assert unknown["mode"] == "acco" and "its time to that loss is not known" in unknown["reason"]
    assert unknown["time_to_loss"]["time_speedup"] is None


def test_the_output_names_the_regime_and_the_verdict():
    plan = planner.predict(INPUTS)
    rec = planner.recommend(plan, INPUTS, _with_factor(0.95))
    lines = cli.render(plan, rec).splitlines()
    head = next(x for x in lines if x.startswith("time to the same loss"))
    assert head.startswith("time to the same loss (acco against zero1): ") and "/ 0.95x the steps" in head
    assert head.endswith("ACCO reaches ZeRO-1's final loss sooner")
    regime = next(x for x in lines if x.startswith("regime: "))  # 4096 tokens x GAS 4 x 32 ranks per step
    assert (
        "setting base" in regime
        and "closest to the plan's 524,288 tokens per step (128x this setting's)" in regime
    )
    rec = planner.recommend(plan, INPUTS, _with_factor(1.0, reached=False))
    head = next(x for x in cli.render(plan, rec).splitlines() if x.startswith("time to the same loss"))
    assert "not known" in head and "never reached" in head


def test_train_steps_picks_the_regime_and_is_checked(capsys):
    i = dataclasses.replace(INPUTS, tokens_per_micro_batch=None, train_steps=500)
    assert planner.regime(i, FACTORS)["setting"] == "steps600"
    with pytest.raises(ValueError, match="train_steps"):
        dataclasses.replace(INPUTS, train_steps=0)
    base = ["--params", "1B", "--gpus-per-node", "1", "--t-micro-batch", "100ms"]
    with pytest.raises(SystemExit):
        cli.main(base + ["--train-steps", "0"])
    assert "--train-steps must be an integer >= 1" in capsys.readouterr().err


def test_the_packaged_factors_name_their_results_file_and_are_package_data():
    doc = quality.load()
    src = doc["source"]
    assert (ROOT / src["path"]).is_file() and src["date"] and src["sha256"]
    assert doc["command"].startswith("python -m benchmarks.quality.factors --from-json ")
    assert doc["base_setting"] in doc["settings"]
    toml = (ROOT / "pyproject.toml").read_text()  # tomllib is Python >= 3.11; this project runs on 3.10
    section = toml[toml.index("[tool.setuptools.package-data]") :]
    assert f'"acco_ds.plan" = ["{quality.FACTORS_FILE}"]' in section.split("\n[", 1)[0]


def test_the_plans_json_carries_the_verdict(capsys):
    argv = ["--params", "1B", "--gpus-per-node", "4", "--intra-bw", "100GB/s", "--t-micro-batch", "100ms"]
    assert cli.main(argv + ["--json"]) == 0
    t = json.loads(capsys.readouterr().out)["recommendation"]["time_to_loss"]
    assert t["regime"]["setting"] == quality.load()["base_setting"] and "regime_text" in t


def test_a_bad_factors_file_is_refused_naming_the_key(tmp_path):
    path = tmp_path / "f.json"
    path.write_text(json.dumps({"source": {}, "base_setting": "base"}))
    with pytest.raises(ValueError, match="no 'settings'"):
        quality.load(path)
    path.write_text(json.dumps({"source": {}, "base_setting": "nope", "settings": {"base": {}}}))
    with pytest.raises(ValueError, match="base_setting 'nope' is not a setting"):
        quality.load(path)
    path.write_text(json.dumps({"source": {}, "base_setting": "base", "settings": {"base": {"steps": 1}}}))
    with pytest.raises(ValueError, match=r"settings\['base'\]\): no 'tokens_per_step'"):
        quality.load(path)
    with pytest.raises(ValueError, match="no setting measured mode 'dpu'"):
        quality.choose(_with_factor(1.0), mode="dpu")


# --- across run lengths and variants ---------------------------------------------------------------------------

FAMILY = "lr=0.002 gas=4 mb=8 world=2 warmup=15"


def _at(setting, n, mean, low=False, up=False):
    steps = None if low or up else mean * n
    seed = {"steps": steps, "factor": mean, "lower_bound": low, "upper_bound": up, "within_run": False}
    return {
        "setting": setting,
        "seeds": {str(k): dict(seed) for k in range(3)},
        "factor": {"mean": mean, "min": mean - 0.1, "max": mean + 0.1, "n": 3},
        "lower_bound": low,
        "upper_bound": up,
        "lower_bound_seeds": ["0", "1", "2"] if low else [],
        "upper_bound_seeds": ["0", "1", "2"] if up else [],
        "within_run_seeds": [],
    }


def _lengths(at150=(1.6, False, False), within_reached=False):
    """steps100, base (150 steps), steps300 and steps600 of one family, acco never reaching sync's loss within a run;
    the across-lengths factor at 150 steps ``at150`` (mean, lower bound, upper bound), at 300 1.3, at 600 a lower
    bound."""
    f = copy.deepcopy(FACTORS)
    f["settings"] = {
        "steps100": _setting(100, 4096, 2e-3, 1.0, False, group="length"),
        "base": _setting(150, 4096, 2e-3, 1.10 if within_reached else 1.0, within_reached, group="base"),
        "steps300": _setting(300, 4096, 2e-3, 1.0, False, group="length"),
        "steps600": _setting(600, 4096, 2e-3, 1.0, False, group="length"),
        "gas2": _setting(150, 2048, 2e-3, 1.0, False, group="gas"),  # alone in its family
    }
    for name in ("steps100", "base", "steps300", "steps600"):
        f["settings"][name]["family"] = FAMILY
    f["families"] = {
        FAMILY: {
            "settings": [[100, "steps100"], [150, "base"], [300, "steps300"], [600, "steps600"]],
            "modes": {
                "acco": {
                    "lengths": [100, 150, 300, 600],
                    "seeds": ["0", "1", "2"],
                    "at": {
                        "100": _at("steps100", 100, 1.5),
                        "150": _at("base", 150, *at150),
                        "300": _at("steps300", 300, 1.3),
                        "600": _at("steps600", 600, 1.0, low=True),
                    },
                }
            },
        }
    }
    return f


def test_across_lengths_is_used_where_the_within_run_factor_is_a_lower_bound():
    r = quality.choose(_lengths())
    assert r["setting"] == "base" and r["basis"] == "across_lengths" and r["reached"] and r["bound"] is None
    assert (
        r["factor"]["mean"] == 1.6 and r["within_run"]["lower_bound"] and r["across_lengths"]["length"] == 150
    )
    assert quality.verdict(1.45, r)["time_speedup"] == pytest.approx(1.45 / 1.6)
    text = quality.describe(r)
    assert (
        "acco never reached sync's (ZeRO-1's math) final validation loss within the 150 steps in 3 of 3"
        in text
    )
    assert (
        "across run lengths: acco's 240-step run reaches sync's 150-step loss, f = 1.60x [1.50x, 1.70x] (mean of 3 "
        "seeds; the 100/150/300/600-step runs' final losses, interpolated in log steps)" in text
    )


def test_the_within_run_factor_stays_where_it_is_measured():
    r = quality.choose(_lengths(within_reached=True))
    assert r["basis"] == "within_run" and r["factor"]["mean"] == 1.10 and r["across_lengths"] is None


def test_across_lengths_at_the_length_closest_to_the_train_steps():
    r = quality.choose(_lengths(), steps=350)  # steps300 chosen; its family's length closest to 350: 300
    assert r["setting"] == "steps300" and r["across_lengths"]["length"] == 300 and r["factor"]["mean"] == 1.3
    assert "acco's 390-step run reaches sync's 300-step loss, f = 1.30x" in quality.describe(r)


def test_across_lengths_lower_bound_is_still_not_known():
    r = quality.choose(_lengths(), steps=1000)
    assert r["setting"] == "steps600" and r["bound"] == "lower" and not r["reached"]
    assert quality.verdict(1.45, r)["time_speedup"] is None
    assert (
        "across run lengths: even acco's 600-step run stays above sync's 600-step loss in 3 of 3 seeds (the "
        "100/150/300/600-step runs): f > 1.00x, how much more is not measured" in quality.describe(r)
    )
    assert "nor did its 600-step run reach sync's 600-step loss" in quality.unknown_why(r)


def test_the_closest_setting_with_a_measured_factor_is_chosen():
    """gas2 is the closest in tokens per step, but acco never reached sync's loss there and it has no runs of other
    lengths: the closest setting with a measured factor (the base family's, across run lengths) is used instead."""
    r = quality.choose(_lengths(), tokens_per_step=2048)
    assert r["setting"] != "gas2" and r["basis"] == "across_lengths" and r["bound"] is None
    assert "among those with a measured factor" in quality.describe(r)


def test_no_measured_factor_keeps_not_known():
    lengths = _lengths()
    only_gas2 = {**lengths, "settings": {"gas2": lengths["settings"]["gas2"]}, "base_setting": "gas2"}
    r = quality.choose(only_gas2, tokens_per_step=2048)
    assert r["setting"] == "gas2" and r["basis"] == "within_run" and r["bound"] == "lower"
    assert "how many more is not measured (no runs of other lengths" in quality.describe(r)


def test_across_lengths_upper_bound_gives_a_speedup_at_least():
    r = quality.choose(_lengths(at150=(100 / 150, False, True)))
    assert r["bound"] == "upper" and not r["reached"]
    v = quality.verdict(1.45, r)
    assert v["time_speedup"] is None and v["time_speedup_at_least"] == pytest.approx(1.45 * 1.5)
    assert (
        "acco's shortest run, 100 steps, already reaches sync's 150-step loss in 3 of 3 seeds"
        in quality.describe(r)
    )


def test_the_plan_says_which_factor_it_used():
    plan = planner.predict(INPUTS)
    gain = plan.row("acco").samples_per_s / plan.row("zero1").samples_per_s
    rec = planner.recommend(plan, INPUTS, _lengths())
    assert rec["mode"] == "zero1" and "1.60x the steps of ZeRO-1" in rec["reason"]  # 16% samples/s / 1.6 < 1
    assert (
        "(the quality study's setting base, across run lengths: its 240-step run reaches sync's 150-step loss)"
        in (rec["reason"])
    )
    lines = cli.render(plan, rec).splitlines()
    head = next(x for x in lines if x.startswith("time to the same loss"))
    assert "/ 1.60x the steps (across run lengths) = " in head
    regime = next(x for x in lines if x.startswith("regime: "))
    assert "across run lengths: acco's 240-step run reaches sync's 150-step loss, f = 1.60x" in regime
    rec = planner.recommend(plan, INPUTS, _lengths(at150=(100 / 150, False, True)))
    head = next(x for x in cli.render(plan, rec).splitlines() if x.startswith("time to the same loss"))
    assert f"at least {gain * 1.5:.2f}x" in head and rec["mode"] == "acco"
    assert "in time to that loss ACCO gains at least" in rec["reason"]


def _with_variant():
    f = _lengths(within_reached=True)
    f["variant_knobs"] = {"peek_lr_x1.5": {"peek_lr_scale": 1.5}, "peek_m0.5": {"peek_momentum": 0.5}}
    peek = _setting(150, 4096, 2e-3, 0.97, group="base")["modes"]["acco"]
    f["settings"]["base"]["modes"]["peek_lr_x1.5"] = peek
    return f


def test_peek_lr_scale_picks_the_studys_variant():
    f = _with_variant()
    r = quality.choose(f, peek_lr_scale=1.5)
    assert r["run"] == "peek_lr_x1.5" and r["variant"] == "peek_lr_x1.5" and r["factor"]["mean"] == 0.97
    text = quality.describe(r)
    assert "acco's variant peek_lr_x1.5 needs 0.97x the steps of ZeRO-1" in text
    assert "the factor is the study's variant peek_lr_x1.5's (acco with peek_lr_scale=1.5" in text
    other = quality.choose(f, peek_lr_scale=2.0)  # no variant with 2.0: acco's, said so
    assert other["run"] == "acco" and other["variant"] is None and other["factor"]["mean"] == 1.10
    assert "the factor is acco's as specified (peek_lr_scale 1): the study measured no variant with " in (
        quality.describe(other)
    )
    assert quality.choose(f)["run"] == "acco" and quality.choose(f)["run_note"] is None


def test_peek_lr_scale_option_reaches_the_regime(capsys):
    argv = ["--params", "100M", "--nodes", "4", "--gpus-per-node", "8", "--intra-bw", "200GB/s", "--inter-bw",
            "100Gbit/s", "--t-micro-batch", "60ms", "--micro-batch", "8", "--gas", "4"]  # fmt: skip
    inputs, _ = cli.resolve(argv + ["--peek-lr-scale", "1.5"])
    assert inputs.peek_lr_scale == 1.5 and cli.resolve(argv)[0].peek_lr_scale == 1.0
    assert planner.regime(inputs, _with_variant())["run"] == "peek_lr_x1.5"
    plan = planner.predict(inputs)
    text = cli.render(plan, planner.recommend(plan, inputs, _with_variant()))
    assert "acco's variant peek_lr_x1.5 needs 0.97x" in text and "/ 0.97x the steps" in text
    for bad in ("0", "4.5"):
        with pytest.raises(SystemExit):
            cli.main(argv + ["--peek-lr-scale", bad])
        assert "--peek-lr-scale must be in (0, 4]" in capsys.readouterr().err
    with pytest.raises(ValueError, match="peek_lr_scale"):
        dataclasses.replace(INPUTS, peek_lr_scale=0.0)


def test_the_planners_peek_range_is_acco_ds_s():
    from acco_ds import config

    assert quality.MAX_PEEK_LR_SCALE == config.MAX_PEEK_LR_SCALE
