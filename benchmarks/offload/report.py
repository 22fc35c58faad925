"""The offload benchmark's Markdown report, rendered from its results JSON alone (no torch)."""

from __future__ import annotations

from benchmarks.offload import goals as g

HOST_BYTES = {"acco_commit": 28, "acco_peek": 16, "deepspeed_cpu_adam": 28}
"""Bytes per parameter each host row must move (benchmarks/kernels/table.py's BYTES; DeepSpeedCPUAdam: fp32
gradient, master and both moments)."""
JOB_PHASES = ("job_reduce_scatter_s", "job_norm_s", "job_to_host_s", "job_step_s", "job_to_device_s",
              "job_all_gather_s")  # fmt: skip


def _f(x, spec: str, none: str = "n/a") -> str:
    return none if g._num(x) is None else format(x, spec)


def _gib(x) -> str:
    return "n/a" if g._num(x) is None else f"{x / 2**30:.1f}"


def contender_rows(data: dict) -> list:
    comp = g._ok(data, "compute-only")
    base = comp.get("samples_per_s") if comp else None
    params = data.get("meta", {}).get("params")
    lines = [
        "| contender | status | samples/s | vs compute-only | steps/s | step time s | compute stream idle | "
        "eval loss (vs ZeRO-Offload) | peak GPU GiB | fp32 on the GPU B/param | init s | wall s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label in data.get("meta", {}).get("contenders") or data.get("contenders", {}):
        c = data.get("contenders", {}).get(label, {"status": "not run"})
        if c.get("status") != "ok":
            lines.append(f"| {label} | {c.get('status', '?')} | | | | | | | | | | |")
            continue
        sps = c.get("samples_per_s")
        vs = f"{sps / base:.0%}" if g._num(sps) is not None and g._num(base) else "n/a"
        gap = g.loss_gap(data, label)
        loss = _f(c.get("eval_loss"), ".4f") + (f" ({gap:+.2%})" if gap is not None and label != "zero1-offload"
                                                  else "")  # fmt: skip
        idle = c.get("idle_fraction")
        fp32 = c.get("fp32_gpu_bytes")
        fp32_pp = _f(fp32 / params, ".2f") if g._num(fp32) is not None and params else "n/a"
        lines.append(
            f"| {label} | ok | {_f(sps, '.2f')} | {vs} | {_f(c.get('steps_per_s'), '.3f')} | "
            f"{_f(c.get('step_time_s'), '.3f')} | {_f(idle, '.1%')} | {loss} | {_gib(c.get('peak_gpu_bytes'))} | "
            f"{fp32_pp} | {_f(c.get('init_s'), '.1f')} | {_f(c.get('wall_s'), '.1f')} |"
        )
    return lines


def host_rows_table(data: dict) -> list:
    rows = g.host_rows(data)
    if not rows:
        return ["No host rows (measured in the compute-only process)."]
    lines = ["| host row | parameters | threads | median ms | GB/s (bytes it must move) | M params/s |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, r in rows.items():
        t, n = r.get("median_s"), r.get("n")
        gbs = HOST_BYTES.get(name, 0) * n / t / 1e9 if g._num(t) and n else None
        lines.append(f"| {name} | {n / 1e6:g}M | {r.get('threads', '?')} | {_f(t * 1e3 if g._num(t) else None, '.2f')}"
                     f" | {_f(gbs, '.1f')} ({HOST_BYTES.get(name, '?')} B) | {_f(n / t / 1e6 if g._num(t) else None, '.0f')} |")  # fmt: skip
    return lines


def job_phase_lines(data: dict) -> list:
    out = []
    for label in g.ACCO_OFFLOAD_LABELS:
        c = g._ok(data, label)
        st = (c or {}).get("acco_stats") or {}
        rounds = st.get("rounds")
        if not rounds:
            continue
        phases = ", ".join(
            f"{k[4:-2]} {1e3 * st[k] / rounds:.1f}" for k in JOB_PHASES if g._num(st.get(k)) is not None
        )
        out.append(f"- {label}: {rounds} rounds, per round (ms): {phases or 'no phase recorded'}; "
                   f"committed steps {st.get('committed_steps', '?')}, micro-batches committed "
                   f"{st.get('micro_batches_committed', '?')}")  # fmt: skip
    return out


def render(data: dict) -> str:
    meta = data.get("meta", {})
    cal = meta.get("calibration", {})
    pred = meta.get("predicted", {})
    r = g.host_over_compute(data)
    size = meta.get("size", {})
    steps = meta.get("steps", {})
    md = [
        "# Optimizer offload on one GPU (W = 1): ACCO + offload against ZeRO-Offload and ZenFlow",
        "",
        f"- Date: {meta.get('date', '?')}; device: {meta.get('device', '?')}; machine: {meta.get('machine', '?')}",
        f"- Versions: {meta.get('versions', '?')}",
        f"- Command: `{meta.get('command', '?')}`",
        f"- Model: Llama architecture (transformers LlamaConfig, random weights, seed {meta.get('seed', '?')}), "
        f"{_f(meta.get('params', 0) / 1e6, '.3g')}M parameters (hidden {size.get('hidden')}, {size.get('layers')} "
        f"layers, intermediate {size.get('intermediate')}, vocabulary {size.get('vocab')}), bf16; micro-batch "
        f"{meta.get('micro_batch')} x {meta.get('seq')} tokens, gradient accumulation {meta.get('gas')} "
        f"({meta.get('gas_how', '?')}); data: the project's corpus as bytes, the same windows for every contender.",
        f"- Steps per contender: {steps.get('warmup')} warm-up, {steps.get('timed')} timed (samples/s and steps/s "
        f"over that window, between two device syncs), then {steps.get('profile')} profiled after one unrecorded "
        "(the compute stream's idle fraction: the share of the window with no kernel on the stream with the most "
        "kernels; copies on it count as idle); adaptive ACCO runs the same micro-batches. Eval loss: held-out "
        "windows after the same samples (ACCO after finish()).",
        f"- Contenders: {', '.join(meta.get('contenders', []))}. compute-only = acco_ds dpu, fixed accumulation, "
        "no offload (the project's compute-only bound: the contenders' engine and loop, the AdamW step on the GPU "
        "in the round's job, no communication at W = 1); ZeRO-Offload = DeepSpeed ZeRO-1 + offload "
        "(DeepSpeedCPUAdam); ZenFlow: ZeRO-2 + offload + zenflow overlap_step, update_interval "
        f"{meta.get('zenflow_update_interval', 'gas')} ('gas': the accumulation; its default 'auto' gave a NaN loss "
        "on the CPU here: benchmarks/offload/plan.py), its defaults otherwise.",
        f"- DeepSpeedCPUAdam's op (ZenFlow's too): loaded in {_f(meta.get('cpu_adam_load_s'), '.1f')} s "
        "(a JIT build where the torch extensions cache has none).",
        "",
        "## Sizing: the host step against a step's compute",
        "",
        f"- Predicted ({_f(pred.get('assumed', {}).get('tflops', 0) / 1e12, '.0f')} TFLOP/s achieved, host "
        f"{_f(pred.get('assumed', {}).get('host_bw', 0) / 1e9, '.0f')} GB/s at "
        f"{pred.get('assumed', {}).get('host_bytes_per_param', '?')} B/param): micro-batch "
        f"{_f(pred.get('compute_mb_s', 0) * 1e3, '.0f')} ms, step compute {_f(pred.get('compute_step_s'), '.3f')} s, "
        f"host step {_f(pred.get('host_step_s'), '.3f')} s, host / compute {_f(pred.get('host_over_compute'), '.2f')}.",
        f"- Measured: the model alone {_f(cal.get('model_alone_mb_s', 0) * 1e3, '.1f')} ms per micro-batch; "
        f"DeepSpeedCPUAdam over the model's parameters {_f(g.host_step_s(data), '.3f')} s (its host row scaled); "
        f"host / compute (the compute-only step) {_f(r, '.2f')}.",
        "",
        "## Contenders",
        "",
        *contender_rows(data),
        "",
        "## Host rows (the kernel benchmark's, on this machine's cores)",
        "",
        *host_rows_table(data),
    ]
    phases = job_phase_lines(data)
    if phases:
        md += ["", "ACCO's round jobs (engine.optimizer.stats()):", "", *phases]
    rows = g.judge(data)
    md += ["", "## Goals (judged from this JSON alone: benchmarks/offload/goals.py)", "",
           "| goal | measured | verdict |", "|---|---|---|"]  # fmt: skip
    md += [f"| {row['goal']} | {row['figure'].replace('|', '/')} | {g.verdict(row['met'])} |" for row in rows]
    failed = [(label, c) for label, c in data.get("contenders", {}).items() if c.get("status") != "ok"]
    if failed:
        md += ["", "Contenders that did not run to their end (the last lines of their error):", ""]
        for label, c in failed:
            tail = (c.get("error") or "").strip().splitlines()[-3:]
            md.append(f"- {label}: {c.get('status')}: " + " / ".join(t.strip() for t in tail))
    if meta.get("device") != "cuda":
        md += ["", "Not a GPU run: the idle fraction and the GPU memory are n/a, and the rates are this CPU's (the "
               "flow's check, not a measurement of offload)."]  # fmt: skip
    return "\n".join(md) + "\n"
