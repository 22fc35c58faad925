"""benchmarks.plan_validation predicts every (rate, contender) of an e2e sweep and of a topology sweep
from their separately measured inputs, and ``--from-json`` re-renders the same document.

The inputs are small fixtures, not the committed sweeps: ``fixtures/e2e_small.json`` holds two
rates (none, 400mbit) of four contenders, two compute-only runs and the heterogeneous case of
``benchmarks/results/e2e/e2e.json``; ``fixtures/topology_small.json`` one rate of two contenders of
``benchmarks/results/topology/topology.json``; ``fixtures/e2e_compression_small.json`` one rate (50mbit) of
four contenders of ``benchmarks/results/e2e/e2e_compression.json`` (one of them, int4, has no plan row); each
reduced to the keys the validation reads."""

from __future__ import annotations

import json
from pathlib import Path

from acco_ds.plan.model import COMPRESSED_CONTENDERS, CONTENDERS
from benchmarks.plan_validation import cli as plan_validation

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def test_validation_script_reruns_from_its_inputs(tmp_path):
    e2e_path, topo_path = FIXTURES / "e2e_small.json", FIXTURES / "topology_small.json"
    comp_path = FIXTURES / "e2e_compression_small.json"
    argv = ["--out", str(tmp_path), "--e2e", str(e2e_path), "--topology", str(topo_path)]
    argv += ["--e2e-compression", str(comp_path)]
    argv += ["--memory", str(tmp_path / "absent.json"), "--kernels", str(tmp_path / "absent.md")]
    assert plan_validation.main(argv) == 0
    v = json.loads((tmp_path / "plan_validation.json").read_text())
    for key, path in (("e2e", e2e_path), ("topology", topo_path), ("e2e_compression", comp_path)):
        res = json.loads(path.read_text())["results"]
        rows = {(r["rate"], r["contender"]) for r in v[key]["rows"]}
        predicted = CONTENDERS + COMPRESSED_CONTENDERS
        want = {(rate, c) for rate, b in res["rates"].items() for c in b["runs"] if c in predicted}
        assert rows == want and all(r["predicted_step_s"] > 0 for r in v[key]["rows"]), key
    assert {r["contender"] for r in v["e2e"]["hetero"]} == {"zero1", "acco", "acco-adaptive"}
    assert v["memory"] is None
    md = (tmp_path / "plan_validation.md").read_text()
    assert "No bench_memory results were found" in md
    assert {r["contender"] for r in v["e2e_compression"]["rows"]} == {"zero1", "sync-int8", "acco-int8"}
    # the int8 rows are predicted from the compressed bytes: within 15% of the measured step (the plan's
    # uncompressed time at this link is ~3.5x longer)
    assert all(abs(r["step_err"]) < 0.15 for r in v["e2e_compression"]["rows"])
    assert "## Step time, compressed rounds" in md
    again = tmp_path / "again"
    assert (
        plan_validation.main(["--from-json", str(tmp_path / "plan_validation.json"), "--out", str(again)])
        == 0
    )
    assert (again / "plan_validation.md").read_text() == md
