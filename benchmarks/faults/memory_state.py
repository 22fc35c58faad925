"""The committed state in node memory (``optimizer.params.memory_state``): what a lost node costs without any disk
save, and what keeping the state costs while nothing fails.

    python -m benchmarks.faults.memory_state            # 3 seeds of node-lost + the cost pairs (about 10 min on 2 cores)
    python -m benchmarks.faults.memory_state --quick    # one seed of node-lost, 40 steps, no cost pairs (the test)
    python -m benchmarks.faults.memory_state --cases cost --repeats 1   # the cost pairs only

The nodes and agents are the faults benchmark's (``benchmarks.faults.agents``: two network namespaces joined by a
tc-limited veth pair, one torchrun agent per node, ``--nnodes 1:2 --max-restarts N``), every job
``acco-train --mode acco --save-every 0 --memory-state``: no disk checkpoint at any point. Each node's memory is its
own folder (``agents.node_memory``, bound to ``/dev/shm/acco_ds`` inside the node), removed when the node is killed.

- ``node-lost`` (per seed): once rank 0 has recorded a step drawn at random (seeded; read from its record file),
  every process of node 1 is SIGKILLed and its memory removed. The survivors fail their round, torchrun restarts
  them on node 0 alone, and they resume from node 0's memory: their own records and the copies of node 1's ranks
  they hold. Recorded: the steps lost (the survivor's last completed step minus the step the restart resumed at;
  goal <= 1), the seconds from the kill to training again, split into detection (kill -> the survivor's failure
  record) and restart (-> the first optimizer step of the restarted start), the final step count and val loss.
- ``cost`` (per rate: 400mbit and none, i.e. unthrottled; ``--repeats`` pairs run alternately, every other repeat
  in the reverse order): the same job with nothing killed, with and without ``--memory-state``; samples/s of each
  (rank 0's training seconds; the median reported, and the median of each repeat's pair), the copies' bytes per
  step and the rounds' bytes per step of rank 0, and each node's memory folder's size per rank at the end (the
  records and held copies).

Writes ``<prefix>.md`` and ``<prefix>.json`` into ``--out`` (default ``benchmarks/results/faults/``). Exit status: 0
when every node-lost job healed with at most one step lost (``--cases cost``: once the jobs ran); 1 otherwise (the
results are still written); 2 when this machine cannot build the two-node network.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from acco_ds.cli.args import build_parser
from acco_ds.cli.metrics import machine_info
from acco_ds.core.comm import WORKER_THREAD
from acco_ds.core.overlap import JOB_PHASES
from acco_ds.core.peer_copies import THREAD as COPIES_THREAD
from acco_ds.core.state_records import RecordFile, RecordFileError
from benchmarks.faults import agents
from benchmarks.faults.cli import MODEL_ARGS, run_job
from benchmarks.harness import machine_time, nodes
from benchmarks.harness.cli import parser
from benchmarks.harness.records import results_dir
from benchmarks.harness.sweep import seeds_arg

# the jobs' model: the faults benchmark's (0.12M parameters, 512 tokens per step and rank: short jobs) or the main
# job's default (acco-train's own defaults: 0.8M parameters, 4096 tokens per step and rank). The copies' bytes per step
# are 12 per parameter / W whatever the tokens; the compute per step grows with them
MODELS = {"faults": MODEL_ARGS, "main": []}
MEMORY_ROOT = Path("/dev/shm") / f"acco_faults_memory_{os.getpid()}"  # the nodes' memory folders, this run's
RATES = ("400mbit", "none")
MAX_STEPS_LOST = 1
# the cost jobs' order within a repeat (older results: the same in every repeat)
REVERSED_EVERY_OTHER = "reversed every other repeat"
FORMS = ("inputs", "state")


def parse(argv=None) -> argparse.Namespace:
    ap = parser("faults.memory_state", __doc__)
    ap.add_argument("--quick", action="store_true", help="one seed, 40 steps, no cost pairs (the test)")
    ap.add_argument("--seeds", type=seeds_arg, default=None, help="default 0,1,2; quick 0")
    ap.add_argument(
        "--cases",
        choices=("all", "cost", "node-lost"),
        default="all",
        help="which cases run (default all; quick: node-lost only)",
    )
    ap.add_argument(
        "--model",
        choices=tuple(MODELS),
        default="faults",
        help="the jobs' model (see MODELS; default faults)",
    )
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per job (default 100, quick 40)")
    ap.add_argument("--per-node", type=int, default=1, help="ranks per node")
    ap.add_argument("--max-restarts", type=int, default=3, help="torchrun --max-restarts")
    ap.add_argument("--last-call-timeout", type=int, default=5, help="rendezvous last_call_timeout (s)")
    ap.add_argument("--join-timeout", type=int, default=60, help="rendezvous join_timeout (s)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a job may take")
    ap.add_argument("--repeats", type=int, default=3, help="cost pairs per link rate (median reported)")
    ap.add_argument(
        "--rates",
        default=",".join(RATES),
        help=f"the cost pairs' link rates, comma-separated (default {','.join(RATES)})",
    )
    ap.add_argument(
        "--forms",
        default="inputs",
        help="the copies' forms the cost pairs measure (memory_state.peer_copy_form), comma-separated: inputs, "
        "state (default inputs; node-lost runs the first)",
    )
    ap.add_argument("--out", default=str(results_dir("faults")), help="folder of the table and JSON")
    ap.add_argument(
        "--prefix", default=None, help="file name prefix (default memory_state, quick: memory_state_quick)"
    )
    ap.add_argument("--work", default=None, help="scratch folder of the jobs (default: a new temp folder)")
    ap.add_argument("--from-json", default=None, help="re-render the table from a saved raw JSON")
    a = ap.parse_args(argv)
    a.forms = [f.strip() for f in a.forms.split(",") if f.strip()]
    bad = [f for f in a.forms if f not in FORMS]
    if bad or not a.forms:
        ap.error(f"--forms: {', '.join(bad) or 'none given'}; allowed: {', '.join(FORMS)}")
    a.seeds = a.seeds or ([0] if a.quick else [0, 1, 2])
    a.steps = a.steps or (40 if a.quick else 100)
    a.prefix = a.prefix or ("memory_state_quick" if a.quick else "memory_state")
    if a.steps < 10:
        ap.error(f"--steps must be >= 10, got {a.steps}")
    return a


def recorded_step(setup, job, rank: int = 0) -> int:
    """The newest step ``rank`` of node 0 has recorded in its memory (0: none yet)."""
    folder = agents.node_memory(setup, 0) / job.run_id
    newest = 0
    for path in folder.glob(f"rank{rank}.g*.steps"):
        try:
            f = RecordFile.open(path)
        except RecordFileError:
            continue
        newest = max(newest, f.newest_key() or 0)
        f.close()
    return newest


def kill_node1_at(step: int, setup, timeout: float):
    def fault(job) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and job.all_running() and recorded_step(setup, job) < step:
            time.sleep(0.01)
        at = recorded_step(setup, job)
        t = job.kill_node(1)
        shutil.rmtree(agents.node_memory(setup, 1), ignore_errors=True)
        return {"kill_at_recorded_step": at, "kill_unix": t, "killed_node": 1}

    return fault


def healed(rec: dict, steps: int, per_node: int) -> dict:
    """The node-lost figures (see the module docstring)."""
    restarts = [s for s in rec["starts"] if s.get("restart", 0) > 0]
    lost = [f for f in rec["failures"] if f.get("restart", 0) == 0]
    out = {"healed": False}
    if not restarts or not lost:
        return out
    first, kill = restarts[0], rec["kill_unix"]
    detected = min(f["unix"] for f in lost)
    out.update(
        resumed_at_step=first["resumed_at_step"],
        world_after=first["world"],
        last_step_before=max(f["step"] for f in lost),
        detection_s=detected - kill,
    )
    out["steps_lost"] = out["last_step_before"] - out["resumed_at_step"]
    if first.get("first_step_unix"):
        out["restart_s"] = first["first_step_unix"] - detected
        out["recovery_s"] = first["first_step_unix"] - kill
    final = rec["starts"][-1]
    out["final_steps"], out["val_loss"] = final["steps"], final["val_loss"]
    out["healed"] = (
        final["steps"] == steps
        and rec["exit_status"].get("0") == 0
        and first["world"] == per_node
        and out["resumed_at_step"] > 0
        and 0 <= out["steps_lost"] <= MAX_STEPS_LOST
    )
    return out


def _folder_bytes(folder: Path) -> int:
    """The memory ``folder``'s files take (tmpfs pages allocated: a record file's unwritten meta area takes none)."""
    return sum(p.stat().st_blocks * 512 for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def samples_per_step(model_args) -> int:
    """Sequences per optimizer step and rank of an acco-train job with ``model_args`` (micro-batch x grad-accum)."""
    a = build_parser().parse_args(list(model_args))
    return a.micro_batch * a.grad_accum


def cost_figures(rec: dict, setup, steps: int) -> dict:
    start = rec["starts"][-1] if rec["starts"] else {}
    world = start.get("world") or 0
    batch = samples_per_step(setup.model_args) * world
    out = {"world": world, "train_s": start.get("train_s")}
    if start.get("train_s"):
        out["samples_per_s"] = steps * batch / start["train_s"]
    out["rounds_bytes_per_step"] = (start.get("bytes_sent") or 0) / steps
    out["copies_bytes_per_step"] = (start.get("peer_copy_bytes_sent") or 0) / steps
    cpu = (start.get("memory_state_s") or {}).get("peer_copy_cpu_s")
    if cpu is not None:
        out["copies_cpu_ms_per_step"] = 1000.0 * cpu / steps
    if start.get("train_cpu_s") is not None:
        out["cpu_ms_per_step"] = 1000.0 * start["train_cpu_s"] / steps
    if start.get("thread_cpu_s"):
        threads = dict(start["thread_cpu_s"])
        if TRAINING_THREAD in threads and start.get("eval_cpu_s") is not None:  # the evaluations left out
            threads[TRAINING_THREAD] -= start["eval_cpu_s"]
            if start.get("train_s"):
                out["training_busy"] = threads[TRAINING_THREAD] / start["train_s"]
        out["threads_ms_per_step"] = {k: 1000.0 * v / steps for k, v in threads.items()}
    if rec.get("machine_s"):  # the whole job, start-up included
        out["machine_ms_per_step"] = {k: 1000.0 * v / steps for k, v in rec["machine_s"].items()}
    phases = {k: v for k, v in (start.get("phases_s") or {}).items() if v is not None}
    if phases:
        out["phases_ms_per_step"] = {k: 1000.0 * v / steps for k, v in phases.items()}
    if setup.memory_root is not None:
        per_node = [_folder_bytes(agents.node_memory(setup, n)) for n in range(2)]
        out["memory_bytes_per_rank"] = max(per_node) / max(1, setup.per_node)
    return out


def run(a) -> dict:
    base = agents.Setup(
        steps=a.steps,
        save_every=0,
        per_node=a.per_node,
        max_restarts=a.max_restarts,
        last_call_timeout_s=a.last_call_timeout,
        join_timeout_s=a.join_timeout,
        model_args=MODELS[a.model],
    )
    work = Path(a.work or tempfile.mkdtemp(prefix="acco_faults_memory_"))
    res = {"args": dict(vars(a)), "machine": machine_info(), "cases": [], "order": REVERSED_EVERY_OTHER}
    nodes.remove_stale()
    try:
        _run_cases(a, base, work, res)
    finally:
        shutil.rmtree(MEMORY_ROOT, ignore_errors=True)
    res["date"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    res["command"] = " ".join(["python -m benchmarks.faults.memory_state", *sys.argv[1:]])
    return res


def _run_cases(a, base, work: Path, res: dict) -> None:
    with nodes.TwoNodes() as net:
        for rate in () if a.quick or a.cases == "node-lost" else a.rates.split(","):
            net.set_rate(rate)
            for rep in range(a.repeats):
                # paired, alternating, the order reversed every other repeat: the machine's drift and the jobs'
                # place in a repeat hit each form alike
                order = (None, *a.forms)
                for form in order if rep % 2 == 0 else order[::-1]:
                    memory = form is not None
                    name = f"cost_{rate}_{form or 'plain'}_{rep}"
                    setup = dataclasses.replace(
                        base, memory_root=str(MEMORY_ROOT / name) if memory else None, memory_form=form
                    )
                    ticks = machine_time.sample()
                    rec = run_job(net, setup, work / name, "acco", 0, a.timeout)
                    rec["machine_s"] = machine_time.delta(ticks, machine_time.sample())
                    rec.update(case="cost", rate=rate, memory_state=memory, form=form, repeat=rep)
                    rec.update(cost_figures(rec, setup, a.steps))
                    res["cases"].append(rec)
                    print(f"cost {rate} form={form} #{rep}: {rec.get('samples_per_s')} samples/s", flush=True)
        net.set_rate("400mbit")
        res["link"] = {"rate": "400mbit", "qdisc_node0": net.qdisc(0)}
        for seed in () if a.cases == "cost" else a.seeds:
            name = f"lost_s{seed}"
            setup = dataclasses.replace(base, memory_root=str(MEMORY_ROOT / name), memory_form=a.forms[0])
            step = random.Random(seed).randint(a.steps // 5, a.steps // 2)
            rec = run_job(
                net, setup, work / name, "acco", seed, a.timeout, kill_node1_at(step, setup, a.timeout)
            )
            rec.update(case="node-lost", seed=seed, drawn_step=step, form=a.forms[0])
            rec.update(healed(rec, a.steps, a.per_node))
            res["cases"].append(rec)
            print(f"node-lost seed {seed}: {summary_line(rec)}", flush=True)


def summary_line(rec: dict) -> str:
    keys = (
        "healed",
        "resumed_at_step",
        "last_step_before",
        "steps_lost",
        "detection_s",
        "restart_s",
        "recovery_s",
    )
    return ", ".join(f"{k}={rec.get(k)}" for k in keys)


def _f(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def render(res: dict) -> str:
    lines = [
        "# Node memory instead of disk saves: a lost node and what the records cost",
        "",
        f"`{res['command']}` on {res['machine'].get('cpu', 'this machine')} ({res['date']}); written by",
        "`benchmarks/faults/memory_state.py` from this folder's JSON. No disk checkpoint in any job. The model: "
        f"acco-train {' '.join(MODELS[res['args'].get('model', 'faults')]) or '(its defaults)'}, fp32, acco, one rank "
        "per node, 2 nodes.",
    ]
    lost = [c for c in res["cases"] if c["case"] == "node-lost"]
    if lost:
        forms = sorted({_form(c) for c in lost})
        lines += [
            "",
            f"Node lost, the copies in the {' and '.join(forms)} form:",
            "",
            "| node lost (seed) | killed at recorded step | last step before | resumed at | steps lost | detection s "
            "| restart s | kill to training s | final steps | val loss | healed |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    for r in lost:
        lines.append(
            f"| {r['seed']} | {r.get('kill_at_recorded_step')} | {r.get('last_step_before')} | "
            f"{r.get('resumed_at_step')} | {r.get('steps_lost')} | {_f(r.get('detection_s'))} | "
            f"{_f(r.get('restart_s'))} | {_f(r.get('recovery_s'))} | {r.get('final_steps')} | "
            f"{_f(r.get('val_loss'), 4)} | {r.get('healed')} |"
        )
    lines += [
        "",
        "| link | memory_state (copies' form) | samples/s | samples/s lost | samples/s lost, paired "
        "| rounds' bytes/step (rank 0) | copies' bytes/step (rank 0) | copies' CPU ms/step (rank 0) "
        "| node memory per rank (MiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    costs = [c for c in res["cases"] if c["case"] == "cost"]
    for rate, at_rate, f, rows in _by_link_and_form(costs):
        r, cost = _median_row(rows), None
        if f is None:
            off = r
        elif off["samples_per_s"] and r["samples_per_s"]:
            cost = 100.0 * (1.0 - r["samples_per_s"] / off["samples_per_s"])
        mem = r.get("memory_bytes_per_rank")
        lines.append(
            f"| {rate} | {_label(f)} | {_f(r['samples_per_s'])} ({r['spread']}) | "
            f"{'-' if cost is None else f'{cost:.1f} %'} | {_paired_cost(at_rate, f)} | "
            f"{r['rounds_bytes_per_step']:.0f} | "
            f"{r['copies_bytes_per_step']:.0f} | {_f(r.get('copies_cpu_ms_per_step'), 2)} | "
            f"{'-' if mem is None else f'{mem / 2**20:.2f}'} |"
        )
    lines += _phases_table(costs)
    lines += _threads_table(costs)
    lines += [
        "",
        f"samples/s: the median of {res['args'].get('repeats', 1)} jobs (min-max in brackets), pairs run alternately"
        f"{', the order ' + res['order'] if res.get('order') else ''}; "
        "samples/s lost: 1 - on/off of the medians; paired: 1 - on/off of each repeat's jobs (run one after the other), "
        "the median over the repeats (min to max in brackets). Bytes: rank 0's, per step. CPU: the CPU time of rank 0's "
        "copies' thread per step (the digests, host steps, metas and posting the transfers; gloo's transfer threads "
        "not included), the median (- where not measured). Node memory: a node's memory folder at the end "
        "(its rank's two records and the two of the copy it holds, each with its meta area) per rank.",
    ]
    return "\n".join(lines) + "\n"


# the phases table's columns: (heading, the per-step figure of a cost job)
PHASE_COLUMNS = (
    ("training CPU", lambda c: c.get("cpu_ms_per_step")),
    ("waits for the rounds", lambda c: c["phases_ms_per_step"].get("comm_wait_s")),
    ("round jobs", lambda c: sum(c["phases_ms_per_step"].get(k, 0.0) for k in JOB_PHASES)),
    ("reduce-scatter", lambda c: c["phases_ms_per_step"].get("job_reduce_scatter_s")),
    ("norm", lambda c: c["phases_ms_per_step"].get("job_norm_s")),
    ("all-gather", lambda c: c["phases_ms_per_step"].get("job_all_gather_s")),
    ("copies' waits for the round in flight", lambda c: _ms_per_step(c, "peer_copy_after_round_s")),
)


def _ms_per_step(rec: dict, key: str) -> float | None:
    """Rank 0's memory_state figure ``key`` (seconds) of a job's last start, in ms per step; None without it."""
    secs = (rec["starts"][-1].get("memory_state_s") or {}).get(key) if rec.get("starts") else None
    return None if secs is None else 1000.0 * secs / rec["starts"][-1]["steps"]


def _phases_table(costs: list) -> list:
    """Where rank 0's time went, per link and form: the median over the repeats of each figure of
    ``PHASE_COLUMNS`` (ms per step); empty for results from before the phases were recorded."""
    costs = [c for c in costs if c.get("phases_ms_per_step")]
    if not costs:
        return []
    lines = [
        "",
        "Where rank 0's time went, ms per step (the median over the repeats): its process's CPU time in training "
        "(all threads, the evaluations included), the training thread's waits for the round jobs, and the jobs' own "
        "time with three of its phases (the communication worker thread's clock); the copies' thread's waits for the "
        "round job in flight at each step's record before it sends:",
        "",
        "| link | memory_state | " + " | ".join(h for h, _ in PHASE_COLUMNS) + " |",
        "|---|---|" + "---|" * len(PHASE_COLUMNS),
    ]
    for rate, _, f, rows in _by_link_and_form(costs):
        cells = []
        for _, figure in PHASE_COLUMNS:
            vals = [v for v in (figure(c) for c in rows) if v is not None]
            cells.append(f"{statistics.median(vals):.1f}" if vals else "-")
        lines.append(f"| {rate} | {_label(f)} | " + " | ".join(cells) + " |")
    return lines


MACHINE_KINDS = ("user", "system", "softirq")  # the threads table's columns of the whole machine's time
TRAINING_THREAD = "MainThread"  # acco-train trains on the main thread
# the threads table's columns: (heading, whether a thread of that name belongs there); then every other thread
THREAD_COLUMNS = (
    ("training thread", lambda name: name == TRAINING_THREAD),
    ("round jobs' thread", lambda name: name == WORKER_THREAD),
    ("copies' thread", lambda name: name == COPIES_THREAD),
    ("gloo's threads", lambda name: name.startswith(("gloo", "pt_gloo"))),
)


def _thread_figures(rec: dict) -> list:
    """A cost job's rank 0 CPU ms per step in each of ``THREAD_COLUMNS`` and in the other threads (the ended ones
    included)."""
    threads = rec["threads_ms_per_step"]
    cells = [sum(v for k, v in threads.items() if belongs(k)) for _, belongs in THREAD_COLUMNS]
    return [*cells, sum(threads.values()) - sum(cells)]


def _threads_table(costs: list) -> list:
    """Rank 0's CPU time by thread, per link and form: the median over the repeats (ms per step), and the training
    thread's busy share of the training time with, per form, its change from each repeat's job without copies (the
    median, in points); empty for results from before the threads' time was recorded."""
    costs = [c for c in costs if c.get("threads_ms_per_step")]
    if not costs:
        return []
    heads = [h for h, _ in THREAD_COLUMNS] + ["other threads", "training thread busy", "busy, paired change"]
    machine = any(c.get("machine_ms_per_step") for c in costs)
    heads += [f"the machine's {k}" for k in MACHINE_KINDS] if machine else []
    lines = [
        "",
        "Rank 0's CPU time in training by thread, ms per step (the median over the repeats; `acco_ds.cli.thread_cpu`, "
        "user and kernel time): the training thread (the model's compute; the evaluations left out), the round jobs' "
        "thread, the copies' thread, gloo's transfer threads and the rest (the heartbeat, torch's own, ended ones); "
        "then the training thread's CPU time as a share of the training's wall time (below 100 %: it waited, or "
        "another thread had its core) and that share's change from the same repeat's job without copies (points); "
        "where measured, the whole machine's user, kernel and softirq time per step over the job, both nodes and "
        "start-up included (`benchmarks/harness/machine_time.py`; this kernel charges softirq time, the emulated "
        "link's packets among it, to whichever thread it interrupts as well):",
        "",
        "| link | memory_state | " + " | ".join(heads) + " |",
        "|---|---|" + "---|" * len(heads),
    ]
    for rate, at_rate, f, rows in _by_link_and_form(costs):
        if not rows:
            continue
        cells = [f"{statistics.median(col):.1f}" for col in zip(*(_thread_figures(c) for c in rows))]
        busy = [c["training_busy"] for c in rows if c.get("training_busy") is not None]
        cells.append(f"{100 * statistics.median(busy):.1f} %" if busy else "-")
        change = _paired(at_rate, f, "training_busy", lambda on, off: 100 * (on - off))
        cells.append(
            f"{statistics.median(change):+.1f} ({change[0]:+.1f} to {change[-1]:+.1f})" if change else "-"
        )
        for kind in MACHINE_KINDS if machine else ():
            vals = [c["machine_ms_per_step"][kind] for c in rows if kind in c.get("machine_ms_per_step", {})]
            cells.append(f"{statistics.median(vals):.1f}" if vals else "-")
        lines.append(f"| {rate} | {_label(f)} | " + " | ".join(cells) + " |")
    return lines


def _by_link_and_form(costs: list):
    """``(rate, the rate's jobs, form, the form's jobs)`` per link rate (in the order run) and form: without copies
    (None) first, then the forms in the order run."""
    for rate in dict.fromkeys(c["rate"] for c in costs):
        at_rate = [c for c in costs if c["rate"] == rate]
        for f in [None, *dict.fromkeys(_form(c) for c in at_rate if c["memory_state"])]:
            yield rate, at_rate, f, [c for c in at_rate if _form(c) == f]


def _label(form: str | None) -> str:
    return "off" if form is None else f"on ({form})"


def _form(rec: dict) -> str | None:
    """The copies' form of a job: None with memory_state off (node-lost jobs always have it on); results from before
    the forms were measured: the state."""
    if rec["case"] == "cost" and not rec["memory_state"]:
        return None
    return rec.get("form") or "state"


def _paired_cost(at_rate: list, form: str | None) -> str:
    """The cost of ``form``'s copies from each repeat's pair (its job and the same repeat's job without copies, run
    one after the other, so that the machine's drift between repeats cancels): the median in percent, min to max."""
    costs = _paired(at_rate, form, "samples_per_s", lambda on, off: 100.0 * (1.0 - on / off))
    if not costs:
        return "-"
    return f"{statistics.median(costs):.1f} % ({costs[0]:.1f} to {costs[-1]:.1f})"


def _paired(at_rate: list, form: str | None, key: str, compare) -> list:
    """``compare(on, off)`` of figure ``key`` for each repeat that has it in both ``form``'s job and the same repeat's
    job without copies, sorted (empty for ``form`` None)."""
    if form is None:
        return []
    off = {c["repeat"]: c.get(key) for c in at_rate if _form(c) is None}
    return sorted(
        compare(c[key], off[c["repeat"]])
        for c in at_rate
        if _form(c) == form and c.get(key) is not None and off.get(c["repeat"]) is not None
    )


def _median_row(rows: list) -> dict:
    sps = sorted(r["samples_per_s"] for r in rows if r.get("samples_per_s"))
    mid = rows[0] if rows else {}
    out = {
        "samples_per_s": statistics.median(sps) if sps else None,
        "spread": f"{sps[0]:.1f}-{sps[-1]:.1f}" if sps else "-",
        "rounds_bytes_per_step": mid.get("rounds_bytes_per_step", 0),
        "copies_bytes_per_step": mid.get("copies_bytes_per_step", 0),
    }
    if mid.get("memory_bytes_per_rank") is not None:
        out["memory_bytes_per_rank"] = mid["memory_bytes_per_rank"]
    cpu = sorted(r["copies_cpu_ms_per_step"] for r in rows if r.get("copies_cpu_ms_per_step") is not None)
    if cpu:
        out["copies_cpu_ms_per_step"] = statistics.median(cpu)
    return out


def write(res: dict, out: Path, prefix: str) -> int:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{prefix}.md").write_text(render(res))
    lost = [c for c in res["cases"] if c["case"] == "node-lost"]
    if res["args"].get("cases") == "cost":
        return 0
    return 0 if lost and all(c.get("healed") for c in lost) else 1


def main(argv=None) -> int:
    a = parse(argv)
    out = Path(a.out)
    if a.from_json:
        return write(json.loads(Path(a.from_json).read_text()), out, a.prefix)
    why = nodes.unavailable()
    if why:
        print(f"faults.memory_state: {why}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    res = run(a)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.prefix}.json").write_text(json.dumps(res, indent=1) + "\n")
    return write(res, out, a.prefix)


if __name__ == "__main__":
    sys.exit(main())
