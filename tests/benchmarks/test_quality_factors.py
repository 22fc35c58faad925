"""benchmarks.quality.factors: acco-plan's samples-to-loss factors from the quality study's results, on hand-made
results (the interpolated crossing, never reached, the spread over seeds, the tokens per step, bad input naming the
key; across run lengths: the crossing interpolated in log steps, the lower and upper bounds, the within-run factor
at the shortest length, the first crossing of a non-monotone run, families apart by LR, the seeds present at every
length, acco's variants), and the packaged acco_ds/plan/quality_factors.json is exactly what the command writes from
its source."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.quality import factors as fq

ROOT = Path(__file__).resolve().parents[2]
STEPS = [0, 50, 100, 150]


def _run(losses):
    return {"val_step": list(STEPS), "val_loss": list(losses)}


def _results():
    sync = [5.0, 3.0, 2.6, 2.5]
    seeds = {
        # crosses 2.5 between step 100 (2.55) and 150 (2.45): at 125
        "0": {"sync": _run(sync), "acco": _run([5.0, 3.0, 2.55, 2.45]), "dpu": _run([5.0, 3.5, 3.0, 2.9])},
        # reached at step 100 exactly
        "1": {"sync": _run(sync), "acco": _run([5.0, 3.0, 2.5, 2.4]), "dpu": _run([5.0, 3.5, 3.0, 2.8])},
    }
    return {
        "date": "2026-12-01 10:00:00 UTC",
        "command": "python -m benchmarks.quality ...",
        "setup": {"world_size": 2, "context": 64, "eval_every": 50, "seeds": [0, 1]},
        "settings": {
            "base": {
                "setting": {
                    "name": "base",
                    "group": "base",
                    "steps": 150,
                    "lr": 2e-3,
                    "grad_accum": 4,
                    "micro_batch": 8,
                },
                "seeds": seeds,
            },  # fmt: skip
            "w4": {
                "setting": {
                    "name": "w4",
                    "group": "world",
                    "steps": 150,
                    "lr": 2e-3,
                    "grad_accum": 2,
                    "micro_batch": 8,
                    "world_size": 4,
                },
                "seeds": seeds,
            },  # fmt: skip
        },
    }


def _source(tmp_path, results) -> Path:
    path = tmp_path / "run9" / "quality.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"results": results}))
    return path


def test_factor_per_seed_interpolated_on_val_step_with_the_spread(tmp_path):
    doc = fq.factors(_results(), _source(tmp_path, _results()))
    acco = doc["settings"]["base"]["modes"]["acco"]
    assert (
        acco["seeds"]["0"]["steps_to_it"] == pytest.approx(125.0) and acco["seeds"]["1"]["steps_to_it"] == 100
    )
    assert acco["seeds"]["0"]["factor"] == pytest.approx(125 / 150) and acco["seeds"]["0"]["reached"]
    assert acco["factor"] == pytest.approx({"mean": 112.5 / 150, "min": 100 / 150, "max": 125 / 150, "n": 2})
    assert not acco["lower_bound"] and acco["not_reached_seeds"] == []


def test_never_reached_is_flagged_with_the_factor_a_lower_bound(tmp_path):
    doc = fq.factors(_results(), _source(tmp_path, _results()))
    dpu = doc["settings"]["base"]["modes"]["dpu"]
    assert dpu["lower_bound"] and dpu["not_reached_seeds"] == ["0", "1"]
    s0 = dpu["seeds"]["0"]
    assert not s0["reached"] and s0["steps_to_it"] is None and s0["factor"] == 1.0 and s0["lower_bound"]
    assert (s0["best_val_loss"], s0["best_step"]) == (2.9, 150)
    assert "| base | 150 | 4,096 | 0.002 | dpu | >1.000 [1.000, 1.000] | 0, 1 |" in fq.render(doc)


def test_sync_own_steps_to_its_final_loss_is_its_first_crossing(tmp_path):
    """A sync curve that dips to its final loss before the end: the factor divides by that earlier step."""
    r = _results()
    for seed in r["settings"]["base"]["seeds"].values():
        seed["sync"] = _run([5.0, 2.5, 2.7, 2.5])
    doc = fq.factors(r, _source(tmp_path, r))
    s1 = doc["settings"]["base"]["modes"]["acco"]["seeds"]["1"]
    assert s1["sync_steps_to_it"] == 50 and s1["factor"] == pytest.approx(100 / 50)


def test_tokens_lr_steps_and_the_source(tmp_path):
    src = _source(tmp_path, _results())
    doc = fq.factors(_results(), src)
    base, w4 = doc["settings"]["base"], doc["settings"]["w4"]
    assert base["tokens_per_step"] == 8 * 4 * 2 * 64 and w4["tokens_per_step"] == 8 * 2 * 4 * 64
    assert (base["peak_lr"], base["steps"]) == (2e-3, 150) and doc["base_setting"] == "base"
    assert doc["source"]["study"] == "run9" and doc["source"]["date"] == "2026-12-01 10:00:00 UTC"
    assert doc["source"]["path"] == str(src.resolve())  # outside the repository: the full path


@pytest.mark.parametrize(
    ("spoil", "says"),
    [
        (lambda r: r.pop("settings"), "results: no 'settings'"),
        (lambda r: r["settings"]["base"]["seeds"]["0"].pop("sync"), "seeds['0']: no 'sync' run"),
        (lambda r: r["settings"]["base"]["seeds"]["0"]["acco"].pop("val_loss"), ".acco: no 'val_loss'"),
        (lambda r: r["setup"].pop("context"), "setup: no 'context'"),
    ],
)
def test_bad_results_exit_2_naming_the_key(tmp_path, capsys, spoil, says):
    r = _results()
    spoil(r)
    src = _source(tmp_path, r)
    with pytest.raises(SystemExit) as exc:
        fq.main(["--from-json", str(src), "--out", str(tmp_path / "f.json")])
    assert exc.value.code == 2 and says in capsys.readouterr().err
    assert not (tmp_path / "f.json").exists()


# final validation losses per run length: sync S(N), acco M(N) (above S(N) at every N: never reached within a run),
# dpu (already at sync's 150-step loss in its 100-step run), peek_lr_x1.5 (not monotone in N)
S = {100: 2.8, 150: 2.6, 300: 2.4, 600: 2.2}
FINALS = {
    "sync": S,
    "acco": {100: 2.9, 150: 2.7, 300: 2.5, 600: 2.3},
    "dpu": {100: 2.55, 150: 2.5, 300: 2.45, 600: 2.4},
    "peek_lr_x1.5": {100: 2.9, 150: 2.35, 300: 2.5, 600: 2.3},
}
NAMES = {100: "steps100", 150: "base", 300: "steps300", 600: "steps600"}


def _length_run(steps, final, shift=0.0):
    """A curve at 0, steps/2, steps whose middle point is 0.3 above its final loss."""
    return {"val_step": [0, steps // 2, steps], "val_loss": [5.0, final + 0.3 + shift, final + shift]}


def _lengths_results(seeds=("0", "1"), drop=()):
    """A length family (lr 2e-3) beside two settings at lr 4e-3 (another family); ``drop``: (steps, seed) left out."""
    settings = {}
    for lr, lengths in ((2e-3, (100, 150, 300, 600)), (4e-3, (150, 300))):
        for n in lengths:
            name = NAMES[n] if lr == 2e-3 else f"lr_x2_{n}"
            group = "base" if name == "base" else "length" if lr == 2e-3 else "lr"
            setting = {"name": name, "group": group, "steps": n, "lr": lr, "grad_accum": 4, "micro_batch": 8,
                       "world_size": None, "warmup_steps": None}  # fmt: skip
            runs = {
                seed: {who: _length_run(n, f[n], 0.01 * int(seed)) for who, f in FINALS.items()}
                for seed in seeds
                if (n, seed) not in drop
            }
            settings[name] = {"setting": setting, "seeds": runs}
    return {
        "date": "2026-12-03 10:00:00 UTC",
        "command": "python -m benchmarks.quality ...",
        "setup": {
            "world_size": 2,
            "context": 64,
            "warmup_steps": 15,
            "eval_every": 50,
            "seeds": [0, 1],
            "variant_knobs": {"peek_lr_x1.5": {"peek_lr_scale": 1.5}, "est_x0": {"est_scale": 0.0}},
        },
        "settings": settings,
    }


def _lengths_doc(tmp_path, **kw):
    r = _lengths_results(**kw)
    return fq.factors(r, _source(tmp_path, r))


FAMILY = "lr=0.002 gas=4 mb=8 world=2 warmup=15"


def test_across_lengths_crossing_is_interpolated_in_log_steps(tmp_path):
    doc = _lengths_doc(tmp_path)
    fam = doc["families"][FAMILY]
    assert fam["settings"] == [[100, "steps100"], [150, "base"], [300, "steps300"], [600, "steps600"]]
    assert doc["settings"]["base"]["family"] == FAMILY and doc["settings"]["steps600"]["family"] == FAMILY
    acco = fam["modes"]["acco"]
    assert acco["lengths"] == [100, 150, 300, 600] and acco["seeds"] == ["0", "1"]
    assert acco["final_val_loss"]["acco"]["0"] == [2.9, 2.7, 2.5, 2.3]
    at150 = acco["at"]["150"]
    # S(150) = 2.6 lies halfway from M(150) = 2.7 to M(300) = 2.5: halfway in log N, N' = 150 x sqrt(2), not 225
    s0 = at150["seeds"]["0"]
    assert s0["steps"] == pytest.approx(150 * math.sqrt(2)) and s0["factor"] == pytest.approx(math.sqrt(2))
    assert s0["between"] == [150, 300] and not (s0["lower_bound"] or s0["upper_bound"] or s0["within_run"])
    assert at150["factor"] == pytest.approx({"mean": 2**0.5, "min": 2**0.5, "max": 2**0.5, "n": 2})
    assert at150["setting"] == "base" and not (at150["lower_bound"] or at150["upper_bound"])
    # S(100) = 2.8 between M(100) = 2.9 and M(150) = 2.7, halfway: N' = 100 x sqrt(1.5)
    assert acco["at"]["100"]["factor"]["mean"] == pytest.approx(math.sqrt(1.5))
    # the within-run factor stays what it was: acco never reached sync's final loss in its own run
    assert doc["settings"]["base"]["modes"]["acco"]["lower_bound"]


def test_across_lengths_lower_bound_where_no_length_reaches_it(tmp_path):
    at600 = _lengths_doc(tmp_path)["families"][FAMILY]["modes"]["acco"]["at"]["600"]
    assert at600["lower_bound"] and at600["lower_bound_seeds"] == ["0", "1"] and not at600["upper_bound"]
    s0 = at600["seeds"]["0"]
    assert s0["factor"] == 1.0 and s0["steps"] is None and s0["lower_bound"]  # N_max / N = 600 / 600


def test_across_lengths_upper_bound_and_the_within_run_factor_at_the_shortest(tmp_path):
    doc = _lengths_doc(tmp_path)
    dpu = doc["families"][FAMILY]["modes"]["dpu"]["at"]
    # M(100) = 2.55 <= S(150) = 2.6: the shortest run already reaches it, f <= 100 / 150
    assert dpu["150"]["upper_bound"] and dpu["150"]["factor"]["mean"] == pytest.approx(100 / 150)
    assert dpu["150"]["upper_bound_seeds"] == ["0", "1"] and dpu["150"]["seeds"]["0"]["steps"] is None
    # at the shortest length itself: f <= 1, the within-run crossing (2.8 between 2.85 at 50 and 2.55 at 100)
    at100 = dpu["100"]
    within = doc["settings"]["steps100"]["modes"]["dpu"]["seeds"]["0"]["factor"]
    assert within == pytest.approx((50 + 50 * 0.05 / 0.3) / 100)
    assert at100["seeds"]["0"]["within_run"] and at100["seeds"]["0"]["factor"] == pytest.approx(within)
    assert at100["within_run_seeds"] == ["0", "1"] and not (at100["lower_bound"] or at100["upper_bound"])
    # S(300) = 2.4 first met by M(600) = 2.4 exactly: N' = 600
    assert dpu["300"]["factor"]["mean"] == pytest.approx(2.0) and dpu["300"]["seeds"]["0"]["between"] == [
        300,
        600,
    ]


def test_across_lengths_takes_the_first_crossing_from_the_shortest(tmp_path):
    peek = _lengths_doc(tmp_path)["families"][FAMILY]["modes"]["peek_lr_x1.5"]["at"]
    # S(300) = 2.4: M = 2.9, 2.35, 2.5, 2.3; the first crossing is between 100 and 150, not between 300 and 600
    s0 = peek["300"]["seeds"]["0"]
    assert s0["between"] == [100, 150]
    assert s0["steps"] == pytest.approx(100 * 1.5 ** (0.5 / 0.55)) and s0["factor"] == pytest.approx(
        s0["steps"] / 300
    )


def test_families_are_apart_by_lr_and_one_length_makes_none(tmp_path):
    doc = _lengths_doc(tmp_path)
    assert set(doc["families"]) == {FAMILY, "lr=0.004 gas=4 mb=8 world=2 warmup=15"}
    other = doc["families"]["lr=0.004 gas=4 mb=8 world=2 warmup=15"]
    assert other["settings"] == [[150, "lr_x2_150"], [300, "lr_x2_300"]] and other["lr"] == 4e-3
    assert other["modes"]["acco"]["lengths"] == [150, 300]
    # the within-run-only results: base and w4 differ in world size and GAS, each alone in its family
    plain = fq.factors(_results(), _source(tmp_path / "p", _results()))
    assert plain["families"] == {} and plain["settings"]["base"]["family"] is None
    assert "across run lengths" in fq.render(
        doc
    ) and "| acco | 150 | 212 | 1.414 [1.414, 1.414] | 0, 1 | - |" in fq.render(doc)


def test_across_lengths_uses_only_the_seeds_present_at_every_length(tmp_path):
    acco = _lengths_doc(tmp_path, drop={(600, "1")})["families"][FAMILY]["modes"]["acco"]
    assert acco["seeds"] == ["0"] and acco["at"]["150"]["factor"]["n"] == 1 and acco["lengths"][-1] == 600
    # no seed at every length: the length with the fewest seeds is left out
    acco = _lengths_doc(tmp_path / "b", drop={(600, "1"), (300, "0")})["families"][FAMILY]["modes"]["acco"]
    assert acco["dropped_lengths"] == [600] and acco["lengths"] == [100, 150, 300] and acco["seeds"] == ["1"]


def test_every_run_name_is_measured_with_the_variants_knobs(tmp_path):
    doc = _lengths_doc(tmp_path)
    assert doc["runs"] == ["acco", "dpu", "peek_lr_x1.5"]  # the modes first, then the variants
    assert doc["variant_knobs"] == {"peek_lr_x1.5": {"peek_lr_scale": 1.5}}  # only the variants that ran
    peek = doc["settings"]["base"]["modes"]["peek_lr_x1.5"]
    assert not peek["lower_bound"] and peek["factor"]["n"] == 2
    assert doc["settings"]["base"]["warmup_steps"] == 15


def test_the_packaged_factors_are_what_the_command_writes_from_their_source(tmp_path):
    """acco_ds/plan/quality_factors.json is made by this command only: regenerated from the results file it names,
    it comes out byte for byte the same (regenerate it after a new study run, never edit it)."""
    packaged = ROOT / "acco_ds" / "plan" / "quality_factors.json"
    doc = json.loads(packaged.read_text())
    source = ROOT / doc["source"]["path"]
    out = tmp_path / "again.json"
    assert fq.main(["--from-json", str(source), "--out", str(out)]) == 0
    assert out.read_text() == packaged.read_text()
