"""benchmarks.faults.memory_state: an ACCO job under torchrun's elastic agent on two network-namespace "nodes", with
``--memory-state`` and no disk save at all, loses node 1 (every process SIGKILLed, its memory folder removed): the
survivor resumes from its node's memory (its own records and the copies of node 1's rank it holds) with at most one
step lost, and trains to the end. The quick run does it for real (about 60 s on 2 cores); the table re-renders from
the committed full run (benchmarks/results/faults/memory_state.json)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.faults import agents, memory_state
from benchmarks.harness import nodes
from tests.benchmarks import communicate_or_kill

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "faults"
NO_NET = nodes.unavailable()


def test_committed_run_rerenders_its_table(tmp_path):
    res = json.loads((RESULTS / "memory_state.json").read_text())
    memory_state.write(res, tmp_path, "again")
    assert (tmp_path / "again.md").read_text() == (RESULTS / "memory_state.md").read_text()


@pytest.mark.parametrize(
    "prefix",
    [
        "memory_state_main",
        "memory_state_main_softirq",
        "memory_state_faults_cost",
        *(f"memory_state_main_run{i}" for i in range(1, 7)),
    ],
)
def test_committed_cost_runs_rerender_their_tables(tmp_path, prefix):
    res = json.loads((RESULTS / f"{prefix}.json").read_text())
    assert memory_state.write(res, tmp_path, "again") == 0  # cost pairs only: nothing to heal
    assert (tmp_path / "again.md").read_text() == (RESULTS / f"{prefix}.md").read_text()


def test_the_cases_rates_and_model_options():
    a = memory_state.parse(["--cases", "cost", "--rates", "400mbit", "--model", "main"])
    assert (a.cases, a.rates, memory_state.MODELS[a.model]) == ("cost", "400mbit", [])
    assert memory_state.samples_per_step(memory_state.MODELS["faults"]) == 4 * 2
    assert memory_state.samples_per_step(memory_state.MODELS["main"]) == 8 * 4  # acco-train's defaults


def test_the_forms_option_and_the_agents_flag(capsys):
    a = memory_state.parse(["--forms", "inputs, state"])
    assert a.forms == ["inputs", "state"]
    for bad in ("inputs,diff", ","):
        with pytest.raises(SystemExit):
            memory_state.parse(["--forms", bad])
        assert "--forms" in capsys.readouterr().err
    base = agents.Setup(steps=1, save_every=0, per_node=1, max_restarts=0, last_call_timeout_s=1,
                        join_timeout_s=1, model_args=[], memory_root="/tmp/x")  # fmt: skip
    argv = agents.agent_command(base, ["10.0.0.1", "10.0.0.2"], 0, 1, "r", Path("/tmp/o"), "acco", 0)
    assert argv[-1] == "--memory-state"
    argv = agents.agent_command(
        dataclasses.replace(base, memory_form="state"),
        ["10.0.0.1", "10.0.0.2"],
        0,
        1,
        "r",
        Path("/tmp/o"),
        "acco",
        0,
    )
    assert argv[-3:] == ["--memory-state", "--memory-state-form", "state"]


def test_a_job_that_lost_more_than_one_step_is_not_healed():
    rec = {
        "starts": [{"restart": 1, "resumed_at_step": 10, "world": 1, "first_step_unix": 5.0, "steps": 40,
                    "val_loss": 3.0}],
        "failures": [{"restart": 0, "step": 12, "unix": 2.0}],
        "kill_unix": 1.0,
        "exit_status": {"0": 0},
    }  # fmt: skip
    got = memory_state.healed(rec, 40, 1)
    assert got["steps_lost"] == 2 and not got["healed"]
    rec["failures"][0]["step"] = 11
    assert memory_state.healed(rec, 40, 1)["healed"]


@pytest.mark.skipif(NO_NET is not None, reason=f"no two-node network here: {NO_NET}")
@pytest.mark.launcher
def test_quick_run_loses_at_most_one_step_without_disk_saves(tmp_path):
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "benchmarks.faults.memory_state", "--quick", "--out", str(out)]
    cmd += ["--work", str(tmp_path / "w")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = communicate_or_kill(proc, "benchmarks.faults.memory_state --quick")
    assert proc.returncode == 0, (stdout + stderr)[-5000:]
    res = json.loads((out / "memory_state_quick.json").read_text())
    (rec,) = [r for r in res["cases"] if r["case"] == "node-lost"]
    assert rec["healed"] and rec["world_after"] == 1 and rec["final_steps"] == res["args"]["steps"]
    assert 0 <= rec["steps_lost"] <= 1 and rec["resumed_at_step"] > 0
    assert not (tmp_path / "w" / "lost_s0" / "checkpoints").exists()  # no disk save at any point
    assert not Path(f"/dev/shm/acco_faults_memory_{proc.pid}").exists()  # the nodes' memory removed
    assert [n for n in nodes.ours() if n.startswith(f"{nodes.PREFIX}_{proc.pid}_")] == []
