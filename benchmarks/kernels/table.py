"""Markdown of the kernel benchmark's raw results. ``render(res)`` is a pure function of the raw JSON
that ``python -m benchmarks.kernels`` writes beside the table (no torch, no clock, no machine query),
so ``python -m benchmarks.kernels --from-json`` re-renders the same table anywhere (results written before
the quantize rows existed render as they did)."""

from __future__ import annotations

# Bytes per parameter each kernel must read + write (BENCHMARKS.md section 1). Every write of the ACCO
# kernels and the fp32 anchors but the bf16 output lands on a line the kernel has just read (in place), and
# the CPU kernels write a large output with non-temporal stores (no write-allocate read): these counts are
# the ACCO kernels' traffic to memory, not an undercount of it.
BYTES = {
    "commit": 28,
    "peek": 16,
    "acc_bf16_fp32": 2 + 4 + 4,
    "acc_bf16_bf16": 2 + 2 + 2,
    "commit_fp16": 28,
    "peek_fp16": 16,
    "acc_fp16_fp32": 2 + 4 + 4,
    "acc_fp16_fp16": 2 + 2 + 2,
    "read_floor": 14,
    "anchor": 28,
}
SUM_RANKS = 4
"""Ranks whose chunks the dequantize-sum rows add up (an owner's sum at W = 4)."""
QUANT_BLOCK = 256
"""Block size of the quantize rows (compression.block_size's default); one fp32 scale per block."""
_SCALE = 4 / QUANT_BLOCK
# quantize with residual: read x, read + write the residual, write q and the scales; dequantize-add: read q and
# the scales, read + write the fp32 accumulator. The torch reference is credited with the same bytes.
QUANT_BYTES = {
    "qres_fp32": 4 + 4 + 4 + 1 + _SCALE,
    "qres_bf16": 2 + 2 + 2 + 1 + _SCALE,
    "qres_fp16": 2 + 2 + 2 + 1 + _SCALE,
    "deq_add": 1 + _SCALE + 4 + 4,
    # the owner's sum of SUM_RANKS chunks in one pass: read every rank's q and scales, write the bf16 gradient once
    "deq_sum": SUM_RANKS * (1 + _SCALE) + 2,
    # the parameter path (bf16 parameters): the difference quantized (read new and base, write q and the scales),
    # then applied (read q, the scales and the base, write the parameters)
    "qdiff": 2 + 2 + 1 + _SCALE,
    "add_deq": 1 + _SCALE + 2 + 2,
}
FOLD_BYTES = {
    # a parameter's last bf16 gradient folded into the buffer and quantized with the residual, one pass: read the
    # buffer and the gradient, read + write the residual, write q and the scales (the buffer is not written); the
    # two passes it replaces (accumulate, then quantize_with_residual) are credited with the same bytes
    "fold_qres_bf16": 2 + 2 + 2 + 2 + 1 + _SCALE,
    "fold_qres_fp32": 4 + 2 + 4 + 4 + 1 + _SCALE,
    "fold_qres_fp16": 2 + 2 + 2 + 2 + 1 + _SCALE,  # fp16 gradient, buffer and residual
}
QUANT_REF = {key: f"{key}_ref" for key in QUANT_BYTES}
"""The torch reference row of each compiled quantize row (its speed-up is measured against it)."""
QUANT_ANCHORS = {key: [ref] for key, ref in QUANT_REF.items()}
QUANT_ANCHORS["deq_sum"] = ["deq_sum_unfused", "deq_sum_ref"]
QUANT_ANCHORS["qdiff"] = ["qdiff_unfused", "qdiff_ref"]
QUANT_ANCHORS["add_deq"] = ["add_deq_unfused", "add_deq_ref"]
QUANT_ANCHORS["commit_diff"] = ["commit_diff_composed"]
QUANT_ANCHORS["fold_qres_bf16"] = ["fold_qres_bf16_unfused"]
QUANT_ANCHORS["fold_qres_fp32"] = ["fold_qres_fp32_unfused"]
QUANT_ANCHORS["fold_qres_fp16"] = ["fold_qres_fp16_unfused", "fold_qres_bf16"]
QUANT_ANCHORS["qres_fp16"] = ["qres_fp16_ref", "qres_bf16"]
QUANT_ANCHORS["sum_commit"] = ["sum_commit_composed"]
QUANT_ANCHORS["sum_commit_w2"] = ["sum_commit_w2_composed"]
QUANT_ANCHORS["sum_commit_w3"] = ["sum_commit_w3_composed"]
COMMIT_DIFF_BYTES = 28 + 2 + 1 + _SCALE
"""A compressed all-gather's local work in one pass: the commit's 28 B, the base read (the bf16 output lines,
in place), q and the scales written; its composed row is credited with the same bytes."""
"""The rows each compiled quantize row's speed is compared with (anchor time / its time)."""
BYTES.update(QUANT_BYTES)
BYTES.update({ref: QUANT_BYTES[key] for key, ref in QUANT_REF.items()})
for _key in ("deq_sum", "qdiff", "add_deq"):  # credited with the fused pass's bytes: its effective GB/s
    BYTES[f"{_key}_unfused"] = QUANT_BYTES[_key]
BYTES["commit_diff"] = BYTES["commit_diff_composed"] = COMMIT_DIFF_BYTES
for _key, _bytes in FOLD_BYTES.items():
    BYTES[_key] = BYTES[f"{_key}_unfused"] = _bytes


def sum_commit_bytes(ranks: int) -> float:
    """An owner's compressed commit from ``ranks`` ranks' chunks: the norm's and the commit's passes each read every
    rank's q and scales, the commit reads and writes the fp32 state (24 B) and writes the bf16 parameters; its
    composed row (dequantize_sum, the norm, the commit: ranks * (1 + scale) + 2 + 2 + 28 B) is credited with the same
    bytes."""
    return 2 * ranks * (1 + _SCALE) + 24 + 2


SUM_COMMIT_BYTES = sum_commit_bytes(SUM_RANKS)
BYTES["sum_commit"] = BYTES["sum_commit_composed"] = SUM_COMMIT_BYTES
BYTES["sum_commit_w2"] = BYTES["sum_commit_w2_composed"] = sum_commit_bytes(2)
BYTES["sum_commit_w3"] = BYTES["sum_commit_w3_composed"] = sum_commit_bytes(3)
LABEL = {
    "commit": "acco commit (bf16 g in, bf16 p out)",
    "peek": "acco peek (bf16 g in, bf16 p out)",
    "acc_bf16_fp32": "acco accumulate bf16 -> fp32 buf",
    "acc_bf16_bf16": "acco accumulate bf16 -> bf16 buf",
    "commit_fp16": "acco commit (fp16 g in, fp16 p out)",
    "peek_fp16": "acco peek (fp16 g in, fp16 p out)",
    "acc_fp16_fp32": "acco accumulate fp16 -> fp32 buf",
    "acc_fp16_fp16": "acco accumulate fp16 -> fp16 buf",
    "read_floor": "limit: the reads of a peek alone (torch sums)",
    "torch_fused": "torch AdamW fused (fp32)",
    "torch_fused_cast": "torch AdamW fused + bf16 copy",
    "torch_foreach": "torch AdamW foreach (fp32)",
    "deepspeed": "DeepSpeedCPUAdam (fp32)",
    "deepspeed_gpu": "DeepSpeed FusedAdam (fp32)",
    "clone_step_restore": "peek by clone/step/restore",
    "qres_fp32": "acco quantize_with_residual fp32 x, fp32 residual",
    "qres_bf16": "acco quantize_with_residual bf16 x, bf16 residual",
    "qres_fp16": "acco quantize_with_residual fp16 x, fp16 residual",
    "qres_fp16_ref": "torch reference quantize_with_residual fp16",
    "deq_add": "acco dequantize_add into fp32",
    "qres_fp32_ref": "torch reference quantize_with_residual fp32",
    "qres_bf16_ref": "torch reference quantize_with_residual bf16",
    "deq_add_ref": "torch reference dequantize_add",
    "deq_sum": f"acco dequantize_sum of {SUM_RANKS} ranks' chunks into bf16",
    "deq_sum_unfused": f"acco unfused: dequantize + {SUM_RANKS - 1} dequantize_add + bf16 copy",
    "deq_sum_ref": f"torch reference dequantize_sum of {SUM_RANKS}",
    "qdiff": "acco quantize_difference bf16 new - bf16 base",
    "qdiff_unfused": "acco unfused: fp32 difference, then quantize",
    "qdiff_ref": "torch reference quantize_difference",
    "add_deq": "acco add_dequantized bf16 base + deq",
    "add_deq_unfused": "acco unfused: fp32 base, dequantize_add, bf16 copy",
    "add_deq_ref": "torch reference add_dequantized",
    "fold_qres_bf16": "acco fold_quantize: last bf16 grad + bf16 buffer + bf16 residual -> int8, one pass",
    "fold_qres_bf16_unfused": "acco two passes: accumulate into the bf16 buffer, quantize_with_residual",
    "fold_qres_fp32": "acco fold_quantize: last bf16 grad + fp32 buffer + fp32 residual -> int8, one pass",
    "fold_qres_fp32_unfused": "acco two passes: accumulate into the fp32 buffer, quantize_with_residual",
    "fold_qres_fp16": "acco fold_quantize: last fp16 grad + fp16 buffer + fp16 residual -> int8, one pass",
    "fold_qres_fp16_unfused": "acco two passes: accumulate into the fp16 buffer, quantize_with_residual",
    "commit_diff": "acco commit + quantized parameter difference, one pass (bf16 g, bf16 p in place)",
    "commit_diff_composed": "acco composed: copy of the base, commit, quantize_difference, add_dequantized",
    "sum_commit": f"acco norm + commit read from {SUM_RANKS} ranks' int8 chunks (bf16 g, bf16 p)",
    "sum_commit_composed": "acco composed: dequantize_sum into bf16, norm, commit",
    "sum_commit_w2": "acco norm + commit read from 2 ranks' int8 chunks (bf16 g, bf16 p)",
    "sum_commit_w2_composed": "acco composed, 2 ranks: dequantize_sum into bf16, norm, commit",
    "sum_commit_w3": "acco norm + commit read from 3 ranks' int8 chunks (bf16 g, bf16 p)",
    "sum_commit_w3_composed": "acco composed, 3 ranks: dequantize_sum into bf16, norm, commit",
}
OWN = ("commit", "peek", "acc_bf16_fp32", "acc_bf16_bf16", "read_floor")
HOST = ("commit", "peek", "deepspeed")
"""The host rows (CPU): ACCO's commit and peek and DeepSpeedCPUAdam's step, timed in their own interleaved rounds at
every size (results written before them have none: their entries hold no ``interleaved`` groups)."""
HOST_ANCHOR = "deepspeed"
FP16_OWN = {
    "commit_fp16": "commit",
    "peek_fp16": "peek",
    "acc_fp16_fp32": "acc_bf16_fp32",
    "acc_fp16_fp16": "acc_bf16_bf16",
}
"""The fp16 rows (results measured before them have none) and the bf16 row each is compared with."""
QUANT_ROWS = (
    "qres_fp32",
    "qres_bf16",
    "qres_fp16",
    "deq_add",
    "deq_sum",
    "deq_sum_unfused",
    "qdiff",
    "qdiff_unfused",
    "add_deq",
    "add_deq_unfused",
    "fold_qres_bf16",
    "fold_qres_bf16_unfused",
    "fold_qres_fp32",
    "fold_qres_fp32_unfused",
    "fold_qres_fp16",
    "fold_qres_fp16_unfused",
    "commit_diff",
    "commit_diff_composed",
    "sum_commit_w2",
    "sum_commit_w2_composed",
    "sum_commit_w3",
    "sum_commit_w3_composed",
    "sum_commit",
    "sum_commit_composed",
    "qres_fp32_ref",
    "qres_bf16_ref",
    "qres_fp16_ref",
    "deq_add_ref",
    "deq_sum_ref",
    "qdiff_ref",
    "add_deq_ref",
)

# stream probes: (description, bytes per fp32 element counted: reads + writes of the buffers)
STREAM = {
    "update": ("in-place update a += 1 (read + write a)", 8),
    "axpy": ("in-place a += 0.5 b (read a, b; write a)", 12),
    "copy": ("copy a <- b (read b, write a)", 8),
    "triad": ("a <- b + 0.5 c (read b, c; write a)", 12),
}


def stream_best(stream: dict) -> tuple:
    """(probe name, GB/s) of the fastest stream probe: the reference of the % column."""
    name = max(stream["probes"], key=lambda k: stream["probes"][k]["gbs"])
    return name, stream["probes"][name]["gbs"]


def rows(res: dict) -> list:
    """[(params, label, median s, GB/s, {anchor: anchor time / this time})] in table order."""
    out = []
    for entry in res["results"]:
        n, t = entry["params"], entry["median_s"]
        anchors = {k: v for k, v in t.items() if k not in BYTES}
        for key in (k for k in OWN if k in t):  # a host-only run holds the host rows alone
            sec, vs = t[key], {}
            if key in ("commit", "peek"):
                vs = {a: anchors[a] / sec for a in anchors if a != "clone_step_restore" or key == "peek"}
                if key == "peek":
                    vs["commit"] = t["commit"] / sec
            out.append((n, LABEL[key], sec, BYTES[key] * n / sec / 1e9, vs))
        for key, bf16 in FP16_OWN.items():
            if key in t:
                sec = t[key]
                out.append((n, LABEL[key], sec, BYTES[key] * n / sec / 1e9, {bf16: t[bf16] / sec}))
        for key, sec in anchors.items():
            out.append((n, LABEL[key], sec, BYTES["anchor"] * n / sec / 1e9, {}))
        out += _quant_rows(n, t)
    return out


def _quant_rows(n: int, t: dict) -> list:
    """The quantize rows of one size (none in results measured without them); a compiled row's ratio is the
    torch reference's time over its own."""
    out = []
    for key in (k for k in QUANT_ROWS if k in t):
        vs = {ref: t[ref] / t[key] for ref in QUANT_ANCHORS.get(key, []) if ref in t}
        out.append((n, LABEL[key], t[key], BYTES[key] * n / t[key] / 1e9, vs))
    return out


def _measured(res: dict, *keys: str) -> bool:
    """Whether any size of the results holds a row of ``keys``."""
    return any(k in entry["median_s"] for entry in res["results"] for k in keys)


def paired_ratios(entry: dict, anchor: str, key: str) -> list | None:
    """``anchor``'s time over ``key``'s, round by round, where the two were timed in the same interleaved rounds
    (one call each per round): load from other processes falls on both sides of each ratio alike. None where they
    were not (one after the other, or either missing)."""
    if not any(anchor in group and key in group for group in entry.get("interleaved", [])):
        return None
    a, b = entry["times_s"][anchor], entry["times_s"][key]
    return [x / y for x, y in zip(a, b)]


def quantile(xs: list, q: float) -> float:
    """The ``q`` quantile of ``xs`` (linear interpolation between the closest ranks; q = 0.5: the median)."""
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def ratio_spread(ratios: list) -> tuple:
    """(median, 25th percentile, 75th percentile) of per-round ratios."""
    return quantile(ratios, 0.5), quantile(ratios, 0.25), quantile(ratios, 0.75)


def host_summary(res: dict) -> list:
    """Per size with host rows: {"params", "ms": {key: median ms}, "gbs": {key: GB/s}, "copy_pct": {key: % of the
    copy probe}, "vs": {key: (median, p25, p75) of the anchor's time over key's per round, or None}, "rounds"}."""
    copy = res["stream"]["probes"]["copy"]["gbs"]
    out = []
    for entry in res["results"]:
        t = entry["median_s"]
        if not any(set(HOST[:2]) <= set(group) for group in entry.get("interleaved", [])):
            continue
        own = [k for k in HOST[:2] if k in t]
        row = {"params": entry["params"], "rounds": len(entry["times_s"][own[0]]), "ms": {}, "gbs": {},
               "copy_pct": {}, "vs": {}}  # fmt: skip
        for key in HOST:
            if key in t:
                row["ms"][key] = t[key] * 1e3
        for key in own:
            gbs = BYTES[key] * entry["params"] / t[key] / 1e9
            row["gbs"][key], row["copy_pct"][key] = gbs, 100 * gbs / copy
            ratios = paired_ratios(entry, HOST_ANCHOR, key)
            row["vs"][key] = ratio_spread(ratios) if ratios else None
        out.append(row)
    return out


def _host_section(res: dict) -> list:
    """The host section's lines (none in results without host rounds)."""
    rows_ = host_summary(res)
    if not rows_:
        return []
    copy = res["stream"]["probes"]["copy"]["gbs"]
    anchor = LABEL[HOST_ANCHOR].split(" (")[0]
    measured = any(r["vs"].get("commit") for r in rows_)

    def ratio(r, key):
        v = r["vs"].get(key)
        return f"{v[0]:.2f}x [{v[1]:.2f}x, {v[2]:.2f}x]" if v else "not measured"

    def ms(r, key):
        return f"{r['ms'][key]:.3f}" if key in r["ms"] else "-"

    def bw(r, key):
        return f"{r['gbs'][key]:.1f} GB/s, {r['copy_pct'][key]:.0f}%" if key in r["gbs"] else "-"

    def goal(r):
        v = r["vs"].get("commit")
        if not v:
            return "not measured"
        return ("met" if v[0] >= 1 else "NOT met") + (" (the spread spans 1.00x)" if v[1] < 1 < v[2] else "")

    threads = res["threads"]
    lines = [
        "",
        f"## Host rows: ACCO's AdamW against {anchor}",
        "",
        f"ACCO's commit and peek (bf16 gradient in, bf16 parameters out) and {anchor}'s step (fp32), the same "
        f"number of parameters on the same {threads} thread(s), timed in their own rounds, interleaved: one call each "
        f"per round, in a rotating order, {rows_[0]['rounds']} rounds per size. vs {anchor}: its time over ACCO's in "
        "the same round, the median over the rounds [25th, 75th percentile] (above 1.00x ACCO is faster); the goal "
        f"column: ACCO's commit at least {anchor}'s throughput, by that median. GB/s: the commit's 28 B or the peek's "
        f"16 B per parameter over the median time, and that as a share of this run's copy probe ({copy:.1f} GB/s, "
        "read + written; it understates the bandwidth, as the notes above say).",
        "",
        f"| params | acco commit ms | acco peek ms | {anchor} ms | commit vs {anchor} | peek vs {anchor} | "
        f"commit >= {anchor} | commit GB/s, % of copy | peek GB/s, % of copy |",
        "|---:|---:|---:|---:|---|---|---|---:|---:|",
    ]
    for r in rows_:
        lines.append(
            f"| {r['params']:,} | {ms(r, 'commit')} | {ms(r, 'peek')} | {ms(r, HOST_ANCHOR)} | {ratio(r, 'commit')} "
            f"| {ratio(r, 'peek')} | {goal(r)} | {bw(r, 'commit')} | {bw(r, 'peek')} |"
        )
    if not measured:
        lines += [
            "",
            f"{anchor} was not measured in this run (--no-deepspeed, or it could not run: the notes).",
        ]
    return lines


def _has_quant(res: dict) -> bool:
    return _measured(res, *QUANT_ROWS)


def _stream_line(res: dict) -> str:
    s = res["stream"]
    best, gbs = stream_best(s)
    mib = s["elems"] * 4 / 2**20
    l3 = res.get("l3_bytes", 0) / 2**20
    cache = f", L3 cache {l3:.0f} MiB" if l3 else ""
    if l3 and mib < 4 * l3:
        cache += ": below 4x the L3, this measures the caches rather than the memory"
    probes = "; ".join(f"{STREAM[k][0]}: {p['gbs']:.1f} GB/s" for k, p in s["probes"].items())
    return (
        f"- Streaming bandwidth in this run, fp32 buffers of {s['elems']:,} elements ({mib:.0f} MiB each{cache}), "
        f"median of {s['reps']} timed calls, bytes counted as read + written, as for the kernels: {probes}. "
        f"The % column divides by the best, {gbs:.1f} GB/s ({best}). A copy or triad into a separate buffer "
        "moves more than it is credited with on a CPU that reads each destination line before writing it "
        "(write-allocate: 12 B per copied element, 16 per triad element), so they understate the bandwidth; "
        "the in-place probes write only lines they have just read, as the kernels do (and the CPU kernels write "
        "their bf16 output with non-temporal stores, which skip that read), so a kernel above 100% truly moved "
        "its bytes faster than the best probe (possible on one core, likely because a core's bandwidth grows "
        "with the misses it keeps in flight, and a commit walks 8 streams where a probe walks 2 or 3)."
    )


def _quant_bytes_line(res: dict) -> list:
    """The bullet on the quantize rows' bytes, only where the results hold them."""
    if not _has_quant(res):
        return []
    return [
        f"- Quantize rows (blocks of {QUANT_BLOCK}, one fp32 scale per block: {_SCALE:g} B/param): "
        f"quantize_with_residual fp32 {QUANT_BYTES['qres_fp32']:g} B/param (read x and the residual, write the "
        f"residual, q and the scales), bf16 {QUANT_BYTES['qres_bf16']:g}; dequantize_add "
        f"{QUANT_BYTES['deq_add']:g} (read q and the scales, read + write the fp32 sum). The torch reference "
        "(acco_ds.ops.quantize's *_ref functions, the same bits) is credited with the same bytes; a compiled row's "
        "ratio is the reference's time over its own. q and the scales are new tensors every call (as in a round)."
        + (
            f" dequantize_sum: the owner's sum of {SUM_RANKS} ranks' chunks, {QUANT_BYTES['deq_sum']:g} B/param "
            "(read each rank's q and scales, write the bf16 sum once); the unfused row (what the round did before: "
            "an fp32 total written and re-read per rank, then cast) is credited with the same bytes."
            if _measured(res, "deq_sum")
            else ""
        )
        + (
            f" The parameter path, bf16: quantize_difference {QUANT_BYTES['qdiff']:g} B/param (read the new parameters "
            f"and the base, write q and the scales), add_dequantized {QUANT_BYTES['add_deq']:g} (read q, the scales and "
            "the base, write the parameters); their unfused rows (fp32 temporaries, as the round did before) are "
            "credited with the same bytes."
            if _measured(res, "qdiff")
            else ""
        )
        + (
            f" The commit with its quantized parameter difference, {COMMIT_DIFF_BYTES:g} B/param (the "
            "commit's 28, the base read, q and the scales written; the base is the output buffer itself, as the "
            "round's model buffer): one pass (acco_ds.ops.adamw_difference: C++ on the CPU, Triton on the GPU) against the "
            "composition the round "
            "ran before (a copy of the base, the commit, quantize_difference, add_dequantized), credited with the "
            "same bytes."
            if _measured(res, "commit_diff")
            else ""
        )
        + (
            f" The owner's compressed commit from {SUM_RANKS} ranks' chunks, {SUM_COMMIT_BYTES:g} B/param"
            + (
                f" (from 2 ranks' {sum_commit_bytes(2):g}, from 3 ranks' {sum_commit_bytes(3):g})"
                if _measured(res, "sum_commit_w3")
                else f" (from 2 ranks' {sum_commit_bytes(2):g})"
                if _measured(res, "sum_commit_w2")
                else ""
            )
            + ": the norm's and the commit's passes each read the chunks (acco_ds.ops.quantized_sum_step: C++ on the "
            "CPU, Triton on the GPU), against the composition the round ran before (dequantize_sum into the bf16 "
            "gradient slice, its sum of squares, the commit), credited with the same bytes."
            if _measured(res, "sum_commit")
            else ""
        )
        + (
            f" The fused round end, per element of a parameter's last bf16 gradient: fold_quantize "
            f"{FOLD_BYTES['fold_qres_bf16']:g} B/param into a bf16 buffer with a bf16 residual, "
            f"{FOLD_BYTES['fold_qres_fp32']:g} into fp32 ones (read the buffer and the gradient, read + write the "
            "residual, write q and the scales; the buffer is not written), against the two passes it replaces "
            "(the accumulation into the buffer, then quantize_with_residual of it into preallocated q and scales), "
            "credited with the same bytes."
            if _measured(res, "fold_qres_bf16")
            else ""
        )
    ]


def render(res: dict) -> str:
    """The whole Markdown document for the raw results ``res`` (the benchmark's JSON)."""
    _, best = stream_best(res["stream"])
    head = (
        "| params | kernel | median ms | GB/s | % of stream BW | speed vs anchors (anchor time / this time) |"
    )
    lines = [head, "|---:|---|---:|---:|---:|---|"]
    for n, label, sec, gbs, vs in rows(res):
        ratio = ", ".join(f"{LABEL.get(k, k).split(' (')[0]} {r:.2f}x" for k, r in vs.items())
        lines.append(f"| {n:,} | {label} | {sec * 1e3:.3f} | {gbs:.1f} | {100 * gbs / best:.0f}% | {ratio} |")
    dev = res["device"]
    threads = f"{res['threads']} thread(s)" if dev == "cpu" else "GPU"
    isa = f"; CPU kernel variant: {res['cpu_isa']}" if dev == "cpu" else ""
    md = [
        f"# Kernel microbenchmarks ({dev})",
        "",
        f"- Date: {res['date']}",
        f"- Machine: {res['machine']}; load average (1 min) at start / end: {res['load'][0]:.1f} / "
        f"{res['load'][1]:.1f} (a shared machine: other processes compete for the memory bandwidth)",
        f"- Versions: {res['versions']}{isa}",
        f"- Command: `{res['command']}` ({threads} for every contender)",
        _stream_line(res),
        "- Bytes per parameter: commit 28 (read p, m, v fp32 + bf16 g; write p, m, v + bf16 out), peek 16 "
        "(read the same, write bf16 out), accumulate grad + buffer read + buffer write; anchors are credited with "
        "the 28 B of an fp32 AdamW step (what the work needs, not what they move: the bf16 copy and clone/restore "
        "traffic is not counted).",
        *_quant_bytes_line(res),
        *(
            [
                "- fp16 rows (fp16 gradients, outputs, buffers and residuals where the bf16 rows have bf16): the bytes "
                "of their bf16 twins; each one's ratio is its bf16 twin's time over its own (the cost of the fp16 "
                "rounding against bf16's)."
            ]
            if _measured(res, *FP16_OWN, "qres_fp16", "fold_qres_fp16")
            else []
        ),
        f"- Clock: {res['clock']}. Median of {res['reps']} timed calls after 2 warm-up calls; below 50M parameters "
        "(and on the GPU) the contenders are interleaved call by call (so load from other processes falls on all "
        "alike, and no contender keeps its data in the caches from one call to the next); at 50M and above, one "
        "contender at a time with a third of the calls (memory)."
        + (
            f" The host rows ({', '.join(LABEL[k].split(' (')[0] for k in HOST)}) are timed apart, interleaved at "
            f"every size over {res['host_reps']} rounds (the host section below); their ratios to the other rows "
            "compare medians taken at different times."
            if res.get("host_reps")
            else ""
        )
        + " Raw per-call times: the JSON beside this file "
        "(`python -m benchmarks.kernels --from-json <it>` re-renders this table).",
        "",
        "\n".join(lines),
        *_host_section(res),
    ]
    if res["notes"]:
        md += ["", "Notes:", *[f"- {x}" for x in res["notes"]]]
    return "\n".join(md) + "\n"
