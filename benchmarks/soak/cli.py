"""Soak run: ACCO in adaptive accumulation for thousands of optimizer steps while the ranks' speeds
keep changing, then check that no micro-batch was lost or counted twice and that memory stayed flat.

Usage (CPU, the ``deepspeed`` launcher with gloo on 127.0.0.1)::

    python -m benchmarks.soak                      # 2000 steps of the default TinyGPT, 2 ranks
    python -m benchmarks.soak --steps 150 --small  # the short version the tests run

What runs: the default model of the main job (``acco_ds.models.TinyGPT`` with ``GPTConfig()``: 4 layers,
d_model 128, context 128, byte vocabulary) on the default corpus (the Python standard library
sources), ``"optimizer": {"type": "ACCO", "params": {"mode": "acco", "accumulation": "adaptive"}}``,
ZeRO-1, gradient_accumulation_steps 2 (each round takes at least one micro-batch), warm-up/decay LR.
Every ``--phase`` steps each rank draws a new slowdown factor in [1, ``--max-slow``] (its own seeded
generator) and spends (factor - 1) x its measured micro-batch time in extra compute after each
micro-batch (``acco_ds.cli.slowdown.Spinner``: real work, not sleep), so which rank is slower, and by
how much, changes all along the run.

Checks (the run fails, exit code 1, when one does not hold):

1. accounting: the micro-batches computed on all ranks equal those committed plus those the spec
   discards (docs/ALGORITHM.md: training stops after a commit; the g~ of the last peek and the micro-batches of
   the unfinished round enter no commit); no commit skipped (the run has no non-finite gradient);
   the discarded ones are at most the last two rounds' worth;
2. memory: the peak RSS of each rank, sampled every ``--sample-every`` steps and taken per tenth of
   the run after the warm-up (the first ``--warmup`` fraction), grows by at most ``--rss-tol-mb`` MB
   from the first post-warm-up tenth to any later one; the threads and open files of each rank are
   the same at the end as after the first step;
3. the loss went down (mean of the last 10% of steps below the mean of the first 10%).

Writes ``soak.json`` (raw: every rank's counters, losses and RSS samples, with the machine, versions,
date, command and duration), ``soak.md`` (the table) and ``checks.json`` to ``--out``, and copies the
JSON and the table to ``benchmarks/results/soak/soak.{json,md}`` (``--small``: ``soak_small.*``) unless
``--no-write``. ``--from-json F`` re-checks the raw results in F and re-renders the same table into
F's folder (``<F's name>.md``), without running anything::

    python -m benchmarks.soak --from-json benchmarks/results/soak/soak.json

Each rank runs ``benchmarks.ranks.soak``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

from acco_ds.cli.launch import LaunchError, free_port, launch_command, run_ranks
from benchmarks.harness.records import results_dir
from benchmarks.soak.options import parse

RESULTS = results_dir("soak")
RANK_MODULE = "benchmarks.ranks.soak"


def window_peaks(r: dict, args) -> list:
    """Peak RSS (MB) of rank ``r`` per tenth of the run after the warm-up fraction."""
    total = r["global_steps"]
    warm = int(args.warmup * total)
    tenth = max(1, (total - warm) // 10)
    windows: dict = {}
    for step, mb in r["rss"]:
        if step >= warm:
            windows.setdefault(min((step - warm) // tenth, 9), []).append(mb)
    return [max(windows[k]) for k in sorted(windows)]


def check(res: dict, args) -> list:
    """[(check, ok, detail)] for the run in ``res``."""
    ranks = res["ranks"]
    s0 = ranks[0]["stats"]
    out = []
    computed = sum(r["stats"]["micro_batches_local"] for r in ranks)
    committed, discarded = s0["micro_batches_committed"], s0["micro_batches_discarded"]
    same = all(
        r["stats"][k] == s0[k]
        for r in ranks
        for k in ("micro_batches_committed", "micro_batches_discarded", "committed_steps", "rounds")
    )
    out.append(
        (
            "computed = committed + discarded",
            computed == committed + discarded and same,
            f"{computed} = {committed} + {discarded}" + ("" if same else " (ranks disagree)"),
        )
    )
    biggest = max(r["max_round_global"] for r in ranks)
    out.append(
        (
            "discarded only at the end",
            s0["skipped_steps"] == 0 and discarded <= 2 * biggest,
            f"{discarded} discarded <= 2 x {biggest} (the largest round, all ranks): the g~ of the last peek and "
            f"the unfinished round; {s0['skipped_steps']} skipped commits",
        )
    )
    rounds = s0["rounds"]
    out.append(
        (
            f"at least {args.steps} optimizer steps",
            s0["committed_steps"] >= args.steps
            and s0["applied_steps"] + s0.get("empty_commits", 0) == s0["committed_steps"],
            f"{s0['committed_steps']} commits ({s0['applied_steps']} applied, {s0.get('empty_commits', 0)} empty "
            f"ones ended by the drains) in {ranks[0]['global_steps']} engine steps, {rounds} rounds",
        )
    )
    for r in ranks:
        peaks = window_peaks(r, args)
        growth = max(peaks) - peaks[0] if peaks else 0.0
        out.append(
            (
                f"rank {r['rank']} memory flat",
                growth <= args.rss_tol_mb,
                f"peak RSS per tenth after warm-up {peaks[0]:.0f}..{max(peaks):.0f} MB (+{growth:.1f} MB, "
                f"tolerance {args.rss_tol_mb:g})",
            )
        )
        out.append(
            (
                f"rank {r['rank']} threads and files flat",
                r["threads"][0] == r["threads"][1] and r["open_files"][0] == r["open_files"][1],
                f"threads {r['threads'][0]} -> {r['threads'][1]}, open files {r['open_files'][0]} -> "
                f"{r['open_files'][1]}",
            )
        )
    losses = ranks[0]["losses"]
    k = max(1, len(losses) // 10)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    out.append(
        ("loss went down", last < first, f"{first:.3f} -> {last:.3f} (rank 0, mean of first/last 10%)")
    )
    return out


def report(res: dict, checks: list, args) -> str:
    """The Markdown table: a function of the raw results ``res`` alone (``--from-json`` re-renders it)."""
    ranks = res["ranks"]
    s0 = ranks[0]["stats"]
    lines = [
        f"# Soak: ACCO adaptive, {s0['committed_steps']} optimizer steps, {len(ranks)} ranks"
        f"{' (small model)' if args.small else ''}",
        "",
        f"- Date: {res['date']}",
        f"- Machine: {res['machine']}",
        f"- Versions: {res['versions']}",
        f"- Model: TinyGPT {res['model']} ({res['params']:,} parameters), micro-batch {args.micro_batch}, "
        f"gradient_accumulation_steps 2, max_micro_batches_per_round {args.cap or 'null'}, fp32, gloo",
        f"- Speeds: every {args.phase} steps each rank draws a slowdown factor in [1, {args.max_slow:g}] "
        "(extra real compute per micro-batch)",
        f"- Command: `{res['command']}` ({res['elapsed_s']:.0f} s); raw results: the JSON beside this file "
        "(`python -m benchmarks.soak --from-json <it>` re-renders this table)",
        "",
        "| rank | micro-batches computed | wall s | extra compute s | slowdown factors (first 8) | peak RSS MB "
        "per tenth after warm-up | threads | open files |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in ranks:
        peaks = window_peaks(r, args)
        lines.append(
            f"| {r['rank']} | {r['stats']['micro_batches_local']} | {r['wall_s']:.0f} | {r['spin_s']:.0f} | "
            f"{', '.join(f'{f:.2f}' for f in r['factors'][:8])} | {', '.join(f'{p:.0f}' for p in peaks)} | "
            f"{r['threads'][0]} -> {r['threads'][1]} | {r['open_files'][0]} -> {r['open_files'][1]} |"
        )
    lines += [
        "",
        f"Rounds {s0['rounds']}, commits {s0['committed_steps']}, micro-batches committed "
        f"{s0['micro_batches_committed']}, discarded {s0['micro_batches_discarded']}, skipped commits "
        f"{s0['skipped_steps']}; micro-batches per round in the last round: {s0['last_round_counts']}.",
        "",
        "| check | result | detail |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {'pass' if ok else 'FAIL'} | {detail} |" for name, ok, detail in checks]
    return "\n".join(lines) + "\n"


def render(args, res: dict, out: Path, name: str = "soak", checks_json: bool = True) -> int:
    """Check ``res``, write ``<out>/<name>.md`` (and ``<out>/checks.json``); 0 when every check holds."""
    checks = check(res, args)
    text = report(res, checks, args)
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(text)
    if checks_json:
        rows = [{"check": n, "ok": ok, "detail": d} for n, ok, d in checks]
        (out / "checks.json").write_text(json.dumps(rows))
    return 0 if all(ok for _, ok, _ in checks) else 1


def driver(args, argv: list) -> int:
    """Run the ranks (with the options ``argv``), check and render their results; or, with
    ``--from-json``, check and re-render a saved run. 0 when every check holds, 1 when one does not,
    2 when the ranks failed."""
    if args.from_json:
        src = Path(args.from_json)
        res = json.loads(src.read_text())
        return render(argparse.Namespace(**res["args"]), res, src.parent, src.stem, checks_json=False)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cmd = launch_command(None, args.world, free_port(), target=RANK_MODULE, extra=[*argv, "--out", str(out)])
    t0 = time.time()
    try:
        run_ranks(cmd, 1, log_path=out / "launch.log")
    except LaunchError as err:
        print(err, file=sys.stderr)
        print("soak: the ranks failed", file=sys.stderr)
        return 2
    elapsed = time.time() - t0
    res = json.loads((out / "soak.json").read_text())
    res["elapsed_s"] = elapsed
    res["date"] = datetime.datetime.now().isoformat(timespec="seconds")
    res["command"] = " ".join(["python -m benchmarks.soak", *argv])
    (out / "soak.json").write_text(json.dumps(res, indent=1) + "\n")
    rc = render(argparse.Namespace(**res["args"]), res, out)  # as --from-json does: the same table
    if not args.no_write:
        name = "soak_small" if args.small else "soak"
        RESULTS.mkdir(parents=True, exist_ok=True)
        for ext in ("json", "md"):
            (RESULTS / f"{name}.{ext}").write_text((out / f"soak.{ext}").read_text())
    return rc


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return driver(parse(argv), argv)
