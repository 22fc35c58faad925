"""The short version of ``python -m benchmarks.soak`` (the full run's table is benchmarks/results/soak/soak.md): ACCO in
adaptive accumulation on 2 ranks whose speeds change during the run; every micro-batch computed is
committed or discarded by the end-of-run rule, memory, threads and open files stay flat, the loss
goes down. The raw JSON it writes re-renders (``--from-json``) into the very table the run wrote."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.ranks.launch import REPO, rank_env


@pytest.mark.launcher
def test_soak_short(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.soak",
        "--steps",
        "60",
        "--small",
        "--phase",
        "10",
        "--sample-every",
        "2",
        "--check-every",
        "10",
        "--no-write",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=rank_env(), cwd=REPO, capture_output=True, text=True, timeout=600)
    checks = json.loads((tmp_path / "checks.json").read_text()) if (tmp_path / "checks.json").exists() else []
    failed = [c for c in checks if not c["ok"]]
    assert proc.returncode == 0 and checks and not failed, (
        f"rc={proc.returncode}, failed checks: {failed}\n{(proc.stdout + proc.stderr)[-4000:]}"
    )
    res = json.loads((tmp_path / "soak.json").read_text())
    ranks = res["ranks"]
    # the speeds really varied: several phases, different factors per rank
    assert all(len(r["factors"]) >= 5 for r in ranks)
    assert ranks[0]["factors"] != ranks[1]["factors"]
    # adaptive: rounds of several sizes, and rounds where the ranks contributed different counts
    shapes = [tuple(k) for k, _ in ranks[0]["round_shapes"] if k]
    assert len({sum(k) for k in shapes}) > 1, shapes
    assert any(len(set(k)) > 1 for k in shapes), shapes
    names = {c["check"] for c in checks}
    assert {"computed = committed + discarded", "discarded only at the end", "loss went down"} <= names

    # --from-json: the raw JSON alone (copied elsewhere) re-renders the table the run wrote, byte for byte
    again = tmp_path / "again"
    again.mkdir()
    shutil.copy(tmp_path / "soak.json", again / "soak.json")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.soak", "--from-json", str(again / "soak.json")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    written = (tmp_path / "soak.md").read_text()
    assert (again / "soak.md").read_text() == written
    assert "| computed = committed + discarded | pass |" in written and res["command"] in written
