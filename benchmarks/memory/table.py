"""Markdown of the memory benchmark's results, computed from the raw JSON alone (so ``--from-json``
re-renders the same document).

``analyse(results)`` returns one row per (case, contender) with the measured figures, the analytic
ones (``acco_ds.plan.memory_model``) and the extras over ZeRO-1, plus the memory goals; ``render(results)``
the whole document: context, goals, summary table, full table, analytic buffers, skipped/failed
runs, notes. Definitions:

- baseline: the rank's RSS after importing torch, DeepSpeed, acco_ds and the model's code and
  initialising the process group, before the model exists (on GPU: allocated bytes then);
- peak: the rank's highest RSS over the whole run (``VmHWM``; on GPU ``max_memory_allocated``); the
  row shows the rank with the highest peak, with its own baseline;
- over baseline B/param: (peak - baseline) / parameters: the model, every buffer, activations and
  allocator slack;
- extra over ZeRO-1 B/param: (peak - ZeRO-1's peak) / parameters, both measured in this sweep on
  the same case (analytic: the difference of the analytic peaks);
- held by the code: ``GroupBuffers.held_bytes()`` of the ACCO pipeline in the run, per parameter.

fp16 cases (D = 2, as bf16) add two goals: acco's extra over ZeRO-1 fp16 at most one buffer in the model's dtype
(D B/param), and, where the same sweep ran the bf16 twin (same model and W), acco fp16 holding exactly the bytes
acco bf16 holds; and a section with every fp16 run's skipped steps and final loss scale per rank.
"""

from __future__ import annotations

from acco_ds.plan import memory_model as mm

MIB = 2**20
ORDER = mm.CONTENDERS + mm.COMPRESSED


def _measured(run: dict | None) -> bool:
    return bool(run) and "peak" in run


def analyse(results: dict) -> dict:
    cpu = results["settings"].get("device", "cpu") == "cpu"
    # glibc's heap keeps freed blocks resident unless the mmap threshold is fixed (then every freed
    # tensor above it goes back to the kernel): the cpu-heap lines count only with the defaults
    fixed = any(e.startswith("MALLOC_MMAP_THRESHOLD_=") for e in results["settings"].get("rank_env") or [])
    heap = cpu and not fixed
    rows, goals = [], []
    for case in results["cases"]:
        n, D, W = case["params"], mm.DTYPE_SIZE[case["dtype"]], case["world"]
        frac = case["largest"] / n
        z1 = case["runs"].get("zero1")
        z1_peak_a = mm.peak(mm.buffers("zero1", D, W, frac), heap)
        for contender in ORDER:
            run = case["runs"].get(contender)
            if run is None:
                continue
            bufs = mm.buffers(contender, D, W, frac)
            row = {
                "case": case["key"],
                "arch": case["arch"],
                "size": case["size"],
                "dtype": case["dtype"],
                "world": W,
                "params": n,
                "contender": contender,
                "analytic_held": mm.held(bufs),
                "analytic_peak": mm.peak(bufs, heap),
                "analytic_extra": mm.peak(bufs, heap) - z1_peak_a,
                "skipped": run.get("skipped"),
                "failed": run.get("failed"),
                "estimate": run.get("estimate"),
            }
            if _measured(run):
                row.update(
                    peak=run["peak"],
                    baseline=run["baseline"],
                    over_base=(run["peak"] - run["baseline"]) / n,
                    peak_phase=run["peak_phase"],
                    live_end=run["live_tensor_bytes_end"] / n,
                    wall_s=run["wall_s"],
                    extra=(run["peak"] - z1["peak"]) / n if _measured(z1) else None,
                )
                held = run.get("held")
                if held:
                    row["code_held"] = (held["full"] + held["shards"] + held.get("residuals", 0)) / n
                    mode = contender.removesuffix("-int8")
                    want = mm.acco_held_bytes(mode, D, D, W, held["padded_numel"])
                    ok = want == {k: held.get(k, 0) for k in ("full", "shards", "host_shards")}
                    if contender in mm.COMPRESSED:  # plus exactly one full buffer: the residual
                        ok = ok and held.get("residuals") == held["padded_numel"] * D
                    row["code_matches_formula"] = ok
            rows.append(row)
        goals += _case_goals(case, rows, D, W)
    goals += _fp16_goals(results, rows)
    return {"rows": rows, "goals": goals}


def _fp16_goals(results: dict, rows: list) -> list:
    """fp16 as bf16: acco's extra over ZeRO-1 fp16 within one buffer (D B/param), and the bytes acco holds in fp16
    equal to those it holds in bf16 on the same model and W (when the sweep ran both)."""
    by = {(r["case"], r["contender"]): r for r in rows}
    out = []
    for case in results["cases"]:
        if case["dtype"] != "fp16":
            continue
        D = mm.DTYPE_SIZE["fp16"]
        acco = by.get((case["key"], "acco"))
        if acco is None or acco.get("extra") is None:
            continue
        out.append(
            (
                f"{case['key']}: acco extra over ZeRO-1 fp16 <= one buffer in fp16 ({D} B/param)",
                f"{acco['extra']:+.2f} B/param (analytic {acco['analytic_extra']:+.2f})",
                "met" if acco["extra"] <= D else "**missed**",
            )
        )
        twin = case["key"].replace("-fp16-", "-bf16-")
        bf16 = by.get((twin, "acco"))
        if bf16 is None or bf16.get("code_held") is None or acco.get("code_held") is None:
            continue
        same = acco["code_held"] == bf16["code_held"]
        out.append(
            (
                f"{case['key']}: acco fp16 holds what acco bf16 holds ({twin})",
                f"{acco['code_held']:.2f} vs {bf16['code_held']:.2f} B/param held (the code); extra over ZeRO-1 "
                f"measured {acco['extra']:+.2f} (fp16) vs {_f(bf16.get('extra'), '+.2f')} (bf16) B/param",
                "met" if same else "**missed**",
            )
        )
    return out


def _case_goals(case: dict, rows: list, D: int, W: int) -> list:
    mine = {r["contender"]: r for r in rows if r["case"] == case["key"]}
    out = []
    acco, z1, sync = mine.get("acco"), mine.get("zero1"), mine.get("sync")
    bound = mm.goal_bound(D, W)
    if acco and acco.get("extra") is not None:
        out.append(
            (
                f"{case['key']}: acco extra over ZeRO-1 <= 1.10 x (D + D/W) = {bound:.2f} B/param",
                f"{acco['extra']:+.2f} B/param (analytic {acco['analytic_extra']:+.2f})",
                "met" if acco["extra"] <= bound else "**missed**",
            )
        )
        if case["size"] == "100m" and case["dtype"] == "bf16" and W == 2:
            out.append(
                (
                    f"{case['key']}: acco extra over ZeRO-1 <= 3.3 B/param (7.8 before the in-place buffers)",
                    f"{acco['extra']:+.2f} B/param",
                    "met" if acco["extra"] <= 3.3 else "**missed**",
                )
            )
    packed = mine.get("acco-int8")
    if packed and acco and packed.get("code_held") and acco.get("code_held"):
        extra_held = packed["code_held"] - acco["code_held"]
        out.append(
            (
                f"{case['key']}: acco-int8 holds at most one buffer in the comm dtype ({D} B/param) over acco",
                f"{extra_held:+.3f} B/param held (the residual, counted in the code); at the peak "
                f"{(packed['peak'] - acco['peak']) / case['params']:+.2f} B/param measured "
                f"(analytic {packed['analytic_peak'] - acco['analytic_peak']:+.2f}: the residual, a round's "
                "int8 values sent and the shard's chunks received)",
                "met" if extra_held <= D + 1e-9 else "**missed**",
            )
        )
    if sync and z1 and sync.get("peak") is not None and z1.get("peak") is not None:
        out.append(
            (
                f"{case['key']}: sync peak <= ZeRO-1 peak",
                f"{sync['peak'] / MIB:.0f} vs {z1['peak'] / MIB:.0f} MiB ({sync['extra']:+.2f} B/param)",
                "met" if sync["peak"] <= z1["peak"] else "**missed**",
            )
        )
    return out


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _context(results: dict) -> list:
    m, s = results["machine"], results["settings"]
    env = ", ".join(s.get("rank_env") or []) or "none (glibc malloc defaults)"
    return [
        "# Peak memory per rank (python -m benchmarks.memory)",
        "",
        f"- date: {m['date']}; machine: {m['cpu']}, {m['cores']} cores, "
        f"{_f(m.get('mem_total') and m['mem_total'] / 2**30, '.1f')} GiB RAM, GPU: {m['gpu'] or 'none'}",
        f"- versions: python {m['python']}, torch {m['torch']}, deepspeed {m['deepspeed']}, "
        f"transformers {m.get('transformers')}, acco_ds {m['acco_ds']}, libc {m.get('libc')}",
        f"- command: `{results['command']}` (took {_f(results.get('duration_s') and results['duration_s'] / 60, '.0f')} min); "
        f"cases run: `{s.get('cases', '*')}`",
        f"- each run: ranks started by the DeepSpeed launcher on 127.0.0.1 ({s['device']}"
        f"{', gloo' if s['device'] == 'cpu' else ', NCCL'}), {s['threads']} thread(s) per rank, {s['steps']} optimizer "
        f"steps of {s['grad_accum']} micro-batches of {s['micro_batch']} x {s['context']} random bytes, seed {s['seed']}; "
        "models built from `transformers` configs (byte vocabulary 256, nothing downloaded) in the run's dtype; "
        "parameters and communication in the same dtype; the configs of `acco_ds.cli.dsconfig` (ZeRO-1: one "
        "bucket of all parameters, contiguous gradients, no overlap; ZeRO-2: overlap_comm, bucket of a quarter; "
        "DeepSpeed's own AdamW); extra rank environment: " + env,
        "- memory: "
        + (
            "peak = the rank's `VmHWM` (highest resident set size, from the kernel); baseline = its RSS after the "
            "imports and the process group, before the model is built"
            if s["device"] == "cpu"
            else "peak = `torch.cuda.max_memory_allocated`; baseline = allocated bytes before the model is built"
        )
        + "; the row is the rank with the highest peak. B/param = bytes per model parameter.",
        "",
    ]


def _goals(an: dict) -> list:
    if not an["goals"]:
        return []
    lines = ["## Goals", "", "| goal | measured | verdict |", "|---|---|---|"]
    lines += [f"| {g} | {m} | {v} |" for g, m, v in an["goals"]]
    return lines + [""]


def _summary(results: dict, an: dict) -> list:
    ran = {c for case in results["cases"] for c in case["runs"]}
    others = [c for c in ORDER if c != "zero1" and (c in mm.CONTENDERS or c in ran)]
    head = (
        "| model | params | dtype | W | baseline MiB | ZeRO-1 peak MiB | "
        + " | ".join(f"{c} extra B/param (analytic)" for c in others)
        + " | acco bound |"
    )
    lines = [
        "## Extra peak per rank over ZeRO-1, bytes per parameter",
        "",
        "(peak - ZeRO-1's peak) / parameters, measured; the analytic difference in parentheses; "
        "negative = less memory than ZeRO-1.",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    by_case: dict = {}
    for r in an["rows"]:
        by_case.setdefault(r["case"], {})[r["contender"]] = r
    for case in results["cases"]:
        rows = by_case.get(case["key"], {})
        z1 = rows.get("zero1", {})
        cells = []
        for c in others:
            r = rows.get(c)
            if r is None:
                cells.append("-")
            elif r.get("skipped"):
                cells.append("skipped")
            elif r.get("failed"):
                cells.append("failed")
            else:
                cells.append(f"{_f(r.get('extra'), '+.2f')} ({r['analytic_extra']:+.2f})")
        D = mm.DTYPE_SIZE[case["dtype"]]
        lines.append(
            f"| {case['arch']} {case['size']} | {case['params'] / 1e6:.1f}M | {case['dtype']} | {case['world']} "
            f"| {_f(z1.get('baseline') and z1['baseline'] / MIB, '.0f')} "
            f"| {_f(z1.get('peak') and z1['peak'] / MIB, '.0f') if not z1.get('skipped') else 'skipped'} | "
            + " | ".join(cells)
            + f" | {mm.goal_bound(D, case['world']):.2f} |"
        )
    return lines + [""]


def _full(an: dict) -> list:
    head = (
        "| model | dtype | W | contender | params | model MiB | baseline MiB | peak MiB | over baseline B/param "
        "| analytic peak B/param | analytic held B/param | held by the code B/param | live tensors at end B/param "
        "| extra over ZeRO-1 B/param | analytic extra | peak reached | run s |"
    )
    lines = ["## Every run", "", head, "|" + "---|" * (head.count("|") - 1)]
    for r in an["rows"]:
        D = mm.DTYPE_SIZE[r["dtype"]]
        lead = (
            f"| {r['arch']} {r['size']} | {r['dtype']} | {r['world']} | {r['contender']} | {r['params'] / 1e6:.1f}M "
            f"| {r['params'] * D / MIB:.0f} "
        )
        if "peak" not in r:
            why = f"skipped: {r['skipped']}" if r.get("skipped") else f"failed: {r['failed']}"
            lines.append(
                lead + f"| {why} | | | {r['analytic_peak']:.2f} | {r['analytic_held']:.2f} | | | | "
                f"{r['analytic_extra']:+.2f} | | |"
            )
            continue
        code = "-"
        if r.get("code_held") is not None:
            code = f"{r['code_held']:.2f}" + ("" if r["code_matches_formula"] else " (formula MISMATCH)")
        lines.append(
            lead + f"| {r['baseline'] / MIB:.0f} | {r['peak'] / MIB:.0f} | {r['over_base']:.2f} "
            f"| {r['analytic_peak']:.2f} | {r['analytic_held']:.2f} | {code} | {r['live_end']:.2f} "
            f"| {_f(r.get('extra'), '+.2f')} | {r['analytic_extra']:+.2f} | {r['peak_phase']} | {r['wall_s']:.0f} |"
        )
    return lines + [""]


def _buffers(results: dict) -> list:
    combos = sorted({(c["dtype"], c["world"]) for c in results["cases"]})
    if not combos:
        return []
    head = "| contender | buffer | kind | B/param | " + " | ".join(f"{d} W={w}" for d, w in combos) + " |"
    lines = [
        "## Analytic bytes per parameter, per buffer",
        "",
        "D = dtype size (2 bf16, 4 fp32), W = ranks, L = the largest parameter's share of all parameters "
        "(the autograd line uses the first case's L). held: allocated for the whole run; transient: alive at "
        "the peak moment; cpu-heap: freed, kept resident by glibc's heap (counted on CPU with glibc's default "
        "mmap threshold only; the peak rows count it). Derivation: "
        "docs/BENCHMARKS.md, Memory.",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    frac = results["cases"][0]["largest"] / results["cases"][0]["params"] if results["cases"] else 0.0
    contenders = results["settings"]["contenders"]
    for c in [x for x in ORDER if x in contenders]:
        per = [mm.buffers(c, mm.DTYPE_SIZE[d], w, frac) for d, w in combos]
        for i, b in enumerate(per[0]):
            vals = " | ".join(f"{p[i].bytes_per_param:.2f}" for p in per)
            lines.append(f"| {c} | {b.name} | {b.kind} | {b.formula} | {vals} |")
        vals = " | ".join(f"**{mm.peak(p):.2f}**" for p in per)
        lines.append(f"| {c} | **peak** | | | {vals} |")
    return lines + [""]


def _loss_scale(results: dict) -> list:
    """The fp16 runs' skipped steps and final loss scale, per rank (empty without fp16 cases)."""
    fp16 = [c for c in results["cases"] if c["dtype"] == "fp16"]
    if not fp16:
        return []
    power = results["settings"].get("initial_scale_power")
    lines = [
        "## fp16 loss scaling",
        "",
        f"Every contender with the same dynamic loss scaling (`acco_ds.cli.dsconfig`'s fp16 section: first scale "
        f"2^{_f(power, 'd')}, hysteresis 2); per rank, the engine's skipped steps and the loss scale at the end "
        "(a skipped step does not update the weights: the buffers are the same, but the step's update "
        "temporaries are not allocated).",
        "",
        "| model | W | contender | skipped steps per rank | final loss scale per rank |",
        "|---|---|---|---|---|",
    ]
    for case in fp16:
        for contender in ORDER:
            run = case["runs"].get(contender)
            if not _measured(run):
                continue
            skipped = ", ".join(_f(s, "d") for s in run.get("skipped_steps") or [])
            scales = ", ".join(_f(s, "g") for s in run.get("loss_scale") or [])
            lines.append(
                f"| {case['arch']} {case['size']} | {case['world']} | {contender} | {skipped or '-'} | {scales or '-'} |"
            )
    return lines + [""]


def _failed(results: dict) -> list:
    failed = results.get("failed") or []
    if not failed:
        return []
    lines = ["## Runs that failed twice", "", "| case | contender | why |", "|---|---|---|"]
    return lines + [f"| {f['case']} | {f['contender']} | {f['why']} |" for f in failed] + [""]


def render(results: dict) -> str:
    an = analyse(results)
    parts = (
        _context(results)
        + _goals(an)
        + _summary(results, an)
        + _full(an)
        + _buffers(results)
        + _loss_scale(results)
        + _failed(results)
    )
    notes = results.get("notes")
    if notes:
        parts += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(parts)
