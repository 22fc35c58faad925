"""benchmarks.quality.factors: acco-plan's samples-to-loss factors from the quality study's results, on hand-made
results (the interpolated crossing, never reached, the spread over seeds, the tokens per step, bad input naming the
key), and the packaged acco_ds/plan/quality_factors.json is exactly what the command writes from its source."""

from __future__ import annotations

import json
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
    path.parent.mkdir()
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


def test_the_packaged_factors_are_what_the_command_writes_from_their_source(tmp_path):
    """acco_ds/plan/quality_factors.json is made by this command only: regenerated from the results file it names,
    it comes out byte for byte the same (regenerate it after a new study run, never edit it)."""
    packaged = ROOT / "acco_ds" / "plan" / "quality_factors.json"
    doc = json.loads(packaged.read_text())
    source = ROOT / doc["source"]["path"]
    out = tmp_path / "again.json"
    assert fq.main(["--from-json", str(source), "--out", str(out)]) == 0
    assert out.read_text() == packaged.read_text()
