"""The runs of the topology benchmark: one contender, or the comm-only probe, on the two "nodes".

Contract: a run is started as on a cluster without ssh between nodes: one DeepSpeed launcher per
node, inside that node's namespace (``TwoNodes.wrap``), each given the same hostfile
(``node0 slots=P`` / ``node1 slots=P``), ``--no_ssh --node_rank r``, and the master address on
the link (node 0's, 10.77.0.1) and a free port:

    ip netns exec acco_topo_<pid>_n<r> python -m deepspeed.launcher.runner --hostfile H --no_ssh
        --node_rank r --master_addr 10.77.0.1 --master_port P --module acco_ds.cli.worker --spec S

with ``GLOO_SOCKET_IFNAME`` naming the node's end of the link. Consecutive global ranks form a
tensor-parallel group (AutoTP), so each node is one tensor-parallel group and the data-parallel
groups span the nodes. The specs, the records and their figures are the e2e benchmark's
(``benchmarks.harness.runs.contender_spec`` / ``launch_and_summarize``); a launcher that exits non-zero or runs
past the timeout stops the other node's launcher too (its whole process group) and raises
``LaunchError`` with the end of both nodes' logs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from acco_ds.cli.launch import LaunchError, cleanup_shm, free_port, rank_env
from benchmarks.harness import link, runs

COMM_PROBE = "benchmarks.ranks.topology_comm_probe"  # the per-rank module of the comm-only probe


def node_command(hostfile: Path, node: int, port: int, target: list, master: str) -> list:
    """The launcher argv of node ``node`` (run inside its namespace)."""
    cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile)]
    cmd += ["--no_ssh", "--node_rank", str(node), "--master_addr", master, "--master_port", str(port)]
    return cmd + ["--log_level", "warning", *target]


def _stop(proc: subprocess.Popen) -> None:
    """Kill what is left of the launcher's process group (the launcher and the ranks it started;
    a launcher that exited may leave ranks behind), then reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def launch_nodes(net, setup, target: list, log_dir: Path, timeout: float) -> None:
    """Start one launcher per node of ``net`` running ``target`` (argv after the launcher's options)
    and wait for both; LaunchError when one fails or runs past ``timeout``."""
    import shlex

    log_dir.mkdir(parents=True, exist_ok=True)
    per_node = setup.world // len(net.names)
    hostfile = log_dir / "hostfile"
    hostfile.write_text("".join(f"node{i} slots={per_node}\n" for i in range(len(net.names))))
    port = free_port()
    procs, logs = [], []
    try:
        for node in range(len(net.names)):
            cmd = net.wrap(node, setup.nice)(
                shlex.join(node_command(hostfile, node, port, target, net.master_addr))
            )
            env = rank_env(setup.threads, setup.world)
            env.update(link.link_env())
            env.update(net.env(node))
            logs.append(log_dir / f"node{node}.log")
            with open(logs[-1], "w") as fh:
                procs.append(
                    subprocess.Popen(
                        cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
        deadline = time.monotonic() + timeout
        failed = None
        while failed is None and any(p.poll() is None for p in procs):
            for node, p in enumerate(procs):
                if p.poll() not in (None, 0):
                    failed = f"node {node}'s launcher exited with status {p.returncode}"
            if time.monotonic() > deadline:
                failed = f"the run took longer than {timeout:.0f} s"
            time.sleep(0.2)
        if failed is None:
            bad = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
            if bad:
                failed = f"node {bad[0][0]}'s launcher exited with status {bad[0][1]}"
    finally:
        for p in procs:
            _stop(p)
        cleanup_shm(port, setup.world, net.master_addr)
    if failed:
        tails = []
        for log in logs:
            text = log.read_text(errors="replace").splitlines() if log.exists() else []
            tails += [f"--- {log.name}"] + text[-25:]
        raise LaunchError(f"the ranks failed: {failed} (logs: {log_dir}):\n" + "\n".join(tails))


def _runner(net):
    def run(setup, spec, rate):
        path = spec.save()
        (Path(spec.run_dir) / "ds_config.json").write_text(json.dumps(spec.ds_config, indent=2))
        launch_nodes(
            net,
            setup,
            ["--module", "acco_ds.cli.worker", "--spec", str(path)],
            Path(spec.run_dir),
            setup.timeout_s,
        )

    return run


def run_contender(
    setup, net, label: str, rate: str, seed: int, tag: str = "", schedule: dict | None = None
) -> dict:
    """One run of ``label`` (a key of ``runs.CONTENDERS``) across the two nodes, the link at
    ``rate`` (set by the caller with ``net.set_rate``)."""
    spec = runs.contender_spec(setup, label, rate, None, tag, seed, schedule)
    s = runs.launch_and_summarize(setup, spec, rate, run=_runner(net))
    if schedule:
        s["schedule"] = schedule
    return s


def run_comm_probe(setup, net, rate: str, reps: int = 5) -> dict:
    """T_comm of one round at ``rate``: the data-parallel reduction + all-gather of each rank's
    tensor-parallel slice, every data-parallel group at once (``benchmarks.ranks.topology_comm_probe``)."""
    run_dir = setup.work / rate / "comm-only"
    out = run_dir / "comm.json"
    if not out.exists():  # else: a resumed sweep
        target = ["--module", COMM_PROBE, "--model", json.dumps(setup.model), "--tp", str(setup.tp)]
        target += ["--dtype", "bf16" if setup.bf16 else "fp32", "--reps", str(reps), "--out", str(out)]
        launch_nodes(net, setup, target, run_dir, setup.timeout_s)
    return runs.comm_figures(json.loads(out.read_text()))
