"""The quality study's whole flow on a tiny setting (``python -m benchmarks.quality``): its files and their shape, and
runs that are the single-process reference's own: the recorded validation losses and norms of sync and acco equal
those of a plain ``reference_run`` on the same model, data and schedule."""

from __future__ import annotations

import json

import pytest
import torch

from acco_ds.core.reference import reference_run
from benchmarks.quality import cli, study

STEPS, EVERY = 4, 2
TINY = [
    "--settings", "base", "--seeds", "0", "--base-steps", str(STEPS), "--eval-every", str(EVERY),
    "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--context", "16", "--eval-windows", "8",
]  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("quality")
    torch_threads = torch.get_num_threads()
    try:
        assert cli.main([*TINY, "--out", str(out / "run"), "--work", str(out / "work")]) == 0
    finally:
        torch.set_num_threads(torch_threads)
    return out / "run", cli.parse([*TINY, "--out", str(out / "other")])


def test_files_and_their_shape(tiny):
    run, _ = tiny
    res = json.loads((run / "quality.json").read_text())["results"]
    assert res["setup"]["modes"] == ["sync", "dpu", "acco"]
    runs = res["settings"]["base"]["seeds"]["0"]
    for mode in study.MODES:
        rec = runs[mode]
        assert rec["val_step"] == [0, 2, 4]
        assert len(rec["val_loss"]) == 3 and len(rec["train_loss"]) == STEPS and len(rec["norm"]) == STEPS
        assert all(v == v and 0 < v < 10 for v in rec["val_loss"])
    est = runs["acco"]["estimate"]
    assert est["step"] == [1, 2, 3] and len(est["est_dist"]) == 3 and len(est["step_dist"]) == 3
    assert "estimate" not in runs["sync"]
    assert set(res["analysis"]["base"]["final_gap"]) == {"dpu", "acco"}
    md = (run / "quality.md").read_text()
    assert "## Final validation loss and gap to sync" in md and "| base | 4 |" in md
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (run / "quality_gap.png").stat().st_size > 0 and (run / "quality_estimate.png").stat().st_size > 0


def test_from_json_renders_the_same_table(tiny, tmp_path):
    run, _ = tiny
    (tmp_path / "quality.json").write_text((run / "quality.json").read_text())
    assert cli.main(["--from-json", str(tmp_path / "quality.json")]) == 0
    assert (tmp_path / "quality.md").read_text() == (run / "quality.md").read_text()


@pytest.mark.parametrize("mode", ["sync", "acco"])
def test_the_runs_are_a_plain_reference_run(tiny, mode):
    run, a = tiny
    rec = json.loads((run / "quality.json").read_text())["results"]["settings"]["base"]["seeds"]["0"][mode]
    problem = study.Problem(cli.make_setup(a), cli.make_setting("base", STEPS), 0)
    plain = reference_run(
        mode, [problem.theta0], problem.grad_fn, steps=STEPS, **problem.reference_kwargs(mode)
    )
    assert rec["norm"] == pytest.approx(plain.norms, rel=0, abs=0)
    at = {0: problem.theta0, **{t + 1: p[0] for t, p in enumerate(plain.params)}}
    assert rec["val_loss"] == [problem.val_loss(at[s]) for s in rec["val_step"]]
