"""Markdown of bench_e2e's analysis: context (machine, versions, settings), goals under both
framings, the per-rate throughput table, the loss tables of both framings (seed-paired), the
heterogeneous table. ``render(results, analysis)`` returns the whole document; the table
functions are reused by bench_topology."""

from __future__ import annotations

import json

import e2e_seeds as sd


def _f(x, fmt: str, none: str = "-") -> str:
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


def _context(results: dict, an: dict) -> list:
    m, s = results["machine"], results["setup"]
    comp = an["compute_only"]
    lines = [
        "# End-to-end on a bandwidth-limited link (benchmarks/bench_e2e.py)",
        "",
        f"- date: {m['date']}; machine: {m['cpu']}, {m['cores']} cores, GPU: {m['gpu'] or 'none'}",
        f"- versions: python {m['python']}, torch {m['torch']}, deepspeed {m['deepspeed']}, acco_ds {m['acco_ds']}",
        f"- command: `{results['command']}`",
        f"- model: {s['n_params'] / 1e6:.2f}M-parameter GPT ({json.dumps(s['model'])}), dtype "
        f"{'bf16' if s['bf16'] else 'fp32'} parameters and communication for every contender",
        f"- batch: {s['world']} ranks x {s['threads']} thread(s) each, micro-batch {s['micro_batch']} x "
        f"{s['model']['context']} bytes, gradient accumulation {s['grad_accum']} (acco: 2 rounds of "
        f"{s['grad_accum'] // 2}), {s['steps']} optimizer steps, first {s['warmup']} steps are warm-up; LR: linear "
        f"warm-up over {s['warmup_lr_steps']} steps, cosine to the last step",
        seeds_line(results, an),
        budget_line(results, an),
        f"- `load` = 1-min load average before/after a run (the machine is shared); ranks at niceness {s.get('nice', 0)}",
        "- `x ZeRO-1` mixes ACCO's overlap with acco_ds's own communication; `x sync` (acco_ds `sync`: the same "
        "communication, no overlap) is the overlap alone",
        "- link: all ranks in one network namespace, loopback limited by `tc qdisc add dev lo root tbf rate "
        "<rate> burst 256kb latency 200ms`",
        bound_line(comp),
        "- DeepSpeed baselines' settings (printed as run):",
    ]
    for label, zero in results["ds_settings"].items():
        lines.append(f"  - {label}: `{json.dumps(zero)}`")
    lines.append("")
    return lines


def bound_line(comp: dict) -> str:
    each = ", ".join(f"{x:.1f}" for x in comp["each_samples_per_s"])
    if comp.get("loop"):  # the bound of e2e_runs.run_compute_only
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
                f"| {_f(r['x_steps'], '.2f')} | {_f(r['x_steps_median'], '.2f')} | {_f(r['x_samples'], '.2f')} "
                f"| {_f(r['x_sync_steps'], '.2f')} | {100 * r['vs_compute_only']:.0f}% "
                f"| {r['t_compute_round_s']:.3f} | {r['t_round_s']:.3f} | {_f(eff and 100 * eff, '.0f')}% "
                f"| {_mem(r['peak_mem_mib'])} | {r['load'][0]:.1f}/{r['load'][1]:.1f} "
                f"| {', '.join(f'{x:.1f}' for x in r['repeats'])} |"
            )
    return lines + [""]


def _x(s) -> str:
    return sd.fmt(s, ".2f", suffix="x")


def _pct(s) -> str:
    return sd.fmt(s, ".2f", 100, "%", sign=True)


def steps_table(
    an: dict, title: str = "## Framing (a): same optimizer steps, time to ZeRO-1's final loss"
) -> list:
    lines = [
        title,
        "",
        "Per seed against ZeRO-1's run of the same seed, then mean [min, max] over the seeds. Time to ZeRO-1's "
        "final loss: trailing-average training loss, over ZeRO-1's own time to it; validation: the run's final val "
        "loss at or below ZeRO-1's, its training time over ZeRO-1's (an upper bound: validation is measured at the "
        "end only; `not reached`: a seed whose final val loss stayed above ZeRO-1's).",
        "",
        "| link | contender | seeds | samples | val loss | val gap vs ZeRO-1 (paired) | loss @ ZeRO-1 samples "
        "| time to ZeRO-1 train loss (x ZeRO-1) | val <= ZeRO-1's by the end (x ZeRO-1, upper bound) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for rate, rows in an["tables"].items():
        for label, r in rows.items():
            p = r["paired"]
            lines.append(
                f"| {rate} | {label} | {len(r['seeds'])} | {r['samples']} | {sd.fmt(r['val'])} | {_pct(p.get('val_gap'))} "
                f"| {sd.fmt(p.get('loss_at_base_samples'))} | {_x(p.get('x_time_to_base_loss'))} "
                f"| {_x(p.get('x_time_to_base_val'))} |"
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
                f"| {sd.fmt(r['val'])} | {_pct(r['val_gap'])} |"
            )
    return lines + [""]


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
        val = sd.fmt(r["val"]) if r.get("val") else _f(r["val_loss"], ".4f")
        lines.append(
            f"| {label} | {' / '.join(f'{x:.1f}' for x in r['rank_samples_per_s'])} | {r['samples_per_s']:.1f} "
            f"| {_f(r['x_samples'], '.2f')} | {steps_s:.2f} | {_f(r.get('x_steps'), '.2f')} "
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


def goals_table(goals: list, title: str = "## Goals (issue 5), under both framings") -> list:
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


def _goals(an: dict) -> list:
    lines = goals_table(an["goals"])
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
    parts += throughput_table(results, an) + steps_table(an) + budget_table(an) + _hetero(an)
    notes = results.get("notes")
    if notes:
        parts += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(parts)
