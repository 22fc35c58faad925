"""Fault benchmark: an ACCO job under torchrun's elastic agent on two "nodes" loses a node and heals itself.

    python -m benchmarks.faults                 # 3 seeds + the save and rendezvous-host cases (about 10 min on 2 cores)
    python -m benchmarks.faults --quick         # one seed, fewer steps, no reference runs (the test)
    python -m benchmarks.faults --from-json benchmarks/results/faults/faults.json   # re-render

The nodes are the topology benchmark's two network namespaces joined by a tc-limited veth pair
(``benchmarks.harness.nodes.TwoNodes``; ``--rate``). Each node runs one torchrun agent
(``benchmarks.faults.agents``: ``--nnodes 1:2 --max-restarts N --rdzv-backend c10d``, rendezvous on node 0),
whose workers run ``acco-train --mode acco --save-every E`` (``acco_ds.cli.in_launcher``): each start resumes
from the last complete save at the world size it has. Per seed:

- ``reference``: the job with nothing killed (ACCO), and the same job with DeepSpeed ZeRO-1 AdamW (its seed
  spread of the validation loss is the tolerance);
- ``node-lost``: every process of node 1 is SIGKILLed at a step drawn at random (seeded): after the save at a
  drawn step and a drawn fraction of a save interval. Recorded: the kill time; when the survivor's rank saw
  the loss (its ``failures.jsonl``); when the restarted survivor completed its first optimizer
  step (``starts.jsonl``): the recovery time; the steps lost (the survivor's last completed step minus the
  step the restart resumed at); the checkpoint folder complete (``latest`` names a save with every rank's
  files, the restart loaded it); the final validation loss against the reference's.

Once (seed 0): ``killed-during-save`` (a larger model; node 1 killed as soon as a save's folder appears and
before ``latest`` names it: the restart resumes from the last complete save, and the partial folder is written
over later; no reference run: its loss is not compared) and
``rendezvous-host-lost`` (node 0, which hosts the c10d store and rank 0, is killed: node 1's agent cannot
re-rendezvous; recorded: how long until it stops and its last error line), and ``two-nodes-lost``: three nodes
on a bridge (``BridgedNodes(3)``, ``--nnodes 1:3``), node 2 killed, then node 1 once the job healed and saved
five more times, down to the minimum of one node; per kill the recovery time and the steps lost. Writes ``<prefix>.md`` and
``<prefix>.json`` into ``--out`` (default ``benchmarks/results/faults/``).

Exit status: 0 when every case ran and healed (or, for the rendezvous host, stopped) as described; 1 when one
did not (the others are still written); 2 when this machine cannot build the two-node network.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

from acco_ds.cli.metrics import machine_info
from benchmarks.faults import agents, report
from benchmarks.harness import nodes
from benchmarks.harness.cli import parser
from benchmarks.harness.records import results_dir
from benchmarks.harness.sweep import seeds_arg


def parse(argv=None) -> argparse.Namespace:
    ap = parser("faults", __doc__)
    ap.add_argument("--quick", action="store_true", help="one seed, 60 steps, no reference runs (the test)")
    ap.add_argument("--seeds", type=seeds_arg, default=None, help="default 0,1,2; quick 0")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per job (default 150, quick 60)")
    ap.add_argument("--save-every", type=int, default=10, help="steps between two saves")
    ap.add_argument("--rate", default="400mbit", help="the inter-node link's tc rate")
    ap.add_argument("--per-node", type=int, default=1, help="ranks per node")
    ap.add_argument("--max-restarts", type=int, default=3, help="torchrun --max-restarts")
    ap.add_argument("--last-call-timeout", type=int, default=5, help="rendezvous last_call_timeout (s)")
    ap.add_argument("--join-timeout", type=int, default=60, help="rendezvous join_timeout (s)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a job may take")
    ap.add_argument("--out", default=str(results_dir("faults")), help="folder of the table and JSON")
    ap.add_argument("--prefix", default=None, help="file name prefix (default faults, quick: faults_quick)")
    ap.add_argument("--work", default=None, help="scratch folder of the jobs (default: a new temp folder)")
    ap.add_argument("--from-json", default=None, help="re-render the table from a saved raw JSON")
    a = ap.parse_args(argv)
    if not a.seeds:
        a.seeds = [0] if a.quick else [0, 1, 2]
    a.steps = a.steps or (60 if a.quick else 150)
    a.prefix = a.prefix or ("faults_quick" if a.quick else "faults")
    if a.save_every < 1 or a.steps < 3 * a.save_every:
        ap.error(f"--steps {a.steps} must hold at least three saves of --save-every {a.save_every}")
    if (
        not a.quick and a.steps < 9 * a.save_every
    ):  # two-nodes-lost: kills after 2 and 2 + 5 saves, then 2 more
        ap.error(
            f"--steps {a.steps} must hold at least nine saves of --save-every {a.save_every} (two nodes lost)"
        )
    return a


MODEL_ARGS = ["--n-layer", "2", "--d-model", "64", "--n-head", "2", "--context", "64", "--micro-batch", "4",
              "--grad-accum", "2", "--warmup-steps", "5", "--lr", "3e-3", "--eval-windows", "32"]  # fmt: skip


# the killed-during-save case: a larger model, so that a save takes long enough (tenths of a second) for the
# kill to land while node 1 is still writing its shard
SAVE_CASE_MODEL_ARGS = ["--n-layer", "4", "--d-model", "256", "--n-head", "4", "--context", "64", "--micro-batch",
                        "2", "--grad-accum", "2", "--warmup-steps", "5", "--lr", "1e-3", "--eval-windows", "16"]  # fmt: skip


def _read_jsonl(path: Path) -> list:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _starts(out: Path, mode: str) -> list:
    return _read_jsonl(out / "runs" / mode / "starts.jsonl")


def _failures(out: Path, mode: str) -> list:
    return _read_jsonl(out / "runs" / mode / "failures.jsonl")


def checkpoint_complete(out: Path) -> dict:
    """Whether ``latest`` names a save holding the model states and one optimizer shard per rank of the
    world that wrote it (DeepSpeed's ``dp_world_size`` in the model states file)."""
    import torch

    tag = agents.latest_step(out)
    folder = agents.checkpoint_dir(out) / f"step{tag}"
    model = folder / "mp_rank_00_model_states.pt"
    if not tag or not model.exists():
        return {"latest": tag, "complete": False, "why": "latest names no save with model states"}
    world = int(torch.load(model, map_location="cpu", weights_only=False).get("dp_world_size", 0))
    shards = sorted(folder.glob("zero_pp_rank_*_mp_rank_00_optim_states.pt"))
    ok = world > 0 and len(shards) == world
    return {"latest": tag, "world": world, "shards": len(shards), "complete": ok}


def run_job(net, setup, out: Path, mode: str, seed: int, timeout: float, fault=None) -> dict:
    """One job; ``fault(job)`` (optional) runs while it trains and returns what it did (a dict)."""
    job = agents.Job(net, setup, out, mode, seed)
    record = {"mode": mode, "seed": seed}
    try:
        record["start_unix"] = job.start()
        if fault is not None:
            record.update(fault(job))
        statuses = job.wait(timeout)
        record["exit_status"] = {str(n): s for n, s in statuses.items()}
        record["end_unix"] = time.time()
        if any(s is None for s in statuses.values()):
            record["error"] = f"the job ran past {timeout:.0f} s"
    finally:
        job.stop()
    record["starts"] = _starts(out, mode)
    record["failures"] = _failures(out, mode)
    record["checkpoint"] = checkpoint_complete(out)
    if record.get("error") or any(s not in (0, None) for s in record["exit_status"].values()):
        record["log_tail"] = job.log_tail()
    return record


def kill_at_random_step(rng: random.Random, setup, timeout: float):
    """The fault of ``node-lost``: after the save at a drawn step S, wait a drawn fraction of the time the
    previous save interval took, then SIGKILL node 1."""
    saves = setup.steps // setup.save_every
    at = setup.save_every * rng.randint(1, max(1, saves * 2 // 3 - 1))
    fraction = rng.random()

    def fault(job) -> dict:
        alive = job.all_running
        previous = (
            agents.wait_for_save(job.out, at - setup.save_every, timeout, alive)
            if at > setup.save_every
            else 0
        )
        t_prev = time.time()
        got = agents.wait_for_save(job.out, at, timeout, alive)
        interval = time.time() - t_prev if previous else 0.0
        time.sleep(fraction * interval)
        return {
            "kill_after_save": got,
            "kill_fraction": fraction,
            "kill_unix": job.kill_node(1),
            "killed_node": 1,
        }

    return fault


def kill_during_save(setup, timeout: float):
    def fault(job) -> dict:
        alive = job.all_running
        first = agents.wait_for_save(job.out, setup.save_every, timeout, alive)
        saving = agents.wait_for_new_save_folder(job.out, first, timeout, alive)
        latest_at_kill = agents.latest_step(job.out)
        t = job.kill_node(1)
        return {"saving_step": saving, "latest_at_kill": latest_at_kill, "kill_unix": t, "killed_node": 1}

    return fault


def kill_rendezvous_host(setup, timeout: float):
    def fault(job) -> dict:
        alive = job.all_running
        got = agents.wait_for_save(job.out, setup.save_every, timeout, alive)
        return {"kill_after_save": got, "kill_unix": job.kill_node(0), "killed_node": 0}

    return fault


def kill_two_in_turn(setup, timeout: float):
    """Three nodes: node 2 killed after the save at 2 x save_every; once the restarted job (two nodes) has saved
    five more times, node 1 too. Node 0 finishes alone."""

    def fault(job) -> dict:
        alive = job.node0_running
        first = agents.wait_for_save(job.out, 2 * setup.save_every, timeout, alive)
        t1 = job.kill_node(2)
        second = agents.wait_for_save(job.out, first + 5 * setup.save_every, timeout, alive)
        t2 = job.kill_node(1)
        return {
            "kills": [
                {"node": 2, "after_save": first, "unix": t1},
                {"node": 1, "after_save": second, "unix": t2},
            ]
        }

    return fault


def _after(kill_unix: float, records: list) -> dict | None:
    """The first start (a record of ``starts.jsonl`` or of rank 0's ``failures.jsonl``) whose first optimizer
    step came after ``kill_unix``."""
    later = [r for r in records if (r.get("first_step_unix") or 0) > kill_unix]
    return min(later, key=lambda r: r["first_step_unix"]) if later else None


def healed_twice(rec: dict, steps: int) -> dict:
    """The figures of the two-nodes-lost job, per kill: the start that followed it (the step it resumed at,
    when its first step completed) and what the ranks that the kill stopped had reached (their failure
    records between the kill and that first step; a rank its agent stopped to restart it leaves none)."""
    starts = [*(f for f in rec["failures"] if f["rank"] == 0), *rec["starts"]]
    out = {"per_kill": [], "healed": False}
    for kill in rec.get("kills", []):
        item = {"node": kill["node"], "after_save": kill["after_save"]}
        after = _after(kill["unix"], starts)
        until = after["first_step_unix"] if after else float("inf")
        ended = [f for f in rec["failures"] if kill["unix"] < f["unix"] < until]
        if ended:
            item["last_step_before"] = max(f["step"] for f in ended)
            item["detected_s"] = min(f["unix"] for f in ended) - kill["unix"]
        if after is not None:
            item["resumed_at_step"] = after["resumed_at_step"]
            item["recovery_s"] = after["first_step_unix"] - kill["unix"]
            if ended:
                item["steps_lost"] = item["last_step_before"] - after["resumed_at_step"]
        out["per_kill"].append(item)
    final = rec["starts"][-1] if rec["starts"] else None
    if final is not None:
        out["final_steps"], out["val_loss"], out["world_after"] = (
            final["steps"],
            final["val_loss"],
            final["world"],
        )
        out["healed"] = (
            final["steps"] == steps
            and final["world"] == 1
            and rec["exit_status"].get("0") == 0
            and rec["checkpoint"]["complete"]
            and len(out["per_kill"]) == 2
            and all("recovery_s" in k and "steps_lost" in k for k in out["per_kill"])
        )
    return out


def healed(rec: dict, steps: int) -> dict:
    """The figures of a job that lost node 1: recovery time, steps lost, final state."""
    restarts = [s for s in rec["starts"] if s.get("restart", 0) > 0]
    lost = [f for f in rec["failures"] if f.get("restart", 0) == 0]
    out = {"healed": False}
    if not restarts:
        return out
    first = restarts[0]
    out["resumed_at_step"] = first["resumed_at_step"]
    out["world_after"] = first["world"]
    if first.get("first_step_unix") and rec.get("kill_unix"):
        out["recovery_s"] = first["first_step_unix"] - rec["kill_unix"]
    if lost:
        out["detected_s"] = min(f["unix"] for f in lost) - rec["kill_unix"]
        out["last_step_before"] = max(f["step"] for f in lost)
        out["steps_lost"] = out["last_step_before"] - first["resumed_at_step"]
    final = rec["starts"][-1]
    out["final_steps"] = final["steps"]
    out["val_loss"] = final["val_loss"]
    out["healed"] = (
        final["steps"] == steps
        and rec["exit_status"].get("0") == 0
        and rec["checkpoint"]["complete"]
        and first["world"] == 1
    )
    return out


def _case(
    res: dict, net, setup, folder: Path, seed: int, timeout: float, fault, case: str, figures=None
) -> None:
    """Run one faulted job of ``case``, add ``figures(rec, steps)`` (healed / healed_twice) to its record."""
    rec = run_job(net, setup, folder, "acco", seed, timeout, fault)
    rec["case"] = case
    if figures is not None:
        rec.update(figures(rec, setup.steps))
    res["cases"].append(rec)
    print(f"{case} seed {seed}: {report.summary_line(rec)}", flush=True)


def run(a) -> dict:
    setup = agents.Setup(
        steps=a.steps,
        save_every=a.save_every,
        per_node=a.per_node,
        max_restarts=a.max_restarts,
        last_call_timeout_s=a.last_call_timeout,
        join_timeout_s=a.join_timeout,
        model_args=MODEL_ARGS,
    )
    work = Path(a.work or tempfile.mkdtemp(prefix="acco_faults_"))
    res = {"args": {k: v for k, v in vars(a).items()}, "machine": machine_info(), "cases": []}
    nodes.remove_stale()
    with nodes.TwoNodes() as net:
        net.set_rate(a.rate)
        res["link"] = {"rate": a.rate, "qdisc_node0": net.qdisc(0)}
        for seed in a.seeds:
            if not a.quick:
                for mode in ("acco", "zero1"):
                    rec = run_job(net, setup, work / f"ref_{mode}_s{seed}", mode, seed, a.timeout)
                    rec["case"] = "reference"
                    res["cases"].append(rec)
                    print(f"reference {mode} seed {seed}: {rec['starts'][-1:]}", flush=True)
            fault = kill_at_random_step(random.Random(seed), setup, a.timeout)
            _case(res, net, setup, work / f"lost_s{seed}", seed, a.timeout, fault, "node-lost", healed)
        if not a.quick:
            big = dataclasses.replace(setup, model_args=SAVE_CASE_MODEL_ARGS)
            fault = kill_during_save(big, a.timeout)
            _case(res, net, big, work / "during_save", 0, a.timeout, fault, "killed-during-save", healed)
            fault = kill_rendezvous_host(setup, a.timeout)
            _case(res, net, setup, work / "host_lost", 0, a.timeout, fault, "rendezvous-host-lost")
    if not a.quick:
        with nodes.BridgedNodes(3) as net3:
            net3.set_rate(a.rate)
            fault = kill_two_in_turn(setup, a.timeout)
            _case(res, net3, setup, work / "two_lost", 0, a.timeout, fault, "two-nodes-lost", healed_twice)
    res["date"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    res["command"] = " ".join(["python -m benchmarks.faults", *sys.argv[1:]])
    return res


def main(argv=None) -> int:
    a = parse(argv)
    out = Path(a.out)
    if a.from_json:
        res = json.loads(Path(a.from_json).read_text())
        out.mkdir(parents=True, exist_ok=True)
        return report.write(res, out, a.prefix)
    why = nodes.unavailable()
    if why:
        print(f"faults: {why}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the namespaces are removed on the way out
    res = run(a)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.prefix}.json").write_text(json.dumps(res, indent=1) + "\n")
    return report.write(res, out, a.prefix)


if __name__ == "__main__":
    sys.exit(main())
