"""The fault benchmark's table (``<prefix>.md``) from its raw results (``benchmarks.faults.cli``): one row per
job that lost a node, the reference runs' validation losses, the goals' verdicts. ``write(res, out, prefix)``
returns 0 when every case ran as the benchmark expects it to, 1 otherwise; the same JSON always renders the
same Markdown."""

from __future__ import annotations

import statistics
from pathlib import Path

RECOVERY_GOAL_S = 60.0


def _f(x, nd=2, unit="") -> str:
    return "-" if x is None else f"{x:.{nd}f}{unit}"


def summary_line(rec: dict) -> str:
    if rec.get("case") == "two-nodes-lost":
        kills = "; ".join(
            f"node {k['node']}: recovery {_f(k.get('recovery_s'), 1)} s, lost {k.get('steps_lost')} steps"
            for k in rec.get("per_kill", [])
        )
        return f"healed={rec.get('healed')} {kills}, final world {rec.get('world_after')}"
    if rec.get("case") == "rendezvous-host-lost":
        return f"node 1's agent exit {rec['exit_status'].get('1')}, after {_f(host_stop_s(rec), 1)} s"
    return (
        f"healed={rec.get('healed')} recovery {_f(rec.get('recovery_s'), 1)} s, lost "
        f"{rec.get('steps_lost')} steps, resumed at {rec.get('resumed_at_step')}, val {_f(rec.get('val_loss'), 4)}"
    )


def host_stop_s(rec: dict) -> float | None:
    if rec.get("kill_unix") is None or rec.get("end_unix") is None:
        return None
    return rec["end_unix"] - rec["kill_unix"]


def _last_error(rec: dict) -> str:
    lines = [ln for ln in rec.get("log_tail", "").splitlines() if "Error" in ln or "error" in ln]
    return (lines[-1].strip()[:200] if lines else "-").replace("|", "/")


def _refs(res: dict) -> dict:
    """{mode: {seed: val_loss}} of the reference runs."""
    out: dict = {}
    for rec in res["cases"]:
        if rec["case"] == "reference" and rec["starts"]:
            out.setdefault(rec["mode"], {})[rec["seed"]] = rec["starts"][-1]["val_loss"]
    return out


def render(res: dict) -> tuple[str, bool]:
    a, refs = res["args"], _refs(res)
    zero1 = list(refs.get("zero1", {}).values())
    spread = (max(zero1) - min(zero1)) if len(zero1) > 1 else None
    lines = [
        "# Fault benchmark: a node lost under torchrun's elastic agent",
        "",
        f"- Date: {res.get('date', '-')}",
        f"- Machine: {res['machine'].get('cpu', '-')}, {res['machine'].get('cores', '-')} cores; "
        f"torch {res['machine'].get('torch', '-')}, deepspeed {res['machine'].get('deepspeed', '-')}",
        f"- Command: `{res.get('command', '-')}`; raw results: the JSON beside this file "
        "(`python -m benchmarks.faults --from-json <it>` re-renders this table)",
        f"- Two nodes (network namespaces, veth at {a['rate']}), {a['per_node']} rank(s) per node, one torchrun "
        f"agent per node (`--nnodes 1:2 --max-restarts {a['max_restarts']} --rdzv-backend c10d`, "
        f"last_call_timeout {a['last_call_timeout']} s), `acco-train --mode acco --steps {a['steps']} "
        f"--save-every {a['save_every']}` (tiny GPT, fp32, gloo); node 1 SIGKILLed (every process) at a random step",
        "",
        "| case | seed | killed after save | recovery s (kill -> first step) | detected s | steps lost "
        "| resumed at | world after | checkpoint complete | final steps | val loss | uninterrupted val loss | healed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ok = True
    for rec in res["cases"]:
        if rec["case"] not in ("node-lost", "killed-during-save"):
            continue
        ref = refs.get("acco", {}).get(rec["seed"]) if rec["case"] == "node-lost" else None
        after = rec.get("kill_after_save", rec.get("latest_at_kill"))
        if rec["case"] == "killed-during-save":
            after = f"{rec.get('latest_at_kill')} (save of {rec.get('saving_step')} in progress)"
        ck = rec["checkpoint"]
        lines.append(
            f"| {rec['case']} | {rec['seed']} | {after} | {_f(rec.get('recovery_s'), 1)} | "
            f"{_f(rec.get('detected_s'), 1)} | {rec.get('steps_lost', '-')} | {rec.get('resumed_at_step', '-')} | "
            f"{rec.get('world_after', '-')} | {'yes' if ck.get('complete') else 'NO'} ({ck.get('latest')}) | "
            f"{rec.get('final_steps', '-')} | {_f(rec.get('val_loss'), 4)} | {_f(ref, 4)} | "
            f"{'yes' if rec.get('healed') else 'NO'} |"
        )
        ok = ok and bool(rec.get("healed"))
    for rec in res["cases"]:
        if rec["case"] == "killed-during-save":
            torn = rec.get("resumed_at_step") == rec.get("latest_at_kill")
            lines += [
                "",
                f"Killed during a save: node 1 was SIGKILLed while the save of step {rec.get('saving_step')} was in "
                f"progress (its folder there, `latest` still at step {rec.get('latest_at_kill')}); the restart resumed "
                f"at step {rec.get('resumed_at_step')}: "
                + (
                    "the last complete save; the torn folder was written over when the run got there again."
                    if torn
                    else "that save had completed (every rank's files and `latest`) before the kill took effect."
                ),
            ]
    lost = [r for r in res["cases"] if r["case"] in ("node-lost", "killed-during-save")]
    kills = [k for r in res["cases"] if r["case"] == "two-nodes-lost" for k in r.get("per_kill", [])]
    rec_s = [r["recovery_s"] for r in [*lost, *kills] if r.get("recovery_s") is not None]
    steps_lost = [r["steps_lost"] for r in [*lost, *kills] if r.get("steps_lost") is not None]
    lines += ["", "## Goals", "", "| goal | measured | verdict |", "|---|---|---|"]
    if rec_s:
        worst = max(rec_s)
        lines.append(
            f"| training resumes on the survivors with no human step within {RECOVERY_GOAL_S:.0f} s of the kill "
            f"| {min(rec_s):.1f} - {worst:.1f} s (median {statistics.median(rec_s):.1f}) "
            f"| {'met' if worst <= RECOVERY_GOAL_S and all(r.get('healed') for r in lost) else 'MISSED'} |"
        )
    if steps_lost:
        bound = a["save_every"]
        lines.append(
            f"| at most the steps since the last save are lost (<= {bound}) | {', '.join(map(str, steps_lost))} "
            f"| {'met' if all(0 <= s <= bound for s in steps_lost) else 'MISSED'} |"
        )
    jobs = [r for r in res["cases"] if r["case"] in ("node-lost", "killed-during-save", "two-nodes-lost")]
    lines.append(
        f"| no corrupt checkpoint | latest complete in {sum(r['checkpoint'].get('complete', False) for r in jobs)} "
        f"of {len(jobs)} jobs | {'met' if jobs and all(r['checkpoint'].get('complete') for r in jobs) else 'MISSED'} |"
    )
    pairs = [
        (r.get("val_loss"), refs.get("acco", {}).get(r["seed"])) for r in lost if r["case"] == "node-lost"
    ]
    pairs = [(v, ref) for v, ref in pairs if v is not None and ref is not None]
    if pairs and spread is not None:
        gaps = [v - ref for v, ref in pairs]
        met = all(abs(g) <= spread for g in gaps)
        lines.append(
            f"| final val loss within ZeRO-1's seed spread ({spread:.4f}) of the uninterrupted run's "
            f"| gaps {', '.join(f'{g:+.4f}' for g in gaps)} | {'met' if met else 'MISSED'} |"
        )
    else:
        lines.append(
            "| final val loss within ZeRO-1's seed spread of the uninterrupted run's | no reference runs | not shown |"
        )
    if refs:
        lines += ["", "Reference runs (nothing killed), validation loss per seed:", ""]
        lines += ["| mode | " + " | ".join(f"seed {s}" for s in sorted(refs.get("acco", {}))) + " |"]
        lines += ["|---|" + "---|" * len(refs.get("acco", {}))]
        for mode, per_seed in sorted(refs.items()):
            lines.append(f"| {mode} | " + " | ".join(_f(per_seed[s], 4) for s in sorted(per_seed)) + " |")
    for rec in [r for r in res["cases"] if r["case"] == "two-nodes-lost"]:
        lines += [
            "",
            "## Two nodes lost in turn, down to the minimum",
            "",
            f"Three nodes on a bridge (`--nnodes 1:3`), seed {rec['seed']}: node 2 killed, then node 1 once the job had "
            f"healed and saved five more times; node 0 finished alone (world {rec.get('world_after', '-')}, "
            f"{rec.get('final_steps', '-')} steps, val loss {_f(rec.get('val_loss'), 4)}, checkpoint "
            f"{'complete' if rec['checkpoint'].get('complete') else 'INCOMPLETE'}): "
            f"{'healed' if rec.get('healed') else 'NOT healed'}.",
            "",
            "| kill | node | killed after save | recovery s (kill -> first step) | detected s | steps lost | resumed at |",
            "|---|---|---|---|---|---|---|",
        ]
        for i, k in enumerate(rec.get("per_kill", []), 1):
            lines.append(
                f"| {i} | {k['node']} | {k['after_save']} | {_f(k.get('recovery_s'), 1)} | "
                f"{_f(k.get('detected_s'), 1)} | {k.get('steps_lost', '-')} | {k.get('resumed_at_step', '-')} |"
            )
        ok = ok and bool(rec.get("healed"))
    host = [r for r in res["cases"] if r["case"] == "rendezvous-host-lost"]
    for rec in host:
        stopped = rec["exit_status"].get("1") not in (None, 0)
        lines += [
            "",
            "## The rendezvous host lost",
            "",
            f"Node 0 (the c10d store's host and rank 0) SIGKILLed after the save at step {rec.get('kill_after_save')}: "
            f"node 1's agent {'stopped with exit status ' + str(rec['exit_status'].get('1')) if stopped else 'did not stop'} "
            f"{_f(host_stop_s(rec), 1)} s after the kill. Last error line: `{_last_error(rec)}`. The checkpoint folder's "
            f"latest save: step {rec['checkpoint'].get('latest')} ({'complete' if rec['checkpoint'].get('complete') else 'INCOMPLETE'}): "
            "restarting the job (a new rendezvous host) resumes from it.",
        ]
        ok = ok and stopped and rec["checkpoint"].get("complete", False)
    return "\n".join(lines) + "\n", ok


def write(res: dict, out: Path, prefix: str) -> int:
    text, ok = render(res)
    (out / f"{prefix}.md").write_text(text)
    print(text)
    return 0 if ok else 1
