"""The Markdown of a plan validation (``render(v)``, ``v`` the validation's JSON): calibration,
step times of the e2e and topology sweeps against the predictions, heterogeneous ranks, memory,
the paper's ratios, notes; a function of the JSON alone, so ``--from-json`` re-renders it."""

from __future__ import annotations

TOLERANCE = 0.15  # a prediction is within when its step time is within +-15% of the measured one


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def _ok(x) -> str:
    return "n/a" if x is None else ("yes" if abs(x) <= TOLERANCE else "**no**")


def _bw(b) -> str:
    if b is None:
        return "-"
    if b >= 1e9:
        return f"{b * 8 / 1e9:.3g} Gbit/s ({b / 1e9:.3g} GB/s)"
    return f"{b * 8 / 1e9:.3g} Gbit/s" if b * 8 >= 1e9 else f"{b * 8 / 1e6:.3g} Mbit/s"


def table(head: str, rows) -> list:
    """The Markdown lines of a table: the header row ``head`` (``| a | b |``), its rule, then one line per
    list of cells in ``rows``."""
    return [head, "|" + "---|" * (head.count("|") - 1)] + ["| " + " | ".join(cells) + " |" for cells in rows]


def step_table(rows: list) -> list:
    """The Markdown lines of a step-time comparison (rows of ``step_row``)."""

    def cells(r):
        mbs = ""
        if "adaptive" in r["contender"]:
            mbs = f"{r['measured_mb_per_step']:.2f} / {r['predicted_mb_per_step']:g}"
        return [
            r["rate"],
            r["contender"],
            f"{r['measured_step_s']:.3f}",
            f"{r['predicted_step_s']:.3f}",
            _pct(r["step_err"]),
            _ok(r["step_err"]),
            f"{r['measured_samples_per_s']:.1f}",
            f"{r['predicted_samples_per_s']:.1f}",
            _pct(r["samples_err"]),
            mbs,
        ]

    return table(
        "| link | contender | measured s/step | predicted | error | within | measured samples/s | predicted "
        "| error | micro-batches/step/rank measured / predicted |",
        map(cells, rows),
    )


def compression_section(c: dict | None) -> list:
    """The compressed contenders' step times (bench_e2e ``--contenders compression``) against acco-plan's int8 rows,
    calibrated by that sweep's own compute-only bound and comm-only probe (uncompressed: the plan scales the
    bytes)."""
    L = ["", "## Step time, compressed rounds (bench_e2e, every exchange int8)", ""]
    if not c:
        return L + ["No bench_e2e results of the compressed contenders were found: not compared."]
    rows = c["rows"]
    within = [r for r in rows if r["step_err"] is not None and abs(r["step_err"]) <= TOLERANCE]
    cal = ", ".join(f"{x['rate']} {_bw(x['bw'])}" for x in c["calibration"])
    L += [
        f"Sweep of {c['source']['date']} (`{c['source']['command']}`). Calibration from the same sweep: one "
        f"micro-batch {1e3 * c['t_mb_s']:.1f} ms (compute-only bound), bus bandwidth per rank {cal} (comm-only "
        f"probe, fp32); acco-plan's int8 rows send n (1 + 4/B) bytes per exchange and add the quantize passes. "
        f"Contenders it has no row for (int4, the ablations) are not predicted. {len(within)} of {len(rows)} "
        f"within +-{100 * TOLERANCE:.0f}%.",
        "",
    ]
    return L + step_table(rows)


def render(v: dict) -> str:
    e, meta = v["e2e"], v["meta"]
    rows = e["rows"]
    within = [r for r in rows if r["step_err"] is not None and abs(r["step_err"]) <= TOLERANCE]
    misses = [r for r in rows if r["step_err"] is not None and abs(r["step_err"]) > TOLERANCE]
    L = [
        "# acco-plan against measured runs (python -m benchmarks.plan_validation)",
        "",
        f"- date: {meta['date']}; command: `{meta['command']}`",
        f"- bench_e2e sweep validated against: {e['source']['date']} (`{e['source']['command']}`), acco_ds "
        f"{e['source']['acco_ds']}; its compute-only reference: {e['source']['bound']}",
        f"- model: docs/PLAN.md; tolerance: step time within +-{100 * TOLERANCE:.0f}% of measured",
        "",
        "## Calibration (measured separately from the runs predicted)",
        "",
        f"- one micro-batch: {1e3 * e['t_mb_s']:.1f} ms, bench_e2e's compute-only run (ranks: "
        + ", ".join(f"{1e3 * t:.1f}" for t in e["t_mb_ranks_s"])
        + " ms); {} ranks x 1 thread, micro-batch {}, GAS {}, {:,} parameters, fp32".format(
            e["world"], e["setup"]["micro_batch"], e["setup"]["grad_accum"], e["setup"]["n_params"]
        ),
        f"- optimizer memory bandwidth: {meta['hbm_source']}",
        "- accelerator cpu: DeepSpeed's overlap_comm overlaps nothing (its CPU streams are no-ops); "
        "acco_ds overlaps with its communication thread",
        "",
        "| link | acco_ds reduce-scatter probe s | bus bandwidth per rank (probe) | tc rate / W | from the all-gather probe |",
        "|---|---|---|---|---|",
    ]
    for c in e["calibration"]:
        L.append(
            f"| {c['rate']} | {c['probe_rs_s']:.4f} | {_bw(c['bw'])} | {_bw(c['bw_from_tc_rate'])} "
            f"| {_bw(c['bw_from_ag'])} |"
        )
    L += [
        "",
        f"## Step time, bench_e2e ({len(within)} of {len(within) + len(misses)} within +-"
        f"{100 * TOLERANCE:.0f}%)",
        "",
    ]
    L += step_table(rows)
    if misses:
        L += ["", "Misses (measured minus predicted):", ""]
        for r in misses:
            d = r["measured_step_s"] - r["predicted_step_s"]
            L.append(f"- {r['rate']} {r['contender']}: {1e3 * d:+.0f} ms per step")
    if e["hetero"]:
        L += [
            "",
            f"## Heterogeneous ranks (bench_e2e, {e['hetero_rate']}, one rank 2x slower)",
            "",
        ]
        L += table(
            "| contender | measured s/step | predicted | error | within | how |",
            (
                [
                    r["contender"],
                    f"{r['measured_step_s']:.3f}",
                    "-" if r["predicted_step_s"] is None else f"{r['predicted_step_s']:.3f}",
                    _pct(r["step_err"]),
                    _ok(r["step_err"]),
                    r["why"],
                ]
                for r in e["hetero"]
            ),
        )
    L += compression_section(v.get("e2e_compression"))
    t = v.get("topology")
    L += ["", "## Step time, bench_topology (two nodes, tensor parallelism inside a node)", ""]
    if not t:
        L.append("No bench_topology results were found: not compared.")
    else:
        tw = [r for r in t["rows"] if r["step_err"] is not None and abs(r["step_err"]) <= TOLERANCE]
        L += [
            f"bench_topology sweep of {t['source']['date']} (`{t['source']['command']}`): 2 nodes x TP "
            f"{t['tp']}, data-parallel world 2 across the link; {t['slice_params']:,} parameters per rank "
            f"(of {t['model_params']:,}). Calibration: one micro-batch {1e3 * t['t_mb_s']:.1f} ms (the "
            "compute-only bound, tensor-parallel all-reduces included; replicas "
            + ", ".join(f"{1e3 * x:.1f}" for x in t["t_mb_ranks_s"])
            + " ms); the node's bandwidth from the comm-only probe (both data-parallel groups at once): "
            + ", ".join(
                f"{c['rate']} {_bw(c['node_bw'])} (tc rate {_bw(c['bw_from_tc_rate'])})"
                for c in t["calibration"]
            )
            + f". {len(tw)} of {len(t['rows'])} within +-{100 * TOLERANCE:.0f}%.",
            "",
        ]
        L += step_table(t["rows"])
    mem = v.get("memory")
    L += ["", "## Memory per rank, bench_memory", ""]
    if not mem:
        L.append("No bench_memory results were found: not compared.")
    else:
        L += [
            f"bench_memory sweep of {mem['source']['date']}. Predicted: acco-plan's model states and "
            "communication buffers at the peak (CPU: with the bytes glibc's heap keeps). Measured: the rank's "
            "peak RSS minus its RSS before the model was built, which also holds activations, the model as "
            "transformers built it before it was flattened, DeepSpeed's and torch's working memory.",
            "",
        ]
        L += table(
            "| case | contender | measured MiB | predicted MiB | error | measured - predicted MiB |",
            (
                [
                    r["case"],
                    r["contender"],
                    f"{r['measured_bytes'] / 2**20:.0f}",
                    f"{r['predicted_bytes'] / 2**20:.0f}",
                    _pct(r["err"]),
                    f"{r['unexplained_mib']:.0f}",
                ]
                for r in mem["rows"]
            ),
        )
    L += [
        "",
        "## The paper's reported ratios (hardware not measured here: inputs assumed)",
        "",
        "The figures are those the paper reports (arXiv 2406.02613); the paper's setups (batch, "
        "sequence length, links, implementation) are not available in this environment, so each row states "
        "what was assumed. 'implied' is the bandwidth (of the link named) at which the model gives the "
        "reported ratio, everything else as assumed; none means no bandwidth does.",
        "",
    ]
    L += table(
        "| case | reported | ratio | framing | mode | predicted ratio | comm/compute | best ratio the model allows "
        "| implied bandwidth | assumed |",
        (
            [
                p["case"],
                p["reported"],
                f"{p['ratio']:.2f}",
                p["framing"],
                p["mode"],
                f"{p['predicted_ratio']:.2f}",
                f"{p['comm_compute_ratio']:.3f}",
                f"{p['best_ratio']:.2f}",
                "none" if p["implied_bw"] is None else f"{p['vary']} {_bw(p['implied_bw'])}",
                p["assumed"],
            ]
            for p in v["paper"]
        ),
    )
    if v.get("notes"):
        L += ["", "## Notes", ""] + [f"- {n}" for n in v["notes"]]
    return "\n".join(L) + "\n"
