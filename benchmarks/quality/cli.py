"""What ACCO costs in validation loss against synchronous training (ZeRO-1's math), cheaply: the single-process reference.

    python -m benchmarks.quality --out benchmarks/results/quality/run1            # the whole grid, 3 seeds
    python -m benchmarks.quality --settings base --seeds 0 --base-steps 40 --out /tmp/q   # one setting
    python -m benchmarks.quality --from-json benchmarks/results/quality/run1/quality.json  # re-render

Every run is ``acco_ds.core.reference.reference_run`` (``benchmarks.quality.study``) on the main job's tiny GPT and
byte corpus, fp32, ``--world-size`` simulated ranks each reading its own micro-batches in the job's order, with the
job's AdamW settings and LR schedule: no DeepSpeed ranks are launched. For every setting of ``--settings`` (the
``GRID`` below: the base run, the peak LR x0.5 and x2, GAS 2 and 8 at the same micro-batch, GAS 8 at the same tokens
per step, 100 / 300 / 600 steps) and every seed, it runs each of ``--modes`` (sync: ZeRO-1's math; dpu; acco with
fixed accumulation: adaptive accumulation depends on timing and is not run here) from the same initialisation on the
same data, and records the validation loss every ``--eval-every`` steps, the per-step training loss and norm, and,
in acco, the estimate's distance to the committed parameters (``study.run``).

Writes into ``--out`` (which must not already hold ``<prefix>.json``): ``<prefix>.json`` (raw; ``--from-json``
renders the same files from it), ``<prefix>.md`` (the tables: each setting's final gap to sync paired by seed, the
gap over the steps, the estimate's distance) and, with matplotlib, ``<prefix>_gap.png`` and
``<prefix>_estimate.png``. ``--work`` keeps each run's record as it finishes (a rerun with the same ``--work``
reuses them).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from acco_ds.cli.metrics import machine_info
from benchmarks.harness import seeds as sd
from benchmarks.harness.cli import parser
from benchmarks.harness.records import load_results, write_report
from benchmarks.harness.sweep import seeds_arg
from benchmarks.quality import study, variants

BASE_LR = 2e-3  # acco-train's --lr
# name: (group, steps or None for --base-steps, LR factor, GAS, micro-batch[, {world_size, warmup_steps}])
GRID = {
    "base": ("base", None, 1.0, 4, 8),
    "lr_x0.5": ("lr", None, 0.5, 4, 8),
    "lr_x0.75": ("lr", None, 0.75, 4, 8),
    "lr_x1.5": ("lr", None, 1.5, 4, 8),
    "lr_x2": ("lr", None, 2.0, 4, 8),
    "warmup5": ("warmup", None, 1.0, 4, 8, {"warmup_steps": 5}),
    "warmup50": ("warmup", None, 1.0, 4, 8, {"warmup_steps": 50}),
    "gas2": ("gas", None, 1.0, 2, 8),
    "gas8": ("gas", None, 1.0, 8, 8),
    "gas8_mb4": ("gas", None, 1.0, 8, 4),
    "mb16": ("tokens", None, 1.0, 4, 16),
    "ranks4": ("tokens", None, 1.0, 4, 8, {"world_size": 4}),
    "steps100": ("length", 100, 1.0, 4, 8),
    "steps300": ("length", 300, 1.0, 4, 8),
    "steps600": ("length", 600, 1.0, 4, 8),
    "steps2000": ("length", 2000, 1.0, 4, 8),
}
# acco with one thing changed (benchmarks.quality.variants): probes of the gap's cause and candidate remedies
VARIANTS = {
    "est_x0": dict(est_scale=0.0),
    "est_x0.5": dict(est_scale=0.5),
    "est_x1.5": dict(est_scale=1.5),
    "probe": dict(probe_every=5),
    "peek_m0.5": dict(peek_momentum=0.5),
    "peek_lr_x0.5": dict(peek_lr_scale=0.5),
    "peek_lr_x1.5": dict(peek_lr_scale=1.5),
    "peek_lr_x2": dict(peek_lr_scale=2.0),
    "commit_w0.5": dict(commit_weight=0.5),
    "split_1": dict(estimate_micro_batches=1),
    "split_q": dict(estimate_micro_batches="quarter"),  # GAS / 4, at least 1
    "curv_1e6": dict(curvature_lambda=1e6),
    "adaptive_1_0": dict(rank_extra=(1, 0)),
}
PLOT_GROUPS = {
    "base": "base",
    "lr": "peak LR",
    "warmup": "warm-up",
    "gas": "accumulation",
    "tokens": "tokens per step",
    "length": "run length",
}
PLOTTED_VARIANTS = ("peek_lr_x1.5",)  # drawn dashed beside acco in the gap plot
SETUP_KNOBS = ("n_layer", "n_head", "d_model", "context", "world_size", "warmup_steps", "eval_windows")


def parse(argv=None) -> argparse.Namespace:
    ap = parser("quality", __doc__)
    ap.add_argument("--settings", default=",".join(GRID), help=f"comma-separated, from {', '.join(GRID)}")
    ap.add_argument("--modes", default=",".join(study.MODES), help="comma-separated, sync among them")
    ap.add_argument(
        "--variants",
        default="",
        help=f"comma-separated acco variants to run beside the modes: {', '.join(VARIANTS)}",
    )
    ap.add_argument(
        "--arch", default="tiny", choices=("tiny", "gpt2", "llama"), help="the model (default tiny)"
    )
    ap.add_argument(
        "--seeds", type=seeds_arg, default=[0, 1, 2], help="comma-separated seeds (default 0,1,2)"
    )
    ap.add_argument(
        "--setting-seeds",
        action="append",
        default=[],
        metavar="NAME=SEEDS",
        help="the seeds of one setting instead of --seeds (repeatable), e.g. steps300=0",
    )
    ap.add_argument(
        "--setting-variants",
        action="append",
        default=[],
        metavar="NAME=VARIANTS",
        help="the variants of one setting instead of --variants (repeatable; '-' for none), e.g. steps2000=split_1",
    )
    ap.add_argument(
        "--no-new-runs",
        action="store_true",
        help="render from the records already in --work and start no run (a missing record is left out)",
    )
    ap.add_argument("--base-steps", type=int, default=150, help="steps of the settings without their own")
    ap.add_argument("--eval-every", type=int, default=10, help="validation loss every this many steps")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    defaults = study.Setup()
    for name in SETUP_KNOBS:
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    ap.add_argument("--out", default=None, help="folder of the files (required unless --from-json)")
    ap.add_argument("--prefix", default="quality", help="file name prefix (default quality)")
    ap.add_argument("--work", default=None, help="folder of each run's record (default: a new temp folder)")
    ap.add_argument("--from-json", default=None, help="re-render the files from a saved raw JSON, beside it")
    a = ap.parse_args(argv)
    a.settings, a.modes = a.settings.split(","), a.modes.split(",")
    a.variants = [v for v in a.variants.split(",") if v]
    for v in a.variants:
        if v not in VARIANTS:
            ap.error(f"--variants: unknown variant {v!r}; allowed: {', '.join(VARIANTS)}")
    for s in a.settings:
        if s not in GRID:
            ap.error(f"--settings: unknown setting {s!r}; allowed: {', '.join(GRID)}")
    for m in a.modes:
        if m not in study.MODES:
            ap.error(f"--modes: unknown mode {m!r}; allowed: {', '.join(study.MODES)}")
    per = {}
    for item in a.setting_seeds:
        name, _, seeds = item.partition("=")
        if name not in GRID or not seeds:
            ap.error(f"--setting-seeds {item!r}: NAME=SEEDS with NAME among {', '.join(GRID)}")
        per[name] = seeds_arg(seeds)
    a.setting_seeds = per
    per_var = {}
    for item in a.setting_variants:
        name, _, names = item.partition("=")
        chosen = [v for v in names.split(",") if v and v != "-"]
        if name not in GRID or not names or any(v not in VARIANTS for v in chosen):
            ap.error(
                f"--setting-variants {item!r}: NAME=VARIANTS with NAME among {', '.join(GRID)} and VARIANTS "
                f"among {', '.join(VARIANTS)} (or '-')"
            )
        per_var[name] = chosen
    a.setting_variants = per_var
    if "sync" not in a.modes:
        ap.error("--modes: sync (the reference of every gap) must be among them")
    if a.from_json:
        a.out = a.out or str(Path(a.from_json).parent)
        a.prefix = Path(a.from_json).stem
        return a
    if not a.out:
        ap.error("--out is required: a new folder (e.g. benchmarks/results/quality/run2)")
    if (Path(a.out) / f"{a.prefix}.json").exists():
        ap.error(f"--out {a.out} already holds {a.prefix}.json: give a new folder or --prefix")
    if a.no_new_runs and not a.work:
        ap.error("--no-new-runs renders from --work: give the folder of the records")
    if min(a.base_steps, a.eval_every, a.threads) < 1:
        ap.error("--base-steps, --eval-every and --threads must be >= 1")
    return a


def make_setting(name: str, base_steps: int) -> study.Setting:
    group, steps, factor, gas, mb, *more = GRID[name]
    return study.Setting(
        name, group, steps or base_steps, BASE_LR * factor, gas, mb, **(more[0] if more else {})
    )


def make_setup(a) -> study.Setup:
    return replace(study.Setup(), arch=getattr(a, "arch", "tiny"), **{k: getattr(a, k) for k in SETUP_KNOBS})


def make_variant(name: str, setting: study.Setting) -> variants.Variant:
    """``VARIANTS[name]`` for ``setting`` ("quarter": GAS / 4 micro-batches in the estimate's round, at least 1)."""
    knobs = dict(VARIANTS[name])
    if knobs.get("estimate_micro_batches") == "quarter":
        knobs["estimate_micro_batches"] = max(1, setting.grad_accum // 4)
    if "rank_extra" in knobs:
        world = setting.world_size or study.Setup().world_size
        knobs["rank_extra"] = tuple(knobs["rank_extra"]) + (0,) * (world - len(knobs["rank_extra"]))
    return variants.Variant(name, **knobs)


def run_all(a) -> dict:
    """{setting: {"setting": ..., "seeds": {seed: {mode: record}}}}, each run's record kept in ``a.work``."""
    torch.set_num_threads(a.threads)
    setup = make_setup(a)
    work = Path(a.work or tempfile.mkdtemp(prefix="acco_quality_"))
    work.mkdir(parents=True, exist_ok=True)
    out = {}
    for name in a.settings:
        setting = make_setting(name, a.base_steps)
        block = out[name] = {"setting": setting.to_dict(), "seeds": {}}
        for seed in a.setting_seeds.get(name, a.seeds):
            runs = block["seeds"][str(seed)] = {}
            problem = None
            for mode in [*a.modes, *a.setting_variants.get(name, a.variants)]:
                path = work / f"{name}.seed{seed}.{mode}.json"
                if path.exists():
                    runs[mode] = json.loads(path.read_text())
                    continue
                if a.no_new_runs:
                    continue
                if mode in VARIANTS and (
                    setting.grad_accum < 2 or (mode.startswith("split") and setting.grad_accum < 4)
                ):
                    continue
                problem = problem or study.Problem(setup, setting, seed)
                t0 = time.time()
                if mode in VARIANTS:
                    rec = variants.variant_run(problem, make_variant(mode, setting), a.eval_every)
                else:
                    rec = study.run(problem, mode, a.eval_every)
                rec["wall_s"] = time.time() - t0
                path.write_text(json.dumps(rec))
                runs[mode] = rec
                print(
                    f"quality: {name} seed {seed} {mode}: val {rec['val_loss'][-1]:.4f} "
                    f"({rec['wall_s']:.1f} s)",
                    flush=True,
                )
    return out


# --- analysis ---------------------------------------------------------------------------------------------------


def gaps(block: dict, mode: str) -> dict:
    """{seed: [val_mode / val_sync - 1 at each evaluated step]} and the steps."""
    out, steps = {}, None
    for seed, runs in block["seeds"].items():
        if mode in runs and "sync" in runs:
            steps = runs["sync"]["val_step"]
            out[seed] = [m / s - 1.0 for m, s in zip(runs[mode]["val_loss"], runs["sync"]["val_loss"])]
    return {"steps": steps or [], "by_seed": out}


def _window_mean(values: list, lo: float, hi: float, steps: list) -> float | None:
    picked = [v for s, v in zip(steps, values) if lo <= s <= hi]
    return statistics.mean(picked) if picked else None


def estimate_summary(block: dict, name: str = "acco") -> dict | None:
    """The estimate distance, one-step distance, their ratio and (where recorded) how far along the committed step
    the estimate lies, of run ``name`` (acco or a variant), per seed, averaged over the run's thirds (by step)."""
    per_seed = {}
    for seed, runs in block["seeds"].items():
        est = runs.get(name, {}).get("estimate")
        if not est or not est["step"]:
            continue
        n = block["setting"]["steps"]
        thirds = [(1, n / 3), (n / 3, 2 * n / 3), (2 * n / 3, n)]
        keys = [k for k in ("est_dist", "step_dist", "along") if k in est]
        per_seed[seed] = {
            key: [_window_mean(est[key], lo, hi, est["step"]) for lo, hi in thirds] for key in keys
        }
        per_seed[seed]["ratio"] = [
            e / s if e is not None and s else None
            for e, s in zip(per_seed[seed]["est_dist"], per_seed[seed]["step_dist"])
        ]
    if not per_seed:
        return None
    keys = set.intersection(*(set(v) for v in per_seed.values()))
    return {
        key: [sd.spread(v[key][i] for v in per_seed.values() if v[key][i] is not None) for i in range(3)]
        for key in keys
    }


def within_spread(mode_val: dict | None, sync_val: dict | None) -> str | None:
    """Where a run's mean final validation loss lies against sync's seed spread: "within" [min, max] of sync's seeds,
    "above" (worse than every sync seed) or "below" (better than every one); None without both."""
    if not mode_val or not sync_val or sync_val["n"] < 2:
        return None
    if mode_val["mean"] > sync_val["max"]:
        return "above"
    return "below" if mode_val["mean"] < sync_val["min"] else "within"


def run_names(setup: dict) -> list:
    """The modes, then the variants, of a study's setup (older results have no variants)."""
    return [*setup["modes"], *setup.get("variants", [])]


def probe_summary(block: dict) -> dict | None:
    """The mismatch probe's thirds (``variants.probe_summary``), mean [min, max] over the seeds that ran it."""
    per_seed = [
        variants.probe_summary(runs["probe"]["probe"], block["setting"]["steps"])
        for runs in block["seeds"].values()
        if "probe" in runs.get("probe", {})
    ]
    if not per_seed:
        return None
    keys = [k for k in per_seed[0][0]]
    return {k: [sd.spread(p[i][k] for p in per_seed if p[i][k] is not None) for i in range(3)] for k in keys}


def analyse(res: dict) -> dict:
    out = {}
    for name, block in res["settings"].items():
        an = {"final_val": {}, "final_gap": {}}
        for mode in run_names(res["setup"]):
            vals = [r[mode]["val_loss"][-1] for r in block["seeds"].values() if mode in r]
            an["final_val"][mode] = sd.spread(vals)
            if mode != "sync":
                g = gaps(block, mode)
                an["final_gap"][mode] = sd.spread(v[-1] for v in g["by_seed"].values())
        an["spread"] = {
            m: within_spread(an["final_val"].get(m), an["final_val"].get("sync")) for m in an["final_gap"]
        }
        an["estimate"] = estimate_summary(block)
        an["estimate_by_run"] = {
            v: e
            for v in run_names(res["setup"])
            if v not in ("sync", "dpu") and (e := estimate_summary(block, v))
        }
        an["probe"] = probe_summary(block)
        out[name] = an
    return out


# --- rendering ---------------------------------------------------------------------------------------------------


def _pct(s: dict | None) -> str:
    return sd.fmt(s, ".2f", 100, "%", sign=True) if s else "-"


def _gap_cell(an: dict, run: str) -> str:
    where = an.get("spread", {}).get(run)
    cell = _pct(an["final_gap"].get(run))
    return cell if not where or cell == "-" else f"{cell}, *{where}*"


def _sci(s: dict | None) -> str:
    if not s:
        return "-"
    return f"{s['mean']:.2e} [{s['min']:.2e}, {s['max']:.2e}]"


def _ratio(s: dict | None) -> str:
    return "-" if not s else f"{s['mean']:.2f} [{s['min']:.2f}, {s['max']:.2f}]"


def _model_name(setup: dict) -> str:
    arch = setup.get("arch", "tiny")
    return {"tiny": "the job's tiny GPT", "gpt2": "GPT-2 (transformers)", "llama": "Llama (transformers)"}[
        arch
    ]


def render(res: dict) -> str:
    m, s = res["machine"], res["setup"]
    an = res["analysis"]
    modes = s["modes"]
    others = [x for x in modes if x != "sync"]
    lines = [
        f"# Quality study: {', '.join(modes)} on the single-process reference, paired seeds",
        "",
        f"- Date: {res['date']}; machine: {m.get('cpu', '-')}, {m.get('cores', '-')} cores; python {m.get('python', '-')}, "
        f"torch {m.get('torch', '-')}, deepspeed {m.get('deepspeed', '-')}, acco_ds {m.get('acco_ds', '-')}",
        f"- Command: `{res['command']}`; raw results: `{res['prefix']}.json` beside this file; "
        f"{res.get('total_s', 0) / 60:.1f} min of runs (their wall times summed), {s['threads']} torch thread(s)",
        f"- Model: {_model_name(s)}, {s['n_layer']} layers, {s['n_head']} heads, d_model {s['d_model']}, context "
        f"{s['context']} bytes, {res['model_params'] / 1e6:.2f}M parameters; fp32; {s['world_size']} simulated ranks; "
        "AdamW betas (0.9, 0.95), eps 1e-8, weight decay 0.1, clipping 1.0; DeepSpeed's WarmupCosineLR "
        f"(warm-up {s['warmup_steps']} steps, cosine to {s['min_lr_ratio']:g} x the peak at the run's last step)",
        f"- Validation loss on the committed parameters over {s['eval_windows']} windows every {s['eval_every']} steps; "
        "gap = val(mode) / val(sync) - 1, paired by seed (same initialisation and data), mean [min, max] over the "
        "seeds; acco with fixed accumulation (k = GAS/2 micro-batches per round); adaptive accumulation is not run",
        "",
        "## Final validation loss and gap to sync",
        "",
        "| setting | steps | peak LR | warm-up | ranks x GAS x micro-batch | tokens / step | sync val loss | "
        + " | ".join(f"{x} gap" for x in others)
        + " |",
        "|---|---|---|---|---|---|---|" + "---|" * len(others),
    ]
    for name, block in res["settings"].items():
        st, a = block["setting"], an[name]
        world = st.get("world_size") or s["world_size"]
        warm = s["warmup_steps"] if st.get("warmup_steps") is None else st["warmup_steps"]
        lines.append(
            f"| {name} | {st['steps']} | {st['lr']:g} | {warm} | {world} x {st['grad_accum']} x {st['micro_batch']} | "
            f"{world * st['grad_accum'] * st['micro_batch'] * s['context']} | "
            f"{sd.fmt(a['final_val'].get('sync'))} | " + " | ".join(_gap_cell(a, x) for x in others) + " |"
        )
    lines += [
        "",
        "A gap cell ends with where the run's mean validation loss lies against sync's seeds: *within* their [min, max], "
        "*above* (worse than every sync seed) or *below* (better than every one); nothing where sync ran one seed.",
    ]
    var = s.get("variants", [])
    if var:
        ran = [n for n in res["settings"] if any(an[n]["final_gap"].get(v) for v in var)]
        lines += [
            "",
            "## acco's variants: final gap to sync",
            "",
            "Each variant is acco with one thing changed (`benchmarks/quality/variants.py`); acco's own gap is the first "
            "row. Paired by seed with the same sync runs.",
            "",
            "| variant | knobs | " + " | ".join(ran) + " |",
            "|---|---|" + "---|" * len(ran),
        ]
        knobs = s.get("variant_knobs", {})
        rows = (["acco"] if "acco" in modes else []) + var
        for v in rows:
            kn = ", ".join(f"{k}={x}" for k, x in knobs.get(v, {}).items()) or "(as specified)"
            lines.append(f"| {v} | {kn} | " + " | ".join(_gap_cell(an[n], v) for n in ran) + " |")
    probes = [n for n in res["settings"] if an[n].get("probe")]
    if probes:
        lines += [
            "",
            "## acco: the g~ half's gradient error (the probe)",
            "",
            "mismatch = ||g(theta~) - g(theta)|| / ||g(theta)|| for the g~ half's micro-batches (its error), half-batch "
            "noise = ||g~(theta) - g(theta)|| / ||g(theta)|| between the two halves' data at the same parameters, cos = "
            "the cosine of the error with the committed gradient; each averaged over a third of the run, mean [min, max] "
            "over the seeds.",
            "",
            "| setting | mismatch, 1st third | mismatch, last third | half-batch noise, 1st third | "
            "half-batch noise, last third | cos, last third |",
            "|---|---|---|---|---|---|",
        ]
        for n in probes:
            p = an[n]["probe"]
            lines.append(
                f"| {n} | {_sci(p['mismatch'][0])} | {_sci(p['mismatch'][2])} | {_ratio(p['half_noise'][0])} | "
                f"{_ratio(p['half_noise'][2])} | {_ratio(p['cos'][2])} |"
            )
    if "acco" in modes or any(an[n].get("estimate_by_run") for n in res["settings"]):
        lines += [
            "",
            "## acco: the estimate's distance to the committed parameters",
            "",
            "est = ||theta~^t - theta^t|| / ||theta^t|| (where the g~^t half of step t's gradient was computed), "
            "one-step = ||theta^t - theta^(t-1)|| / ||theta^t|| (the parameters one step older), each averaged over "
            "the steps of a third of the run, then mean [min, max] over the seeds; ratio = est / one-step; along = "
            "how far along the committed step theta^t - theta^(t-1) the estimate lies (1: on theta^t; < 1: behind it; "
            "recorded by the variants' runs, `benchmarks/quality/variants.py`).",
            "",
            "| setting | run | est, 1st third | est, last third | one-step, last third | "
            "ratio, 1st third | ratio, last third | along, 1st third | along, last third |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name in res["settings"]:
            runs = {"acco": an[name]["estimate"], **an[name].get("estimate_by_run", {})}
            for run, e in runs.items():
                if not e:
                    continue
                along = e.get("along") or [None] * 3
                lines.append(
                    f"| {name} | {run} | {_sci(e['est_dist'][0])} | {_sci(e['est_dist'][2])} | "
                    f"{_sci(e['step_dist'][2])} | {_ratio(e['ratio'][0])} | {_ratio(e['ratio'][2])} | "
                    f"{_ratio(along[0])} | {_ratio(along[2])} |"
                )
    lines += ["", "## The gap over the steps", ""]
    for name, block in res["settings"].items():
        per = {x: gaps(block, x) for x in others}
        steps = next((g["steps"] for g in per.values() if g["steps"]), [])
        if not steps:
            continue
        stride = max(1, len(steps) // 8)
        shown = sorted(set(steps[::stride]) | {steps[-1]})
        lines += [f"### {name}", "", "| step | " + " | ".join(f"{x} gap" for x in others) + " |"]
        lines.append("|---|" + "---|" * len(others))
        for step in shown:
            i = steps.index(step)
            cells = [_pct(sd.spread(v[i] for v in per[x]["by_seed"].values())) for x in others]
            lines.append(f"| {step} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def plot(res: dict):
    """The plots' writer for ``write_report`` (nothing without matplotlib)."""

    def write(out: Path, prefix: str):
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return []
        settings = res["settings"]
        groups = {}
        for name, block in settings.items():
            groups.setdefault(block["setting"]["group"], []).append(name)
        if "base" in settings:
            for g in list(PLOT_GROUPS)[1:]:
                if g in groups:
                    groups[g] = ["base", *groups[g]]
        order = [g for g in PLOT_GROUPS if g in groups]
        shown_variants = [v for v in PLOTTED_VARIANTS if v in res["setup"].get("variants", [])]
        paths = []
        ncols = min(3, len(order))
        nrows = -(-len(order) // ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.8 * nrows), squeeze=False)
        for ax in axes.flat[len(order) :]:
            ax.set_visible(False)
        for ax, g in zip(axes.flat, order):
            for name in groups[g]:
                for mode, style in (("acco", "-"), ("dpu", ":"), *((v, "--") for v in shown_variants)):
                    if mode not in run_names(res["setup"]) or (g != "base" and mode == "dpu"):
                        continue
                    gp = gaps(settings[name], mode)
                    if not gp["by_seed"]:
                        continue
                    vals = list(gp["by_seed"].values())
                    mean = [100 * statistics.mean(c) for c in zip(*vals)]
                    lo = [100 * min(c) for c in zip(*vals)]
                    hi = [100 * max(c) for c in zip(*vals)]
                    (line,) = ax.plot(gp["steps"], mean, style, label=f"{mode} {name}")
                    ax.fill_between(gp["steps"], lo, hi, color=line.get_color(), alpha=0.15)
            ax.axhline(0, color="k", lw=0.5)
            ax.set_yscale("symlog", linthresh=0.1)  # dpu's gap is two orders above acco's
            ax.set_title(PLOT_GROUPS[g])
            ax.set_xlabel("optimizer step")
            ax.set_ylabel("val loss gap to sync, % (symlog)")
            ax.legend(fontsize=7)
        fig.tight_layout()
        p = out / f"{prefix}_gap.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
        if "acco" in res["setup"]["modes"]:
            fig, ax = plt.subplots(figsize=(6, 3.8))
            for name in settings:
                if settings[name]["setting"]["group"] not in ("base", "lr"):
                    continue
                for i, runs in enumerate(settings[name]["seeds"].values()):
                    est = runs.get("acco", {}).get("estimate")
                    if not est:
                        continue
                    (line,) = ax.plot(
                        est["step"], est["est_dist"], lw=0.8, label=f"est {name}" if i == 0 else None
                    )
                    if name == "base" and i == 0:
                        ax.plot(est["step"], est["step_dist"], ":", color=line.get_color(), lw=0.8,
                                label="one-step base")  # fmt: skip
            ax.set_yscale("log")
            ax.set_xlabel("optimizer step")
            ax.set_ylabel("distance / ||theta||")
            ax.set_title("acco: ||theta~ - theta|| / ||theta|| (every seed)")
            ax.legend(fontsize=7)
            fig.tight_layout()
            p = out / f"{prefix}_estimate.png"
            fig.savefig(p, dpi=110)
            plt.close(fig)
            paths.append(p)
        return paths

    return write


def main(argv=None) -> int:
    a = parse(argv)
    if a.from_json:
        res = load_results(a.from_json)
    else:
        settings = run_all(a)
        setup = make_setup(a)
        res = {
            "machine": machine_info(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "command": shlex.join(
                ["python", "-m", "benchmarks.quality", *(argv if argv is not None else sys.argv[1:])]
            ),
            "prefix": a.prefix,
            "setup": {
                **setup.to_dict(),
                "modes": a.modes,
                "variants": sorted(
                    {v for n in a.settings for v in a.setting_variants.get(n, a.variants)},
                    key=list(VARIANTS).index,
                ),
                "setting_variants": a.setting_variants,
                "variant_knobs": {v: dict(VARIANTS[v]) for v in VARIANTS},
                "seeds": a.seeds,
                "setting_seeds": a.setting_seeds,
                "eval_every": a.eval_every,
                "threads": a.threads,
                "base_lr": BASE_LR,
            },
            "model_params": int(study.Problem(setup, make_setting(a.settings[0], 1), 0).theta0.numel()),
            "total_s": sum(
                r.get("wall_s", 0.0)
                for b in settings.values()
                for runs in b["seeds"].values()
                for r in runs.values()
            ),
            "settings": settings,
        }
    res["analysis"] = analyse(res)
    print(write_report(Path(a.out), a.prefix, render(res), {"results": res}, plot(res)))
    return 0
