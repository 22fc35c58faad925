"""Markdown of bench_e2e's analysis: context (machine, versions, settings), per-rate table,
heterogeneous table, goals. ``render(results, analysis)`` returns the whole document."""

from __future__ import annotations

import json


def _f(x, fmt: str, none: str = "-") -> str:
    return none if x is None else format(x, fmt)


def _mem(m: list) -> str:
    return "/".join(f"{v:.0f}" for v in m)


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
        f"{s['grad_accum'] // 2}), {s['steps']} optimizer steps, first {s['warmup']} steps are warm-up; seed {s['seed']}",
        f"- each contender ran {results.get('repeats', 1)} time(s), interleaved with the others; the run with the "
        "highest samples/s is reported (best-of-N: a best case, not a typical one - see the last column for the "
        "others; the machine is shared; `load` = 1-min load average before/after it); "
        f"ranks at niceness {s.get('nice', 0)}",
        "- `x ZeRO-1` mixes ACCO's overlap with acco_ds's own communication; `x sync` (acco_ds `sync`: the same "
        "communication, no overlap) is the overlap alone",
        "- link: all ranks in one network namespace, loopback limited by `tc qdisc add dev lo root tbf rate "
        "<rate> burst 256kb latency 200ms`",
        _bound_line(comp),
        "- DeepSpeed baselines' settings (printed as run):",
    ]
    for label, zero in results["ds_settings"].items():
        lines.append(f"  - {label}: `{json.dumps(zero)}`")
    lines.append("")
    return lines


def _bound_line(comp: dict) -> str:
    each = ", ".join(f"{x:.1f}" for x in comp["each_samples_per_s"])
    if comp.get("loop"):  # the bound of e2e_runs.run_compute_only
        ranks = " + ".join(f"{x:.1f}" for x in comp["rank_samples_per_s"])
        return (
            f"- compute-only bound (the contenders' training loop with the communication removed: every rank a "
            f"one-rank acco_ds job, {comp['loop'].split(',')[0]} loop incl. gradient accumulation and the optimizer "
            f"step on the communication thread, all ranks concurrently, started together; the sum of the ranks' own "
            f"samples/s): {comp['samples_per_s']:.1f} samples/s = {ranks} (highest of runs: {each}), one "
            f"micro-batch {1000 * comp['t_mb_mean']:.1f} ms"
        )
    return (  # results saved before that bound existed
        f"- compute-only (plain forward + backward loop, no engine, no communication; global samples over the "
        f"slowest rank's time): {comp['samples_per_s']:.1f} samples/s (best of runs: {each}), one micro-batch "
        f"{1000 * comp['t_mb_mean']:.1f} ms"
    )


def _failed(results: dict) -> list:
    failed = results.get("failed") or []
    if not failed:
        return []
    lines = [
        "## Runs that could not run",
        "",
        "The benchmark exited non-zero: the rows below are missing from the tables (or have fewer repeats).",
        "",
        "| contender | where | why |",
        "|---|---|---|",
    ]
    lines += [f"| {f['label']} | {f['where']} | {f['why']} |" for f in failed]
    return lines + [""]


def _rate_table(results: dict, an: dict) -> list:
    head = (
        "| link | T_comm/round s | contender | s/step | s/step p20 | samples/s | x ZeRO-1 steps/s | x ZeRO-1 steps/s p20 "
        "| x ZeRO-1 samples/s | x sync steps/s "
        "| vs compute-only | T_compute/round s | T_round s | overlap eff | loss @ ZeRO-1 samples | val loss (samples) "
        "| time to ZeRO-1 loss s (x) | peak RSS MiB per rank | load | samples/s of each repeat |"
    )
    lines = ["## Per link rate", "", head, "|" + "---|" * (head.count("|") - 1)]
    for rate, rows in an["tables"].items():
        comm = results["rates"][rate]["comm"]["t_comm_s"]
        for label, r in rows.items():
            ttl = r["time_to_base_loss_s"]
            ttl_s = "not reached" if ttl is None else f"{ttl:.1f} ({_f(r['x_time_to_base_loss'], '.2f')}x)"
            lines.append(
                f"| {rate} | {comm:.3f} | {label} | {r['step_time_s']:.3f} | {r['step_time_p20_s']:.3f} "
                f"| {r['samples_per_s']:.1f} | {_f(r['x_steps'], '.2f')} | {_f(r['x_steps_p20'], '.2f')} "
                f"| {_f(r['x_samples'], '.2f')} | {_f(r['x_sync_steps'], '.2f')} "
                f"| {100 * r['vs_compute_only']:.0f}% "
                f"| {r['t_compute_round_s']:.3f} | {r['t_round_s']:.3f} | {_f(r['overlap_eff'] and 100 * r['overlap_eff'], '.0f')}% "
                f"| {_f(r['loss_at_base_samples'], '.4f')} | {_f(r['val_loss'], '.4f')} ({r['samples']}) | {ttl_s} "
                f"| {_mem(r['peak_mem_mib'])} | {r['load'][0]:.1f}/{r['load'][1]:.1f} "
                f"| {', '.join(f'{x:.1f}' for x in r['repeats'])} |"
            )
    lines.append("")
    return lines


def _hetero(an: dict) -> list:
    h = an.get("hetero")
    if not h:
        return []
    lines = [
        f"## Heterogeneous workers (link {h['rate']}, rank {h['slow_rank']} slowed {h['slow_factor']:g}x by extra "
        "compute per micro-batch)",
        "",
        "| contender | samples/s per rank | overall samples/s | x ZeRO-1 samples/s | optimizer steps/s "
        "| x ZeRO-1 steps/s | micro-batches per rank | s/step | val loss (same steps) | extra s per micro-batch |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, r in h["rows"].items():
        steps_s = r.get("steps_per_s", 1.0 / r["step_time_s"])
        lines.append(
            f"| {label} | {' / '.join(f'{x:.1f}' for x in r['rank_samples_per_s'])} | {r['samples_per_s']:.1f} "
            f"| {_f(r['x_samples'], '.2f')} | {steps_s:.2f} | {_f(r.get('x_steps'), '.2f')} "
            f"| {' / '.join(str(x) for x in r['rank_micro_batches'])} "
            f"| {r['step_time_s']:.3f} | {_f(r['val_loss'], '.4f')} | {' / '.join(f'{x:.3f}' for x in r['slow_extra_s'])} |"
        )
    lines += [
        "",
        "Samples/s counts every micro-batch computed; adaptive ACCO puts the fast rank's extra micro-batches "
        "into larger optimizer steps, so compare the steps/s and the validation loss after the same number of "
        "optimizer steps beside it.",
    ]
    lines.append("")
    return lines


def _goals(an: dict) -> list:
    lines = ["## Goals (issue 5)", "", "| goal | measured | verdict |", "|---|---|---|"]
    lines += [f"| {g} | {m} | {v} |" for g, m, v in an["goals"]]
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
    parts = _context(results, an) + _failed(results) + _goals(an) + _rate_table(results, an) + _hetero(an)
    notes = results.get("notes")
    if notes:
        parts += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(parts)
