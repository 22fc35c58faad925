"""Markdown building blocks of the e2e and topology benchmarks' reports: context lines (run, seeds,
token budget, compute-only bound, load, DeepSpeed settings), the runs that could not run, the
goals under both framings, the per-rate throughput table and the loss tables of both framings
(seed-paired). Each function returns lines (or a line); ``benchmarks.e2e.table`` and
``benchmarks.topology.report`` assemble them."""

from __future__ import annotations

import json

from benchmarks.harness import seeds as sd
from benchmarks.harness.goals import pct


def fmt_opt(x, fmt: str, none: str = "-") -> str:
    """``x`` formatted with ``fmt``, ``none`` for None."""
    return none if x is None else format(x, fmt)


def _mem(m: list) -> str:
    return "/".join(f"{v:.0f}" for v in m)


def seeds_line(results: dict, an: dict) -> str:
    seeds = an.get("seeds") or [results["setup"].get("seed", 0)]
    return (
        f"- seeds: {', '.join(str(s) for s in seeds)} ({len(seeds)} seed{'s' if len(seeds) != 1 else ''}); the seed "
        "fixes the initialisation and the data order, the same for every contender (micro-batch i of replica r "
        "under seed s is one function of (s, r, i)): loss figures are paired by seed, then their mean [min, max] "
        f"over the seeds is given and every loss verdict is made against that spread (fewer than {sd.MIN_SEEDS} "
        "seeds: indicative only). The seeds double as the repeats of the throughput figures: the seed with the "
        "highest samples/s is reported (best-of-N, a best case), the median beside it, every seed's figure in the "
        "last column; contenders interleaved (seed 0: every contender, then seed 1, ...)"
    )


def budget_line(results: dict, an: dict) -> str:
    s = results["setup"]
    budget = next((b["samples"] for b in an.get("budget", {}).values()), None)
    return (
        f"- token budget (framing b): {budget} samples = {s['steps']} steps x {s['grad_accum']} micro-batches x "
        f"{s['micro_batch']} sequences x {s['world'] // s.get('tp', 1)} replicas, what every fixed-accumulation "
        "contender computes. Adaptive ACCO computes more per step, so at each rate and seed it runs "
        "round(budget / its samples per step in that seed's full run) optimizer steps (at least 3) with its LR "
        f"schedule compressed to them: warm-up round({s['warmup_lr_steps']} x steps / {s['steps']}), cosine decay "
        "to the last step, so the schedule ends inside the budget; its full run stands for it when within 5% of "
        "the budget"
    )


def bound_line(comp: dict) -> str:
    each = ", ".join(f"{x:.1f}" for x in comp["each_samples_per_s"])
    if comp.get("loop"):  # the bound of runs.run_compute_only
        ranks = " + ".join(f"{x:.1f}" for x in comp["rank_samples_per_s"])
        return (
            f"- compute-only bound (the contenders' training loop with the communication removed: every replica its "
            f"own acco_ds job ({comp['loop'].split(', ', 1)[-1]}), {comp['loop'].split(',')[0]} loop incl. gradient "
            f"accumulation and the optimizer step on the communication thread, all concurrently, started together; "
            f"the sum of the replicas' own samples/s): {comp['samples_per_s']:.1f} samples/s = {ranks} (highest of "
            f"runs: {each}), one micro-batch {1000 * comp['t_mb_mean']:.1f} ms"
        )
    return (  # results saved before that bound existed
        f"- compute-only (plain forward + backward loop, no engine, no communication; global samples over the "
        f"slowest rank's time): {comp['samples_per_s']:.1f} samples/s (best of runs: {each}), one micro-batch "
        f"{1000 * comp['t_mb_mean']:.1f} ms"
    )


def failed_section(results: dict) -> list:
    failed = results.get("failed") or []
    if not failed:
        return []
    lines = [
        "## Runs that could not run",
        "",
        "The benchmark exited non-zero: the rows below are missing from the tables (or have fewer seeds).",
        "",
        "| contender | where | why |",
        "|---|---|---|",
    ]
    lines += [f"| {f['label']} | {f['where']} | {f['why']} |" for f in failed]
    return lines + [""]


def throughput_table(results: dict, an: dict, title: str = "## Throughput per link rate") -> list:
    head = (
        "| link | T_comm/round s | contender | s/step | s/step median | s/step p20 | samples/s | samples/s median "
        "| x ZeRO-1 steps/s | x ZeRO-1 steps/s median | x ZeRO-1 samples/s | x sync steps/s | vs compute-only "
        "| T_compute/round s | T_round s | overlap eff | peak RSS MiB per rank | load | samples/s of each seed |"
    )
    lines = [
        title,
        "",
        "Best-of-seeds figures (median over the seeds beside); overlap efficiency and T_round from the best run.",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for rate, rows in an["tables"].items():
        comm = results["rates"][rate]["comm"]["t_comm_s"]
        for label, r in rows.items():
            eff = r["overlap_eff"]
            lines.append(
                f"| {rate} | {comm:.3f} | {label} | {r['step_time_s']:.3f} | {r['median_step_time_s']:.3f} "
                f"| {r['step_time_p20_s']:.3f} | {r['samples_per_s']:.1f} | {r['median_samples_per_s']:.1f} "
                f"| {fmt_opt(r['x_steps'], '.2f')} | {fmt_opt(r['x_steps_median'], '.2f')} | {fmt_opt(r['x_samples'], '.2f')} "
                f"| {fmt_opt(r['x_sync_steps'], '.2f')} | {100 * r['vs_compute_only']:.0f}% "
                f"| {r['t_compute_round_s']:.3f} | {r['t_round_s']:.3f} | {fmt_opt(eff and 100 * eff, '.0f')}% "
                f"| {_mem(r['peak_mem_mib'])} | {r['load'][0]:.1f}/{r['load'][1]:.1f} "
                f"| {', '.join(f'{x:.1f}' for x in r['repeats'])} |"
            )
    return lines + [""]


def wire_table(an: dict, title: str = "## Bytes on the wire per optimizer step") -> list:
    """Bytes each rank sent per optimizer step (counted at its torch.distributed calls,
    ``acco_ds.cli.wire_bytes``), per rate and contender, and over ZeRO-1's; nothing for results that
    predate the count."""
    rows = [
        (rate, label, r["wire_bytes_per_step"], (rs.get("zero1") or {}).get("wire_bytes_per_step"))
        for rate, rs in an["tables"].items()
        for label, r in rs.items()
        if r.get("wire_bytes_per_step") is not None
    ]
    if not rows:
        return []
    lines = [
        title,
        "",
        "What one rank sends while it trains, counted at each torch.distributed call as a ring moves it "
        "(all-reduce 2 (W-1)/W of the tensor, reduce-scatter and all-gather (W-1)/W, point-to-point the "
        "tensor), over its optimizer steps; mean over the ranks of the best-of-seeds run.",
        "",
        "| link | contender | MB per step per rank | x ZeRO-1's |",
        "|---|---|---|---|",
    ]
    for rate, label, b, base in rows:
        lines.append(f"| {rate} | {label} | {b / 1e6:.3f} | {fmt_opt(base and b / base, '.3f')} |")
    return lines + [""]


def job_phase_table(an: dict, title: str = "## Where acco_ds's rounds spend their time") -> list:
    """The jobs' phases per round (``stats()['job_*_s']``, acco_ds.core.phase_clock), per rate and acco_ds
    contender, beside the round's time; nothing for results that predate the figures."""
    rows = [
        (rate, label, r["job_phase_ms_per_round"], r["t_round_s"])
        for rate, rs in an["tables"].items()
        for label, r in rs.items()
        if r.get("job_phase_ms_per_round")
    ]
    if not rows:
        return []
    lines = [
        title,
        "",
        "Per round of the best-of-seeds run, mean over the ranks, in ms, measured where the job runs (the CPU "
        "ranks' communication thread): the gradient exchange; the counts, the g~ and the norm's all-reduce (a "
        "rank waits there for the slowest one's exchange); the AdamW step (with the quantized parameter "
        "difference); the parameter all-gather. T_round: the step time over the rounds per step.",
        "",
        "| link | contender | reduce-scatter | norm | step | all-gather | job | T_round |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for rate, label, ph, t_round in rows:
        cells = " | ".join(f"{ms:.1f}" for ms in ph.values())  # analysis.JOB_PHASES' order, the header's
        lines.append(f"| {rate} | {label} | {cells} | {sum(ph.values()):.1f} | {1e3 * t_round:.1f} |")
    return lines + [""]


def _x(s) -> str:
    return sd.fmt(s, ".2f", suffix="x")


def steps_table(
    an: dict, title: str = "## Framing (a): same optimizer steps, time to ZeRO-1's final loss"
) -> list:
    curve = any(
        (r["paired"].get("x_time_to_val_curve") or {}).get("n")
        for rows in an["tables"].values()
        for r in rows.values()
    )
    lines = [
        title,
        "",
        "Per seed against ZeRO-1's run of the same seed, then mean [min, max] over the seeds. Time to ZeRO-1's "
        "final loss: trailing-average training loss, over ZeRO-1's own time to it; validation: the run's final val "
        "loss at or below ZeRO-1's, its training time over ZeRO-1's (an upper bound: validation is measured at the "
        "end only; `not reached`: a seed whose final val loss stayed above ZeRO-1's)."
        + (
            " Time to ZeRO-1's final val loss: the first crossing of the run's validation curve (evaluated every "
            "`--eval-every` steps, their time left out), interpolated, over ZeRO-1's own time to it."
            if curve
            else ""
        ),
        "",
        "| link | contender | seeds | samples | val loss | val gap vs ZeRO-1 (paired) | loss @ ZeRO-1 samples "
        "| time to ZeRO-1 train loss (x ZeRO-1) | val <= ZeRO-1's by the end (x ZeRO-1, upper bound) |"
        + (" time to ZeRO-1's final val loss (x ZeRO-1) |" if curve else ""),
        "|---|---|---|---|---|---|---|---|---|" + ("---|" if curve else ""),
    ]
    for rate, rows in an["tables"].items():
        for label, r in rows.items():
            p = r["paired"]
            lines.append(
                f"| {rate} | {label} | {len(r['seeds'])} | {r['samples']} | {sd.fmt(r['val'])} | {pct(p.get('val_gap'))} "
                f"| {sd.fmt(p.get('loss_at_base_samples'))} | {_x(p.get('x_time_to_base_loss'))} "
                f"| {_x(p.get('x_time_to_base_val'))} |"
                + (f" {_x(p.get('x_time_to_val_curve'))} |" if curve else "")
            )
    return lines + [""]


def budget_table(an: dict, title: str = "## Framing (b): the same token budget for every contender") -> list:
    lines = [
        title,
        "",
        "Wall-clock = training time from the start barrier to the last commit; x ZeRO-1 = ZeRO-1's wall-clock over "
        "the contender's, per seed; val loss on the committed parameters at the budget.",
        "",
        "| link | budget samples | contender | run | optimizer steps | samples | wall-clock s | x ZeRO-1 wall-clock "
        "| val loss | val gap vs ZeRO-1 (paired) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rate, b in an.get("budget", {}).items():
        for label, r in b["rows"].items():
            lines.append(
                f"| {rate} | {b['samples']} | {label} | {r['how']} | {sd.fmt(r['steps'], '.0f')} "
                f"| {sd.fmt(r['samples'], '.0f')} | {sd.fmt(r['wall_s'], '.1f')} | {_x(r['x_wall'])} "
                f"| {sd.fmt(r['val'])} | {pct(r['val_gap'])} |"
            )
    return lines + [""]


def goals_table(goals: list, title: str) -> list:
    """The goals, each with its figure and verdict under both framings."""
    lines = [
        title,
        "",
        "| goal | (a) same optimizer steps / time to ZeRO-1's loss | verdict (a) | (b) same token budget | verdict (b) |",
        "|---|---|---|---|---|",
    ]
    for g in goals:
        if isinstance(g, dict):
            lines.append(f"| {g['goal']} | {g['a'][0]} | {g['a'][1]} | {g['b'][0]} | {g['b'][1]} |")
        else:  # results rendered before the framings: (goal, measured, verdict)
            lines.append(f"| {g[0]} | {g[1]} | {g[2]} | - | - |")
    return lines


def run_lines(results: dict) -> list:
    """The context lines every run report opens with: date, machine, versions, command."""
    m = results["machine"]
    return [
        f"- date: {m['date']}; machine: {m['cpu']}, {m['cores']} cores, GPU: {m['gpu'] or 'none'}",
        f"- versions: python {m['python']}, torch {m['torch']}, deepspeed {m['deepspeed']}, acco_ds {m['acco_ds']}",
        f"- command: `{results['command']}`",
    ]


def load_line(setup: dict) -> str:
    return (
        "- `load` = 1-min load average before/after a run (the machine is shared); ranks at niceness "
        f"{setup.get('nice', 0)}"
    )


def ds_settings_lines(results: dict) -> list:
    """The DeepSpeed baselines' ZeRO settings, as the run printed them."""
    lines = ["- DeepSpeed baselines' settings (printed as run):"]
    return lines + [f"  - {label}: `{json.dumps(zero)}`" for label, zero in results["ds_settings"].items()]


def notes_section(results: dict) -> list:
    """The ``## Notes`` section of ``results["notes"]`` (none without notes)."""
    notes = results.get("notes")
    if not notes:
        return []
    return ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
