"""The main job: one launched run per mode, then the merged metrics, the summary and the plots.

Contract: ``run_job(args)`` (args from ``acco_ds.cli.args.parse``) writes into ``args.out``:
- ``runs/<label>/``: each run's spec, DeepSpeed config, launcher log and the ranks' raw records;
- ``metrics.jsonl``: one line per (mode, optimizer step): mode, step, samples, time_s, loss,
  samples_per_s, and with fp16 loss_scale and skipped_steps (the engine's so far);
- ``summary.json``: machine and versions, the options, the corpus, the model size and, per mode,
  the steady-state figures and the validation loss on the committed parameters (with fp16: the final
  loss scale and the engine's skipped steps), its ``val_curve`` (the evaluations every ``--eval-every`` steps),
  and ``time_to_loss``: when each run first reached the baseline's (zero1, else sync) final validation loss
  (``time_to_baseline_loss``), printed after the table with a closing sentence (``time_to_loss_lines``);
- ``loss_vs_samples.png`` and ``loss_vs_time.png``.
It returns the summary dict. A failing run raises ``LaunchError`` with the end of its log.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from acco_ds.cli import dsconfig
from acco_ds.cli.launch import free_port, launch_command, run_ranks
from acco_ds.cli.metrics import FP16_KEYS, machine_info, merge_ranks, read_ranks, summarize
from acco_ds.cli.plots import plot_losses
from acco_ds.cli.spec import RunSpec
from acco_ds.cli.time_to_loss import versus_baseline


def acco_registered() -> tuple:
    """(True, '') when ``import acco_ds`` makes DeepSpeed accept ``"type": "ACCO"``, else
    (False, why)."""
    try:
        from deepspeed.runtime.engine import DeepSpeedEngine

        import acco_ds  # noqa: F401

        if DeepSpeedEngine._is_supported_optimizer(None, "ACCO"):
            return True, ""
        return False, "import acco_ds did not register the 'ACCO' optimizer type with DeepSpeed"
    except Exception as err:
        return False, f"import acco_ds failed or does not register ACCO: {type(err).__name__}: {err}"


MODEL_NAMES = {"tiny": "GPT", "gpt2": "GPT-2", "llama": "Llama"}


def _model_cfg(a) -> dict:
    """The run's model dict (``acco_ds.models.build_model``): ``arch`` plus its config fields."""
    if a.model == "tiny":
        from acco_ds.models import GPTConfig

        cfg = GPTConfig(n_layer=a.n_layer, n_head=a.n_head, d_model=a.d_model, context=a.context)
        return dict(arch="tiny", **cfg.to_dict())
    from acco_ds.models import HFModelConfig

    return HFModelConfig(
        arch=a.model,
        n_layer=a.n_layer,
        n_head=a.n_head,
        d_model=a.d_model,
        context=a.context,
        d_ff=a.d_ff,
        n_kv_head=a.n_kv_head,
    ).to_dict()


def _num_params(model_cfg: dict) -> int:
    from acco_ds.models import model_num_params

    return model_num_params(model_cfg)


def _loss_scale_knobs(a) -> dict:
    """The fp16 loss-scale knobs the options give (``--initial-scale-power``, ``--loss-scale-window``); those
    left unset keep ``dsconfig.Knobs``'s defaults (DeepSpeed's)."""
    names = ("initial_scale_power", "loss_scale_window")
    return {n: getattr(a, n) for n in names if getattr(a, n, None) is not None}


def plan_runs(a, model_cfg: dict, n_params: int) -> list:
    """[(label, mode, accumulation, ds_config)] in the order they run."""
    knobs = dsconfig.Knobs(
        micro_batch=a.micro_batch,
        grad_accum=a.grad_accum,
        world_size=a.world_size,
        lr=a.lr,
        min_lr=a.min_lr,
        warmup_steps=a.warmup_steps,
        total_steps=a.steps,
        weight_decay=a.weight_decay,
        grad_clip=a.grad_clip,
        bf16=a.dtype == "bf16",
        fp16=a.dtype == "fp16",
        **_loss_scale_knobs(a),
        accumulation=a.accumulation,
        peek_lr_scale=a.peek_lr_scale,
        memory_state=a.memory_state,
        memory_state_form=a.memory_state_form,
        num_params=n_params,
        tp=a.tp,
    )
    user = dsconfig.load_user_config(a.config, knobs)
    if user is not None:
        mode, acc = dsconfig.config_mode(user)
        return [(dsconfig.label(mode, acc), mode, acc, user)]
    runs = []
    for mode in a.mode:
        acc = a.accumulation if mode in ("acco", "dpu") else "fixed"
        runs.append((dsconfig.label(mode, acc), mode, acc, dsconfig.build_config(mode, knobs)))
    return runs


def make_spec(a, label: str, mode: str, acc: str, cfg: dict, model_cfg: dict, run_dir: Path) -> RunSpec:
    """The RunSpec of one run of the job (the ranks read it; see ``acco_ds.cli.spec``)."""
    checkpoint_dir = a.checkpoint_dir or (str(run_dir / "checkpoints") if a.save_every else None)
    return RunSpec(
        name=label,
        mode=mode,
        accumulation=acc,
        run_dir=str(run_dir),
        model=model_cfg,
        ds_config=cfg,
        steps=a.steps,
        micro_batch=cfg.get("train_micro_batch_size_per_gpu", a.micro_batch),
        grad_accum=cfg.get("gradient_accumulation_steps", a.grad_accum),
        seed=a.seed,
        threads=a.threads,
        corpus=a.corpus,
        eval_windows=a.eval_windows,
        eval_every=a.eval_every,
        progress=not a.no_progress,
        slow_rank=a.slow_rank,
        slow_factor=a.slow_factor,
        tp=a.tp,
        save_every=a.save_every,
        checkpoint_dir=checkpoint_dir,
        keep_checkpoints=a.keep_checkpoints,
    )


def table_rows(summary: dict) -> list:
    """The rows of the final table (a header first): one per run; with an fp16 run, each run's skipped steps
    (``engine.skipped_steps``) and final loss scale too."""
    fp16 = any(s.get("fp16") for s in summary["runs"].values())
    head = (
        "mode",
        "steps",
        "samples",
        "time s",
        "samples/s",
        "comm % of time",
        "comm hidden %",
        "train loss",
        "val loss",
        "peak MiB/rank",
    )
    rows = [head + (("skipped", "loss scale") if fp16 else ())]
    for label, s in summary["runs"].items():
        row = (
            label,
            str(s["steps"]),
            str(s["samples"]),
            f"{s['train_s']:.1f}",
            f"{s['samples_per_s']:.1f}",
            _percent(s.get("comm_share")),
            _percent(s.get("hidden_share")),
            f"{s['final_train_loss']:.3f}" if s["final_train_loss"] is not None else "-",
            f"{s['val_loss']:.3f}" if s["val_loss"] is not None else "-",
            f"{max(s['peak_mem_mib']):.0f}",
        )
        if fp16:
            row += (str(s["skipped_steps"]), f"{s['loss_scale']:g}") if s.get("fp16") else ("-", "-")
        rows.append(row)
    return rows


def _percent(share) -> str:
    return "-" if share is None else f"{100 * share:.0f}"


def overlap_line(summary: dict) -> str | None:
    """One sentence on what the ACCO runs' communication cost and hid (``metrics.overlap_shares``), so that a run on
    a fast link (where every mode's speed is close) says why and where the modes would part; None without such a
    run."""
    parts = [
        f"{label}: communication {100 * s['comm_share']:.0f}% of the training time, {100 * s['hidden_share']:.0f}% "
        "of it hidden behind compute"
        for label, s in summary["runs"].items()
        if s.get("comm_share") is not None and s.get("hidden_share") is not None
    ]
    if not parts:
        return None
    return (
        "acco-train: "
        + "; ".join(parts)
        + ". Where communication is a small share, every mode runs at about the same speed; on a link that makes "
        "it a large share, ZeRO-1 waits for all of it and ACCO only for the part it did not hide."
    )


BASELINES = ("zero1", "sync")
"""The run the others are measured against, the first of these the job ran: DeepSpeed's ZeRO-1, else acco_ds's
sync (ZeRO-1's math)."""


def baseline_label(labels) -> str | None:
    """The baseline among the runs' labels (``BASELINES``), None without one."""
    return next((b for b in BASELINES if b in labels), None)


def time_to_baseline_loss(summary: dict) -> dict | None:
    """When every run's validation loss first reached the baseline's final one (``acco_ds.cli.time_to_loss``, on
    the runs' ``val_curve``): ``{"baseline", "target", "eval_every", "baseline_crossing", "runs": {label:
    {"crossing", "x_baseline"}}}`` (crossings as dicts), or ``{"baseline", "error"}`` when the baseline's final
    loss is not finite; None without a baseline and another run to compare."""
    runs = summary["runs"]
    base = baseline_label(runs)
    curves = {label: s.get("val_curve") for label, s in runs.items() if s.get("val_curve")}
    if base is None or base not in curves or len(curves) < 2:
        return None
    try:
        v = versus_baseline(curves, base)
    except ValueError as err:
        return {"baseline": base, "error": str(err)}
    return {
        "baseline": base,
        "target": v["target"],
        "eval_every": (summary.get("options") or {}).get("eval_every"),
        "baseline_crossing": v["baseline_crossing"].to_dict(),
        "runs": {
            label: {"crossing": r["crossing"].to_dict(), "x_baseline": r["x_baseline"]}
            for label, r in v["runs"].items()
        },
    }


def _step(x: float) -> str:
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}"


def _reached(c: dict) -> str:
    if c["reached"]:
        return f"{c['time_s']:.1f} s, step {_step(c['step'])}"
    best = (
        "no finite loss" if c["best_loss"] is None else f"best {c['best_loss']:.4f} at step {c['best_step']}"
    )
    return f"never reached ({best})"


def time_to_loss_lines(summary: dict) -> list:
    """The summary's lines on the time to the baseline's final validation loss (``time_to_baseline_loss``), the
    closing sentence last; [] without a comparison."""
    t = summary.get("time_to_loss")
    if not t:
        return []
    base = t["baseline"]
    if "error" in t:
        return [f"acco-train: no time to {base}'s final validation loss: {t['error']}"]
    every = t.get("eval_every")
    how = (
        f"first crossing, linear between the evaluations every {every} steps"
        if every
        else "validation at the end only (--eval-every 0): each time is the run's whole training time"
    )
    lines = [
        f"time to {base}'s final validation loss {t['target']:.4f} ({how}; training clock, evaluations left out):",
        f"  {base} (the baseline): {_reached(t['baseline_crossing'])}",
    ]
    said = []
    for label, r in t["runs"].items():
        c, x = r["crossing"], r["x_baseline"]
        ratio = f"; time to {base}'s loss {x:.2f}x {base}'s" if x is not None else ""
        lines.append(f"  {label}: {_reached(c)}{ratio}")
        steps = summary["runs"][label]["steps"]
        if not c["reached"]:
            said.append(f"{label} did not get there within its {steps} steps")
        elif x is None:
            said.append(f"{label} got there at step {_step(c['step'])} (no time to compare)")
        else:
            when = "sooner" if x < 1 else ("no sooner" if x == 1 else "later")
            said.append(
                f"{label} got there {when} in wall time than {base} ({c['time_s']:.1f} s against "
                f"{t['baseline_crossing']['time_s']:.1f} s, {x:.2f}x)"
            )
    lines.append(f"acco-train: {base}'s final validation loss {t['target']:.4f}: " + "; ".join(said) + ".")
    return lines


def _print_table(summary: dict) -> None:
    rows = table_rows(summary)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


def _dtype_text(a, cfg: dict) -> str:
    """The precision of the runs as the header says it (fp16: its loss scaling)."""
    if dsconfig.fp16_enabled(cfg):
        fp16 = cfg["fp16"]
        if not fp16.get("loss_scale", 0):
            power = fp16.get("initial_scale_power", 16)
            window = fp16.get("loss_scale_window", 1000)
            return f"fp16 (dynamic loss scale from 2^{power}, window {window})"
        return f"fp16 (static loss scale {fp16['loss_scale']:g})"
    if (cfg.get("bf16") or {}).get("enabled") is True:
        return "bf16"
    return "fp32" if a.config else a.dtype


def run_job(a) -> dict:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model_cfg = _model_cfg(a)
    n_params = _num_params(model_cfg)
    runs = plan_runs(a, model_cfg, n_params)
    if any(str((cfg.get("optimizer") or {}).get("type", "")).lower() == "acco" for *_, cfg in runs):
        ok, why = acco_registered()
        if not ok:
            raise SystemExit(
                f"acco-train: cannot run the ACCO modes: {why}. Run with --mode zero1 meanwhile."
            )
    first = runs[0][3]
    mb = first.get("train_micro_batch_size_per_gpu", a.micro_batch)
    gas = first.get("gradient_accumulation_steps", a.grad_accum)
    print(
        f"acco-train: {len(runs)} run(s) [{', '.join(r[0] for r in runs)}], {a.world_size} ranks x {a.threads} "
        f"thread(s), model {MODEL_NAMES[model_cfg['arch']]} {n_params / 1e6:.2f}M params, {a.steps} steps x {gas} micro-batches x "
        f"{mb} seq x {a.context} bytes per rank, {_dtype_text(a, first)}; output: {out}",
        flush=True,
    )
    summary = {
        "machine": machine_info(),
        "options": vars(a),
        "model": dict(model_cfg, params=n_params),
        "runs": {},
    }
    curves = {}
    metrics_lines = []
    for label, mode, acc, cfg in runs:
        run_dir = out / "runs" / label
        spec = make_spec(a, label, mode, acc, cfg, model_cfg, run_dir)
        path = spec.save()
        (run_dir / "ds_config.json").write_text(json.dumps(cfg, indent=2))
        started = time.perf_counter()
        cmd = launch_command(str(path), a.world_size, free_port())
        run_ranks(cmd, a.threads, log_path=run_dir / "launch.log", show_stderr=True)
        logs, ranks = read_ranks(run_dir, a.world_size)
        logs, ranks = (
            logs[:: a.tp],
            ranks[:: a.tp],
        )  # one rank per replica: its tensor-parallel peers repeat it
        records = merge_ranks(logs, spec.micro_batch)
        s = summarize(records, ranks, warmup=min(5, a.steps // 5), micro_batch=spec.micro_batch)
        s["launch_wall_s"] = time.perf_counter() - started
        s["mode"], s["accumulation"] = mode, acc
        summary["runs"][label] = s
        curves[label] = records
        metrics_lines += [
            json.dumps(
                {
                    "mode": label,
                    "step": r["step"],
                    "samples": r["samples"],
                    "time_s": r["time_s"],
                    "loss": r["loss"],
                    "samples_per_s": r["samples_per_s"],
                    **{k: r[k] for k in FP16_KEYS if k in r},
                }
            )
            for r in records
        ]
        val = f"{s['val_loss']:.4f}" if s["val_loss"] is not None else "n/a"
        fp16 = f", {s['skipped_steps']} skipped steps, loss scale {s['loss_scale']:g}" if s["fp16"] else ""
        print(
            f"  {label}: val loss {val}, {s['samples_per_s']:.1f} samples/s, {s['train_s']:.1f} s{fp16}",
            flush=True,
        )
    (out / "metrics.jsonl").write_text("".join(x + "\n" for x in metrics_lines))
    summary["plots"] = [
        str(p)
        for p in plot_losses(
            curves, out, title=f"{n_params / 1e6:.2f}M-param {MODEL_NAMES[model_cfg['arch']]}, stdlib bytes"
        )
    ]
    summary["time_to_loss"] = time_to_baseline_loss(summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    _print_table(summary)
    said = overlap_line(summary)
    if said:
        print(said, flush=True)
    for line in time_to_loss_lines(summary):
        print(line, flush=True)
    print(f"acco-train: wrote {out / 'metrics.jsonl'}, {out / 'summary.json'} and the plots", flush=True)
    return summary
