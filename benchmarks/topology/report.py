"""Analysis, table and plot of the topology benchmark, on top of the shared analysis.

``analyse(results)`` is ``benchmarks.harness.analysis.analyse`` (throughput rows, seed-paired loss
rows, both framings; the data-parallel world is world / tp) with the topology's goals and the
memory per rank: ACCO's (and sync's) peak RSS per rank minus ZeRO-1 + AutoTP's on the same rank
and seed, against the memory bound for the rank's slice, 1.10 x (D + D/W) bytes per parameter of
the slice (D: parameter dtype size, W: data-parallel ranks). ``render`` returns the Markdown;
``plot(results, analysis, path)`` writes the figure.
"""

from __future__ import annotations

import json

from benchmarks.e2e.goals import compression_goals
from benchmarks.harness import analysis, link, tables
from benchmarks.harness import seeds as sd
from benchmarks.harness.goals import adaptive_rate_goal, ahead_goal, fmt_x, goal, ran_goal, val_goal, verdict
from benchmarks.harness.plots import pyplot, throughput_axes

MIB = 2**20
BOUND_FACTOR = 1.10  # the memory bound: ACCO's extra over ZeRO-1 <= 1.10 x (D + D/W) per parameter
PLAIN = ("zero1-overlap", "sync", "dpu", "acco", "acco-adaptive")
COMPRESSED = ("sync-int8", "acco-int8", "acco-adaptive-int8", "acco-adaptive-int8-peek-int4")
"""Compressed contenders: their error-feedback residual may cost one more buffer in the communication dtype (D per
parameter of the slice), so their bound is BOUND_FACTOR x (2 D + D/W)."""


def memory_bound_mib(results: dict, compressed: bool = False) -> float:
    s = results["setup"]
    d = 2 if s["bf16"] else 4
    w = s["world"] // s["tp"]
    return BOUND_FACTOR * (d + d / w + (d if compressed else 0)) * s["n_params"] / MIB


def memory(results: dict) -> dict:
    """Per rate and contender: the extra peak RSS per rank over ZeRO-1's (same rank, same seed)."""
    bound = memory_bound_mib(results)
    out = {"bound_mib": bound, "compressed_bound_mib": memory_bound_mib(results, compressed=True), "rows": {}}
    for rate, block in results["rates"].items():
        base = analysis.seed_runs(block, "zero1")
        for label in PLAIN + COMPRESSED:
            mine = analysis.seed_runs(block, label)
            pairs = sd.paired(
                mine, base, lambda a, b: [x - y for x, y in zip(a["peak_mem_mib"], b["peak_mem_mib"])]
            )
            if not pairs:
                continue
            extras = [x for per_rank in pairs.values() for x in per_rank]
            out["rows"].setdefault(rate, {})[label] = {
                "extra_mib": extras,
                "max_extra_mib": max(extras),
                "peak_mib": [max(r["peak_mem_mib"]) for r in mine.values()],
                "zero1_peak_mib": [max(r["peak_mem_mib"]) for r in base.values()],
                "within": max(extras) <= (out["compressed_bound_mib"] if label in COMPRESSED else bound),
            }
    return out


def goals(an: dict, results: dict) -> list:
    """The goals on the two-node topology, each under both framings where they differ."""
    g = []
    tables, budget = an["tables"], an.get("budget", {})
    rate = an.get("balanced_rate")
    if rate and "acco" in tables[rate] and "zero1" in tables[rate]:
        row = tables[rate]["acco"]
        b = (budget.get(rate) or {}).get("rows", {})
        wall = b.get("acco", {}).get("x_wall")
        ov = tables[rate].get("zero1-overlap")
        ahead = f"; ZeRO-1 overlap_comm: {ov['x_steps']:.2f}x" if ov else ""
        g.append(
            goal(
                f"acco fixed >= 1.3x ZeRO-1 + AutoTP steps/s ({rate}: comm closest to compute)",
                (
                    f"{row['x_steps']:.2f}x best-of seeds, {row['x_steps_median']:.2f}x median{ahead}",
                    verdict(row["x_steps"] >= 1.3),
                ),
                (
                    f"wall-clock to the budget, ZeRO-1's / acco's (paired): {fmt_x(wall)}",
                    sd.verdict_at_least(wall, 1.3),
                ),
            )
        )
        if ov:
            ow = b.get("zero1-overlap", {}).get("x_wall")
            g.append(ahead_goal("ZeRO-1 + AutoTP with overlap_comm", rate, row, ov, wall, ow))
        eff = row["overlap_eff"]
        g.append(
            goal(
                f"acco fixed overlap efficiency >= 85% ({rate})",
                (
                    f"{100 * eff:.0f}% (T_round {row['t_round_s']:.3f} s; max(T_compute {row['t_compute_round_s']:.3f}, "
                    f"T_comm {row['t_comm_round_s']:.3f}))",
                    verdict(eff >= 0.85),
                ),  # fmt: skip
                ("a per-round figure: the same runs in both framings", verdict(eff >= 0.85)),
            )
        )
    g += val_goal(tables, "acco", "acco fixed val loss within 2% of ZeRO-1 + AutoTP's at equal samples")
    g += adaptive_rate_goal(tables, budget)
    mem = an["memory"]
    extras = [
        (r, lbl, row["max_extra_mib"])
        for r, rows in mem["rows"].items()
        for lbl, row in rows.items()
        if lbl.startswith("acco") and lbl not in COMPRESSED
    ]
    packed = [
        (r, lbl, row["max_extra_mib"])
        for r, rows in mem["rows"].items()
        for lbl, row in rows.items()
        if lbl in COMPRESSED
    ]
    if packed:
        r, lbl, worst = max(packed, key=lambda x: x[2])
        text = (
            f"largest extra peak RSS per rank over ZeRO-1 + AutoTP (same rank and seed): {worst:+.1f} MiB ({lbl}, {r}); "
            f"bound {mem['compressed_bound_mib']:.1f} MiB (ACCO's plus one buffer in the communication dtype: the "
            "error-feedback residual)"
        )
        v = verdict(worst <= mem["compressed_bound_mib"])
        g.append(
            goal(
                "memory per rank at TP 2: compressed contenders within ACCO's bound + one residual",
                (text, v),
                ("the same runs", v),
            )
        )
    if extras:
        r, lbl, worst = max(extras, key=lambda x: x[2])
        text = (
            f"largest extra peak RSS per rank over ZeRO-1 + AutoTP (same rank and seed): {worst:+.1f} MiB ({lbl}, {r}); "
            f"bound {mem['bound_mib']:.1f} MiB for a slice of {results['setup']['n_params']:,} parameters"
        )
        v = verdict(worst <= mem["bound_mib"])
        g.append(
            goal(
                "memory per rank at TP 2: ACCO's extra over ZeRO-1 + AutoTP within the memory bound",
                (text, v),
                ("the same runs", v),
            )
        )
    return g + compression_goals(an) + ran_goal(results)


def _runs(block: dict):
    """Every run summary of a rate's block: its ``runs`` (one per contender) and its ``seeds`` (a list per
    contender)."""
    yield from (run for run in block.get("runs", {}).values() if run)
    for runs in block.get("seeds", {}).values():
        yield from runs


def _counted_internode(results: dict) -> bool:
    return any(
        run.get("wire_bytes_internode_per_step") is not None
        for block in results["rates"].values()
        for run in _runs(block)
    )


def _internode_bytes(results: dict) -> dict:
    """``results`` with each run's ``wire_bytes_per_step`` made the bytes of the calls that span the two nodes
    (``wire_bytes_internode_per_step``: the data-parallel exchanges; the tensor-parallel collectives inside a
    node, which no contender compresses, left out), where the run counted them; runs that did not keep theirs."""
    if not _counted_internode(results):
        return results
    out = json.loads(json.dumps(results))
    for block in out["rates"].values():
        for run in _runs(block):
            if run.get("wire_bytes_internode_per_step") is not None:
                run["wire_bytes_per_step"] = run["wire_bytes_internode_per_step"]
    return out


def analyse(results: dict) -> dict:
    """The shared analysis, the memory per rank, and the topology's goals (set last: they read the
    memory; their key keeps its place before it)."""
    an = analysis.analyse(_internode_bytes(results), lambda an, results: [])
    an["memory"] = memory(results)
    an["goals"] = goals(an, results)
    return an


def _context(results: dict, an: dict) -> list:
    s, net = results["setup"], results["network"]
    dp = s["world"] // s["tp"]
    return [
        "# Two-node topology: tensor parallelism inside a node, ACCO across (python -m benchmarks.topology)",
        "",
        *tables.run_lines(results),
        f"- network: {net['description']}",
        f"- launch: {net['launch']}",
        f"- layout: {s['world']} ranks = {dp} nodes x {s['tp']} ranks; DeepSpeed AutoTP {s['tp']} inside a node "
        f"(consecutive ranks), data parallelism {dp} across the nodes",
        f"- model: {json.dumps(s['model'])}, {results['model_params']:,} parameters, {s['n_params']:,} per rank "
        f"(its tensor-parallel slice, counted on the AutoTP engine); dtype {'bf16' if s['bf16'] else 'fp32'} "
        "parameters and communication for every contender",
        f"- batch: micro-batch {s['micro_batch']} x {s['model']['context']} bytes per replica, gradient accumulation "
        f"{s['grad_accum']} (acco: 2 rounds of {s['grad_accum'] // 2}), {s['steps']} optimizer steps, first "
        f"{s['warmup']} steps are warm-up; {s['threads']} thread per rank; LR: linear warm-up over "
        f"{s['warmup_lr_steps']} steps, cosine to the last step",
        tables.seeds_line(results, an),
        tables.budget_line(results, an),
        tables.load_line(s),
        tables.bound_line(an["compute_only"]),
        *tables.ds_settings_lines(results),
        *_bytes_lines(results, an),
        "",
    ]


def _bytes_lines(results: dict, an: dict) -> list:
    """The bytes per step of each contender across the nodes (the goals' figure), where the runs counted them."""
    if not _counted_internode(results):
        return []
    text = ", ".join(
        f"{label} {row['wire_bytes_per_step'] / 1e6:.3f} MB ({rate})"
        for rate, rows in an["tables"].items()
        for label, row in rows.items()
        if row.get("wire_bytes_per_step")
    )
    return [
        "- bytes on the wire (the goals' figure): what a rank sends in the calls that span the two nodes (every "
        "byte of a data-parallel or world-wide call; the tensor-parallel collectives inside a node, which no "
        f"contender compresses, left out), per optimizer step, mean over the ranks of each row's run: {text}"
    ]


def _memory_table(an: dict) -> list:
    mem = an["memory"]
    lines = [
        "## Memory per rank",
        "",
        f"Peak RSS per rank minus ZeRO-1 + AutoTP's on the same rank and seed; bound {mem['bound_mib']:.1f} MiB "
        "(1.10 x (D + D/W) bytes per parameter of the rank's slice).",
        "",
        "| link | contender | peak MiB (max rank, per seed) | ZeRO-1 peak MiB | extra MiB per rank (every rank and seed) | within the bound |",
        "|---|---|---|---|---|---|",
    ]
    cells = [(rate, label, r) for rate, rows in mem["rows"].items() for label, r in rows.items()]
    lines += [
        f"| {rate} | {label} | {', '.join(f'{x:.0f}' for x in r['peak_mib'])} "
        f"| {', '.join(f'{x:.0f}' for x in r['zero1_peak_mib'])} "
        f"| {', '.join(f'{x:+.1f}' for x in r['extra_mib'])} | {'yes' if r['within'] else 'NO'} |"
        for rate, label, r in cells
    ]
    return lines + [""]


def render(results: dict, an: dict) -> str:
    parts = _context(results, an) + tables.failed_section(results)
    parts += tables.goals_table(an["goals"], "## Goals, under both framings")
    rate = an.get("balanced_rate")
    if rate:
        parts += [
            "",
            f"Rate where one round's communication is closest to one acco round's compute: {rate}.",
            "",
        ]
    parts += tables.throughput_table(results, an, "## Throughput per inter-node rate")
    parts += tables.steps_table(an) + tables.budget_table(an) + _memory_table(an)
    return "\n".join(parts + tables.notes_section(results))


def plot(results: dict, an: dict, path) -> None:
    """Samples/s and steps/s x ZeRO-1 per inter-node rate, and the validation loss at equal samples
    (mean, min-max over the seeds; adaptive ACCO at the token budget)."""
    plt = pyplot()
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(17, 4.6))
    throughput_axes(a, b, results, an)
    rates = sorted(an["tables"], key=link.rate_mbit)
    labels = analysis.ordered({lbl for t in an["tables"].values() for lbl in t})
    width = 0.8 / max(1, len(labels))
    for k, lbl in enumerate(labels):
        xs, ys, lo, hi = [], [], [], []
        for i, r in enumerate(rates):
            row = (an.get("budget", {}).get(r) or {}).get("rows", {}).get(lbl)
            v = row["val"] if row else None
            if v:
                xs.append(i + (k - (len(labels) - 1) / 2) * width)
                ys.append(v["mean"])
                lo.append(v["mean"] - v["min"])
                hi.append(v["max"] - v["mean"])
        if xs:
            c.errorbar(xs, ys, yerr=[lo, hi], fmt="o", capsize=3, label=lbl)
    c.set_xticks(range(len(rates)), rates)
    c.set_xlabel("inter-node link rate")
    c.set_title("val loss at the same samples (mean, min-max over seeds)")
    c.grid(alpha=0.3)
    c.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
