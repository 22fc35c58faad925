"""Training fidelity through ``acco-train``: each mode's validation loss against DeepSpeed ZeRO-1's, over paired seeds,
in any dtype (fp16 with dynamic loss scaling: the skipped steps and final loss scale of every run too).

    python -m benchmarks.fidelity --dtype fp16 --out benchmarks/results/fp16/fidelity_run1     # 3 seeds x acco, zero1
    python -m benchmarks.fidelity --from-json benchmarks/results/fp16/fidelity_run1/fidelity.json   # re-render

For each seed, one ``acco-train`` invocation trains every ``--modes`` run one after the other (the same model
initialisation and data order: the seed fixes both, so the runs of a seed are a pair) with the given model, batch,
steps and dtype, on ``--world-size`` CPU or GPU ranks as ``acco-train`` chooses them; its ``summary.json`` gives
each run's validation loss (on the committed parameters, after the same samples), final training loss, samples/s
and, with fp16, ``engine.skipped_steps`` and the final loss scale. The report gives every run's figures, each mode's
mean [min, max] over the seeds, its validation loss gap to ZeRO-1 paired by seed, its time to ZeRO-1's final
validation loss over ZeRO-1's own paired by seed (from the runs' validation curves, ``acco-train --eval-every``;
``benchmarks.harness.analysis.x_time_to_val``; the column is left out for results without curves), and whether
each mode's validation loss lies within ZeRO-1's seed spread (``benchmarks.harness.seeds.verdict_within``: met when every seed's value is
in [min, max] of ZeRO-1's seeds, MISSED when the mean is not, not shown otherwise; fewer than 3 seeds: indicative).

Writes ``<prefix>.md`` (the table) and ``<prefix>.json`` (raw, ``--from-json`` renders the same table from it) into
``--out``, which must not already hold ``<prefix>.json``: results are added beside earlier ones, never over them.
Exit status 0 when every run ran, 1 when one failed (its error is in the table and the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from acco_ds.cli.dsconfig import ALL_MODES
from acco_ds.cli.metrics import machine_info
from benchmarks.harness import seeds as sd
from benchmarks.harness.analysis import x_time_to_val
from benchmarks.harness.cli import parser
from benchmarks.harness.records import load_results, write_report
from benchmarks.harness.sweep import seeds_arg

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = "zero1"
# acco-train options every run of the benchmark shares (the model, batch and schedule), with their defaults here:
# a small GPT, since fp16 on a CPU without fp16 kernels computes far slower than fp32
SHARED = {
    "steps": 150,
    "n_layer": 2,
    "n_head": 4,
    "d_model": 64,
    "context": 64,
    "micro_batch": 8,
    "grad_accum": 4,
    "warmup_steps": 15,
    "eval_windows": 256,
    "world_size": 2,
}


def parse(argv=None) -> argparse.Namespace:
    ap = parser("fidelity", __doc__)
    ap.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp16")
    ap.add_argument(
        "--modes", default="acco,zero1", help=f"comma-separated acco-train modes, {REFERENCE} among them"
    )
    ap.add_argument(
        "--seeds", type=seeds_arg, default=[0, 1, 2], help="comma-separated seeds (default 0,1,2)"
    )
    for name, default in SHARED.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    ap.add_argument(
        "--out", default=None, help="folder of the table and the JSON (required unless --from-json)"
    )
    ap.add_argument("--prefix", default="fidelity", help="file name prefix (default fidelity)")
    ap.add_argument("--work", default=None, help="scratch folder of the runs (default: a new temp folder)")
    ap.add_argument("--from-json", default=None, help="re-render the table from a saved raw JSON, beside it")
    a = ap.parse_args(argv)
    a.modes = a.modes.split(",")
    for m in a.modes:
        if m not in ALL_MODES:
            ap.error(f"--modes: unknown mode {m!r}; allowed: {', '.join(ALL_MODES)}")
    if REFERENCE not in a.modes:
        ap.error(f"--modes {','.join(a.modes)}: the reference {REFERENCE} must be among them")
    if a.from_json:
        a.out = a.out or str(Path(a.from_json).parent)
        a.prefix = Path(a.from_json).stem
        return a
    if not a.out:
        ap.error("--out is required: a new folder (e.g. benchmarks/results/fp16/fidelity_run2)")
    if (Path(a.out) / f"{a.prefix}.json").exists():
        ap.error(
            f"--out {a.out} already holds {a.prefix}.json: give a new folder or --prefix (results are never overwritten)"
        )
    for name in SHARED:
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    return a


def train_command(a, seed: int, out: Path) -> list:
    """The ``acco-train`` invocation of one seed: every mode, the shared options, this seed."""
    cmd = [sys.executable, "-m", "acco_ds.train", "--mode", *a.modes, "--dtype", a.dtype, "--seed", str(seed)]
    for name in SHARED:
        cmd += [f"--{name.replace('_', '-')}", str(getattr(a, name))]
    return cmd + ["--out", str(out), "--no-progress"]


RUN_FIGURES = (
    "val_loss",
    "final_train_loss",
    "samples_per_s",
    "train_s",
    "steps",
    "samples",
    "skipped_steps",
    "loss_scale",
    "val_curve",
)


def uncommitted() -> list | None:
    """The tracked files of this checkout with uncommitted edits when the runs start (None without git): the
    figures are those of HEAD plus these."""
    try:
        proc = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return [line[3:] for line in proc.stdout.splitlines()] if proc.returncode == 0 else None


def run_seed(a, seed: int, work: Path) -> dict:
    """One seed's runs: {mode: the figures of RUN_FIGURES} from acco-train's summary, or {"error": ...}."""
    out = work / f"seed{seed}"
    cmd = train_command(a, seed, out)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    t0 = time.time()
    print(f"fidelity: seed {seed}: {shlex.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=7200)
    if proc.returncode != 0:
        return {"error": (proc.stdout + proc.stderr)[-3000:], "command": shlex.join(cmd)}
    summary = json.loads((out / "summary.json").read_text())
    runs = {m: {k: s.get(k) for k in RUN_FIGURES} for m, s in summary["runs"].items()}
    return {
        "runs": runs,
        "wall_s": time.time() - t0,
        "command": shlex.join(cmd),
        "model_params": summary["model"]["params"],
    }


def analyse(res: dict) -> dict:
    """Per mode: the spread over the seeds of each figure, the val loss gap to ZeRO-1 paired by seed, and the
    verdict of its val loss against ZeRO-1's seed spread."""
    by_seed = {int(s): r["runs"] for s, r in res["seeds"].items() if "runs" in r}
    out = {}
    for mode in res["setup"]["modes"]:
        vals = {s: runs[mode] for s, runs in by_seed.items() if mode in runs}
        spread = {
            k: sd.spread(v[k] for v in vals.values()) for k in ("val_loss", "skipped_steps", "loss_scale")
        }
        out[mode] = {"seeds": sorted(vals), **spread}
    ref = out.get(REFERENCE, {}).get("val_loss")
    for mode, an in out.items():
        if mode == REFERENCE or not ref:
            continue
        mine = {s: by_seed[s][mode]["val_loss"] for s in an["seeds"]}
        theirs = {s: by_seed[s][REFERENCE]["val_loss"] for s in by_seed if REFERENCE in by_seed[s]}
        gaps = sd.paired(mine, theirs, lambda x, y: x / y - 1.0)
        an["val_gap"] = sd.spread(gaps.values())
        an["val_gap_by_seed"] = gaps
        an["within_reference_spread"] = sd.verdict_within(an["val_loss"], ref["min"], ref["max"])
        refs = {s: by_seed[s][REFERENCE] for s in by_seed if REFERENCE in by_seed[s]}
        runs = {s: by_seed[s][mode] for s in an["seeds"]}
        x = sd.paired(runs, refs, x_time_to_val)
        an["x_time_to_ref_val"] = sd.spread(x.values())
        an["x_time_to_ref_val_by_seed"] = x
    return out


def _x(v) -> str:
    """A time ratio of one seed: '-' when not measured, 'not reached' for a run that never got there."""
    if v is None:
        return "-"
    return "not reached" if v == float("inf") else f"{v:.2f}x"


def _num(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def render(res: dict) -> str:
    m, s = res["machine"], res["setup"]
    an = analyse(res)
    fp16 = s["dtype"] == "fp16"
    # runs that recorded validation curves (acco-train --eval-every): each mode's time to zero1's final val loss
    curve = any(a.get("x_time_to_ref_val") for a in an.values())
    ttl = f" time to {REFERENCE}'s final val loss (x {REFERENCE}) |"
    lines = [
        f"# Training fidelity: {', '.join(s['modes'])} with acco-train --dtype {s['dtype']}, {len(res['seeds'])} paired seeds",
        "",
        f"- Date: {res['date']}; machine: {m.get('cpu', '-')}, {m.get('cores', '-')} cores; torch {m.get('torch', '-')}, "
        f"deepspeed {m.get('deepspeed', '-')}, acco_ds {m.get('acco_ds', '-')}",
        f"- Command: `{res['command']}`; raw results: `{res.get('prefix', 'fidelity')}.json` beside this file",
        *(
            [f"- Source: the commit above plus uncommitted edits in {', '.join(res['uncommitted'])}"]
            if res.get("uncommitted")
            else []
        ),
        f"- Each seed: `{res['seed_commands'][0]}` (seed {res['setup']['seeds'][0]}; the others differ in `--seed` only): "
        f"a {res.get('model_params', 0) / 1e6:.2f}M-parameter GPT, {s['world_size']} ranks, {s['steps']} optimizer steps "
        f"of {s['grad_accum']} x {s['micro_batch']} sequences of {s['context']} bytes per rank, the same data and "
        "initialisation for every mode of a seed; validation loss on the committed parameters over "
        f"{s['eval_windows']} windows"
        + (
            "; fp16: DeepSpeed's dynamic loss scaling (first scale 2^16, window 1000, hysteresis 2), "
            "`skipped` = `engine.skipped_steps`, `scale` = the final loss scale"
            if fp16
            else ""
        ),
        *(
            [
                f"- Time to {REFERENCE}'s final val loss: the first time the run's validation loss (evaluated at the "
                "start and every `--eval-every` steps of acco-train, their time left out of the training clock) is "
                f"at or below {REFERENCE}'s final one of the same seed, interpolated between evaluations, over "
                f"{REFERENCE}'s own time to it (`acco_ds.cli.time_to_loss`); `not reached`: never within the steps"
            ]
            if curve
            else []
        ),
        "",
        "| seed | mode | val loss | train loss (last 20%) | samples/s | time s |"
        + (" skipped steps | final loss scale |" if fp16 else "")
        + (ttl if curve else ""),
        "|---|---|---|---|---|---|" + ("---|---|" if fp16 else "") + ("---|" if curve else ""),
    ]
    for seed, r in sorted(res["seeds"].items(), key=lambda kv: int(kv[0])):
        if "error" in r:
            lines.append(f"| {seed} | all | failed | - | - | - |" + (" - | - |" if fp16 else ""))
            continue
        for mode in s["modes"]:
            x = r["runs"].get(mode)
            if x is None:
                continue
            row = (
                f"| {seed} | {mode} | {_num(x['val_loss'], '.4f')} | {_num(x['final_train_loss'], '.4f')} | "
                f"{_num(x['samples_per_s'], '.1f')} | {_num(x['train_s'], '.1f')} |"
            )
            if fp16:
                row += f" {_num(x['skipped_steps'], 'd')} | {_num(x['loss_scale'], 'g')} |"
            if curve:
                by_seed = an[mode].get("x_time_to_ref_val_by_seed", {})
                v = by_seed.get(int(seed)) if mode != REFERENCE else None
                row += " (reference) |" if mode == REFERENCE else f" {_x(v)} |"
            lines.append(row)
    lines += [
        "",
        "| mode | val loss, mean [min, max] | val gap to zero1, paired | within zero1's seed spread |"
        + (" skipped steps | final loss scale |" if fp16 else "")
        + (f" time to {REFERENCE}'s final val loss (x {REFERENCE}), paired |" if curve else ""),
        "|---|---|---|---|" + ("---|---|" if fp16 else "") + ("---|" if curve else ""),
    ]
    for mode in s["modes"]:
        a = an[mode]
        gap = sd.fmt(a.get("val_gap"), ".2f", 100, "%", sign=True) if mode != REFERENCE else "(reference)"
        within = a.get("within_reference_spread", "(reference)")
        row = f"| {mode} | {sd.fmt(a['val_loss'])} | {gap} | {within} |"
        if fp16:
            row += f" {sd.fmt(a['skipped_steps'], '.0f')} | {sd.fmt(a['loss_scale'], 'g')} |"
        if curve:
            row += (
                " (reference) |"
                if mode == REFERENCE
                else f" {sd.fmt(a.get('x_time_to_ref_val'), '.2f', suffix='x')} |"
            )
        lines.append(row)
    failed = [seed for seed, r in res["seeds"].items() if "error" in r]
    if failed:
        lines += ["", "## Runs that could not run", ""]
        lines += [
            f"- seed {seed}: `{res['seeds'][seed]['command']}`\n\n```\n{res['seeds'][seed]['error']}\n```"
            for seed in failed
        ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    a = parse(argv)
    if a.from_json:
        res = load_results(a.from_json)
    else:
        work = Path(a.work or tempfile.mkdtemp(prefix="acco_fidelity_"))
        work.mkdir(parents=True, exist_ok=True)
        dirty = uncommitted()
        seeds = {str(seed): run_seed(a, seed, work) for seed in a.seeds}
        params = next((r["model_params"] for r in seeds.values() if "model_params" in r), 0)
        res = {
            "machine": machine_info(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "command": shlex.join(
                ["python", "-m", "benchmarks.fidelity", *(argv if argv is not None else sys.argv[1:])]
            ),
            "prefix": a.prefix,
            "setup": {
                "dtype": a.dtype,
                "modes": a.modes,
                "seeds": a.seeds,
                **{k: getattr(a, k) for k in SHARED},
            },
            "seed_commands": [
                shlex.join(["python", *train_command(a, seed, Path(f"<work>/seed{seed}"))[1:]])
                for seed in a.seeds
            ],
            "model_params": params,
            "uncommitted": dirty,
            "seeds": seeds,
        }
        res["analysis"] = analyse(res)
    print(write_report(Path(a.out), a.prefix, render(res), {"results": res}))
    return 1 if any("error" in r for r in res["seeds"].values()) else 0
