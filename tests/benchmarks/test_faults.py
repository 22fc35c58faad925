"""benchmarks.faults: an ACCO job under torchrun's elastic agent on two network-namespace "nodes" loses node 1
(every process SIGKILLed) and heals itself: the agent on node 0 restarts its worker at world size 1, which
resumes from the last complete save and trains to the end. The quick run does it for real (about 90 s on 2
cores); the report's verdicts are checked on a recorded run (tests/benchmarks/fixtures/faults_quick.json)
and on planted failures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.faults import cli, report
from benchmarks.harness import nodes
from tests.benchmarks import communicate_or_kill

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).parent / "fixtures" / "faults_quick.json"
NO_NET = nodes.unavailable()


def recorded() -> dict:
    return json.loads(FIXTURE.read_text())


def test_recorded_run_renders_its_verdicts():
    text, ok = report.render(recorded())
    assert ok
    row = next(ln for ln in text.splitlines() if ln.startswith("| node-lost | 0 |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[-1] == "yes" and cells[7] == "1"  # healed, world size 1 after the restart
    assert "| training resumes on the survivors with no human step within 60 s of the kill |" in text
    assert text.count("| met |") == 3


def _no_restart(rec: dict, res: dict) -> None:
    rec["starts"] = []
    rec.update(cli.healed(rec, res["args"]["steps"]))


def _torn_checkpoint(rec: dict, res: dict) -> None:
    rec["checkpoint"]["complete"] = False
    rec.update(cli.healed(rec, res["args"]["steps"]))


def _slow(rec: dict, res: dict) -> None:
    rec["recovery_s"] = 75.0


def _lost_too_much(rec: dict, res: dict) -> None:
    rec["steps_lost"] = res["args"]["save_every"] + 1


@pytest.mark.parametrize(
    "plant, verdict",
    [
        (_no_restart, "| NO |"),
        (_torn_checkpoint, "| no corrupt checkpoint | latest complete in 0 of 1 jobs | MISSED |"),
        (_slow, "| 75.0 - 75.0 s (median 75.0) | MISSED |"),
        (_lost_too_much, "| 11 | MISSED |"),
    ],
)
def test_planted_failures_are_reported(plant, verdict):
    res = recorded()
    plant(next(r for r in res["cases"] if r["case"] == "node-lost"), res)
    text, ok = report.render(res)
    assert verdict in text, text
    if plant in (_no_restart, _torn_checkpoint):
        assert not ok


def test_from_json_rerenders_the_same_table(tmp_path):
    assert cli.main(["--from-json", str(FIXTURE), "--out", str(tmp_path), "--prefix", "again"]) == 0
    assert (tmp_path / "again.md").read_text() == report.render(recorded())[0]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--quick", "--steps", "20", "--save-every", "10"], "at least three saves"),
        (["--steps", "80", "--save-every", "10"], "at least nine saves"),
    ],
)
def test_options_are_checked(argv, message, capsys):
    with pytest.raises(SystemExit) as err:
        cli.parse(argv)
    assert err.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(NO_NET is not None, reason=f"no two-node network here: {NO_NET}")
@pytest.mark.launcher
def test_quick_run_heals_for_real(tmp_path):
    out = tmp_path / "results"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.faults",
        "--quick",
        "--out",
        str(out),
        "--work",
        str(tmp_path / "w"),
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    # Popen, not run: the namespaces are named after the benchmark's pid, and another test's (a topology run on
    # another worker) may exist at the same time
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = communicate_or_kill(proc, "benchmarks.faults --quick")
    assert proc.returncode == 0, (stdout + stderr)[-5000:]
    res = json.loads((out / "faults_quick.json").read_text())
    (rec,) = [r for r in res["cases"] if r["case"] == "node-lost"]
    assert rec["healed"] and rec["world_after"] == 1 and rec["final_steps"] == res["args"]["steps"]
    assert [s["world"] for s in rec["starts"]] == [
        1
    ]  # only the restarted survivor finished (rank 0's record)
    assert 0 <= rec["steps_lost"] <= res["args"]["save_every"]
    assert rec["resumed_at_step"] > 0 and rec["resumed_at_step"] % res["args"]["save_every"] == 0
    assert [n for n in nodes.ours() if n.startswith(f"{nodes.PREFIX}_{proc.pid}_")] == []  # namespaces gone
