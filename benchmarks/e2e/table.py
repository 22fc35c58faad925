"""The e2e benchmark's Markdown report: ``render(results, analysis)`` returns the whole document
(context, runs that could not run, goals under both framings, the per-rate throughput table, the
loss tables of both framings, the heterogeneous table, notes), built from
``benchmarks.harness.tables``."""

from __future__ import annotations

import json

from benchmarks.harness import seeds as sd
from benchmarks.harness.tables import (
    bound_line,
    budget_line,
    budget_table,
    ds_settings_lines,
    failed_section,
    fmt_opt,
    goals_table,
    job_phase_table,
    load_line,
    notes_section,
    run_lines,
    seeds_line,
    steps_table,
    throughput_table,
    wire_table,
)


def _context(results: dict, an: dict) -> list:
    s = results["setup"]
    return [
        "# End-to-end on a bandwidth-limited link (python -m benchmarks.e2e)",
        "",
        *run_lines(results),
        f"- model: {s['n_params'] / 1e6:.2f}M-parameter GPT ({json.dumps(s['model'])}), dtype "
        f"{'bf16' if s['bf16'] else 'fp32'} parameters and communication for every contender",
        f"- batch: {s['world']} ranks x {s['threads']} thread(s) each, micro-batch {s['micro_batch']} x "
        f"{s['model']['context']} bytes, gradient accumulation {s['grad_accum']} (acco: 2 rounds of "
        f"{s['grad_accum'] // 2}), {s['steps']} optimizer steps, first {s['warmup']} steps are warm-up; LR: linear "
        f"warm-up over {s['warmup_lr_steps']} steps, cosine to the last step",
        seeds_line(results, an),
        budget_line(results, an),
        load_line(s),
        "- `x ZeRO-1` mixes ACCO's overlap with acco_ds's own communication; `x sync` (acco_ds `sync`: the same "
        "communication, no overlap) is the overlap alone",
        "- link: all ranks in one network namespace, loopback limited by `tc qdisc add dev lo root tbf rate "
        "<rate> burst 256kb latency 200ms`",
        bound_line(an["compute_only"]),
        *ds_settings_lines(results),
        "",
    ]


def _hetero(an: dict) -> list:
    h = an.get("hetero")
    if not h:
        return []
    lines = [
        f"## Heterogeneous workers (link {h['rate']}, rank {h['slow_rank']} slowed {h['slow_factor']:g}x by extra "
        "compute per micro-batch)",
        "",
        "| contender | samples/s per rank | overall samples/s | x ZeRO-1 samples/s | optimizer steps/s "
        "| x ZeRO-1 steps/s | micro-batches per rank | s/step | val loss (same steps, over seeds) "
        "| extra s per micro-batch | samples/s of each seed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, r in h["rows"].items():
        steps_s = r.get("steps_per_s", 1.0 / r["step_time_s"])
        val = sd.fmt(r["val"]) if r.get("val") else fmt_opt(r["val_loss"], ".4f")
        lines.append(
            f"| {label} | {' / '.join(f'{x:.1f}' for x in r['rank_samples_per_s'])} | {r['samples_per_s']:.1f} "
            f"| {fmt_opt(r['x_samples'], '.2f')} | {steps_s:.2f} | {fmt_opt(r.get('x_steps'), '.2f')} "
            f"| {' / '.join(str(x) for x in r['rank_micro_batches'])} "
            f"| {r['step_time_s']:.3f} | {val} | {' / '.join(f'{x:.3f}' for x in r['slow_extra_s'])} "
            f"| {', '.join(f'{x:.1f}' for x in r.get('repeats', []))} |"
        )
    lines += [
        "",
        "Samples/s counts every micro-batch computed; adaptive ACCO puts the fast rank's extra micro-batches "
        "into larger optimizer steps, so compare the steps/s and the validation loss after the same number of "
        "optimizer steps beside it (best-of-seeds throughput; val loss over the seeds).",
    ]
    lines.append("")
    return lines


def _goals(an: dict) -> list:
    lines = goals_table(an["goals"], "## Goals, under both framings")
    rate = an.get("balanced_rate")
    if rate:
        lines += [
            "",
            f"comm~compute rate (T_comm closest to one acco round's compute): {rate}; "
            f"comm-dominated rate: {an.get('slowest_rate')}.",
        ]
    lines.append("")
    return lines


def render(results: dict, an: dict) -> str:
    parts = _context(results, an) + failed_section(results) + _goals(an)
    parts += throughput_table(results, an) + wire_table(an) + job_phase_table(an)
    parts += steps_table(an) + budget_table(an) + _hetero(an)
    return "\n".join(parts + notes_section(results))
