"""benchmarks.topology: two "nodes" as network namespaces joined by a
rate-limited veth pair, one DeepSpeed launcher per node (--hostfile --no_ssh --node_rank), TP inside
a node and ACCO's data parallelism across. It refuses to run without root/iproute2 instead of
faking the link, removes its namespaces afterwards (also when a run fails, an unexpected error
occurs, or it is terminated), and its --quick run works (about 2 minutes on 2 cores)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from acco_ds.cli.launch import LaunchError
from benchmarks.harness import nodes
from benchmarks.topology import cli
from benchmarks.topology import runs as topology_runs
from tests.benchmarks import communicate_or_kill

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("transformers")
NO_NET = nodes.unavailable()
needs_net = pytest.mark.skipif(NO_NET is not None, reason=f"no two-node network here: {NO_NET}")


def _mine(pid: int) -> list:
    return [n for n in nodes.ours() if n.startswith(f"{nodes.PREFIX}_{pid}_")]


def test_refuses_without_the_network(monkeypatch, capsys):
    monkeypatch.setattr(nodes, "unavailable", lambda: "the two-node network needs root (running as uid 1000)")
    assert cli.main(["--quick"]) == 2
    err = capsys.readouterr().err
    assert "cannot build the two-node network" in err and "uid 1000" in err and "does not fake" in err


def test_options_are_checked(capsys):
    for bad, msg in (
        (["--tp", "1"], "--tp must be >= 2"),
        (["--n-head", "3"], "must divide --n-head (3)"),
        (["--contenders", "zero2"], "unknown contender 'zero2'"),
        (["--rates", "fast"], "not 'none' or a tc rate"),
    ):
        with pytest.raises(SystemExit):
            cli.parse(bad)
        assert msg in capsys.readouterr().err


def test_launch_is_the_multi_node_form(tmp_path):
    """Each node's launcher gets the hostfile, --no_ssh, its --node_rank and the master address on
    the link; the command runs inside the node's namespace."""
    cmd = topology_runs.node_command(tmp_path / "hostfile", 1, 29500, ["--module", "m"], nodes.ADDRS[0])
    i = cmd.index("--hostfile")
    assert cmd[i + 1] == str(tmp_path / "hostfile") and "--no_ssh" in cmd
    assert cmd[cmd.index("--node_rank") + 1] == "1" and cmd[cmd.index("--master_addr") + 1] == "10.77.0.1"
    net = nodes.TwoNodes()
    argv = net.wrap(1, nice=-5)("python x.py")
    assert argv[:4] == ["ip", "netns", "exec", net.names[1]] and argv[-1] == "exec nice -n -5 python x.py"
    assert net.env(0)["GLOO_SOCKET_IFNAME"] == "topo0"


@needs_net
def test_network_limits_the_link_only_and_is_removed():
    with nodes.TwoNodes() as net:
        assert sorted(_mine(os.getpid())) == sorted(net.names)
        net.set_rate("50mbit")
        assert "rate 50Mbit" in net.qdisc(0) and "rate 50Mbit" in net.qdisc(1)
        # a node reaches its own address over the loopback (unlimited), the other node over the pair
        route = subprocess.run(
            net.wrap(0)("ip route get 10.77.0.1"), capture_output=True, text=True, timeout=30
        ).stdout
        assert "dev lo" in route
        route = subprocess.run(
            net.wrap(0)("ip route get 10.77.0.2"), capture_output=True, text=True, timeout=30
        ).stdout
        assert "dev topo0" in route
        net.set_rate("none")
        assert "tbf" not in net.qdisc(0)
    assert _mine(os.getpid()) == []


@needs_net
@pytest.mark.parametrize("error", [LaunchError, RuntimeError])
def test_namespaces_are_removed_when_a_run_fails(monkeypatch, tmp_path, capsys, error):
    """The comm probe's launch fails (twice: recorded, exit 1) or raises an unexpected error
    (propagates): either way the namespaces it made are gone afterwards."""
    seen = []

    def probe(setup, net, rate, reps=5):
        seen.append(sorted(_mine(os.getpid())))
        raise error("the ranks exited with status 1 (log: x):\nboom")

    monkeypatch.setattr(topology_runs, "run_comm_probe", probe)
    argv = ["--quick", "--out", str(tmp_path / "r"), "--work", str(tmp_path / "w")]
    if error is LaunchError:
        assert cli.main(argv) == 1
        assert "could not run" in capsys.readouterr().err and len(seen) == 2
    else:
        with pytest.raises(RuntimeError, match="boom"):
            cli.main(argv)
    assert len(seen[0]) == 2  # they existed during the run
    assert _mine(os.getpid()) == []


@needs_net
@pytest.mark.launcher
def test_namespaces_are_removed_when_terminated(tmp_path):
    """SIGTERM while the first launch runs: the launchers are stopped and the namespaces removed."""
    cmd = [sys.executable, "-m", "benchmarks.topology", "--quick", "--contenders", "acco"]
    cmd += ["--out", str(tmp_path / "r"), "--work", str(tmp_path / "w")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not list((tmp_path / "w").glob("*/comm-only/node1.log")):
            time.sleep(0.2)
        assert _mine(proc.pid), "the benchmark did not create its namespaces"
        time.sleep(2)  # the launchers are starting their ranks
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert _mine(proc.pid) == []
    ranks = subprocess.run(
        ["pgrep", "-f", str(tmp_path / "w")], capture_output=True, text=True
    ).stdout.split()
    assert ranks == [], f"processes of the terminated run left: {ranks}"


@needs_net
@pytest.mark.launcher
def test_quick_topology_runs(tmp_path):
    """TP 2 x DP 2 over two namespaces at 200 Mbit/s: the probe, the compute-only bound, ACCO fixed;
    every output written, the namespaces removed, and --from-json re-renders the same table."""
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "benchmarks.topology", "--quick", "--contenders", "acco"]
    cmd += ["--out", str(out), "--work", str(tmp_path / "w")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    log, _ = communicate_or_kill(proc, "benchmarks.topology --quick")
    assert proc.returncode == 0, log[-5000:]
    assert _mine(proc.pid) == []
    raw = json.loads((out / "topology_quick.json").read_text())
    res = raw["results"]
    assert res["setup"]["tp"] == 2 and res["setup"]["world"] == 4 and res["failed"] == []
    comm = res["rates"]["200mbit"]["comm"]
    assert comm["t_comm_s"] > 0 and len(set(comm["slice_numel"])) == 1
    assert res["setup"]["n_params"] == comm["slice_numel"][0] < res["model_params"]  # each rank holds a slice
    run = res["rates"]["200mbit"]["runs"]["acco"]
    assert run["steps"] == 6 and run["samples"] == 6 * 4 * 4 * 2  # samples count the 2 data-parallel replicas
    assert len(run["peak_mem_mib"]) == 4
    assert len(res["compute"][0]["rank_samples_per_s"]) == 2  # one bound job per replica
    run_dir = tmp_path / "w" / "200mbit" / "s0" / "acco"
    assert (run_dir / "hostfile").read_text() == "node0 slots=2\nnode1 slots=2\n"
    assert (run_dir / "node0.log").exists() and (run_dir / "node1.log").exists()  # one launcher per node
    ranks = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(4)]
    assert [(r["rank"], r["world"], r["tp"]) for r in ranks] == [(r, 4, 2) for r in range(4)]
    md = (out / "topology_quick.md").read_text()
    assert "## Goals, under both framings" in md and "| 200mbit | acco |" in md and "## Memory per rank" in md
    assert (out / "topology_quick.png").stat().st_size > 1000
    again = tmp_path / "again"
    assert cli.main(["--from-json", str(out / "topology_quick.json"), "--out", str(again), "--quick"]) == 0
    assert (again / "topology_quick.md").read_text() == md
