"""Multi-node launch: the ``deepspeed`` launcher's multi-node path, one launcher per
node (``--hostfile`` + ``--no_ssh --node_rank r``, master 127.0.0.1), starts 2 nodes x 1 rank on this
machine, and ACCO trains to exactly the parameters of a single-node 2-rank run (docs/MULTINODE.md)."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from tests.ranks import toy
from tests.ranks.launch import REPO, deepspeed_cmd, free_port, rank_env, run_scenarios

pytestmark = pytest.mark.launcher  # starts ranks through a launcher (left out by make test-fast)

NODES = 2


def scenarios() -> list:
    out = []
    for mode, dtype in (("acco", "fp32"), ("dpu", "bf16"), ("sync", "fp32")):
        out.append(
            {
                "name": f"{mode}_{dtype}",
                "steps": 4,
                "config": {
                    "train_micro_batch_size_per_gpu": toy.MICRO_BATCH,
                    "gradient_accumulation_steps": 4,
                    "optimizer": {"type": "ACCO", "params": {"lr": 0.02, "weight_decay": 0.1, "mode": mode}},
                    "zero_optimization": {"stage": 1},
                    "gradient_clipping": 0.5,
                    "bf16": {"enabled": dtype == "bf16"},
                    "steps_per_print": 10**9,
                },
            }
        )
    return out


def launch_nodes(tmp) -> list:
    """One ``deepspeed --hostfile H --no_ssh --node_rank r`` per node, as on a cluster without ssh
    between nodes (each node's job step runs its own launcher). Returns the launchers' outputs."""
    hostfile = tmp / "hostfile"
    hostfile.write_text("".join(f"node{i} slots=1\n" for i in range(NODES)))
    spec = tmp / "scenarios.json"
    spec.write_text(json.dumps(scenarios()))
    port = free_port()
    procs = []
    for node in range(NODES):
        cmd = deepspeed_cmd() + [
            "--hostfile",
            str(hostfile),
            "--no_ssh",
            "--node_rank",
            str(node),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
            str(REPO / "tests" / "ranks" / "worker.py"),
            "--scenarios",
            str(spec),
            "--out",
            str(tmp),
        ]
        procs.append(
            subprocess.Popen(
                cmd, env=rank_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs = []
    for node, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        assert proc.returncode == 0, f"node {node} launcher failed (rc={proc.returncode}):\n{out[-6000:]}"
        outputs.append(out)
    return outputs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    multi = tmp_path_factory.mktemp("two_nodes")
    logs = launch_nodes(multi)
    single = run_scenarios(2, scenarios(), tmp_path_factory.mktemp("one_node"))
    return logs, torch.load(multi / "results.pt", weights_only=False), single


def test_two_launchers_form_one_job(runs):
    logs, multi, _ = runs
    for node, log in enumerate(logs):
        assert f"nnodes={NODES}, num_local_procs=1, node_rank={node}" in log, log[-3000:]
    assert all(res["world_size"] == NODES for res in multi.values())


@pytest.mark.parametrize("name", [s["name"] for s in scenarios()])
def test_same_parameters_as_single_node(runs, name):
    _, multi, single = runs
    a, b = multi[name], single[name]
    assert len(a["traj"]) == len(b["traj"]) == 4
    for t, (x, y) in enumerate(zip(a["traj"], b["traj"])):
        assert torch.equal(x, y), f"{name} step {t + 1}: max |diff| {(x - y).abs().max().item():.3e}"
    assert torch.equal(a["final_model"], b["final_model"])
    assert (a["traj"][-1] - a["traj"][0]).abs().max() > 1e-3  # it trained
