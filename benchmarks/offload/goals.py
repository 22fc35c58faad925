"""The offload benchmark's goals, judged from its results JSON alone (``offload.json``).

Standard library only and no import of the project: scripts/gpu/goals.py loads this file by its path on the GPU
machine, and ``python -m benchmarks.offload --from-json`` re-judges a saved run anywhere. ``judge(data)`` returns one
row per goal: ``{"goal", "figure", "met"}`` with ``met`` True, False, or None where a figure the goal needs is
missing (a contender that failed or did not run, a CPU run's GPU memory): a missing figure is never met.

The ratio that places a run in a goal's regime: ``host / compute`` = DeepSpeedCPUAdam's step over the model's
parameters (the host rows measured in the compute-only process: its median seconds at the rows' size, scaled to
the model's parameters) over the compute-only contender's measured step time.
"""

from __future__ import annotations

import math

FIXED_MIN_X = 1.4
FIXED_REGIME = (0.35, 0.7)
"""'where the host step is about half the compute': host / compute inside this range."""
ADAPTIVE_MIN_FRACTION = 0.9
ADAPTIVE_REGIME_MAX = 1.0
"""'where the host step is up to one step's compute'."""
LOSS_REL_TOL = 0.02
"""The eval loss after the same samples within 2% of ZeRO-Offload's (the e2e benchmark's validation-loss bound)."""
FP32_GPU_MAX_BYTES_PER_PARAM = 1.0
"""fp32 CUDA tensors an ACCO + offload process holds, per model parameter: a master copy or one moment alone is 4."""
PEAK_SAVING_MIN_BYTES_PER_PARAM = 8.0
"""ACCO + offload's peak GPU memory at least this far below the compute-only contender's (which holds the fp32
master and both moments, 12 B/param; acco mode adds the kept g~ shard, 2 B/param in bf16 at W = 1)."""
HOST_MIN_RATIO = 1.0
ACCO_OFFLOAD_LABELS = ("acco-offload-fixed", "acco-offload-adaptive")

GOALS = (
    f"fixed ACCO + offload >= {FIXED_MIN_X}x ZeRO-Offload's steps/s (host step {FIXED_REGIME[0]}-{FIXED_REGIME[1]}x "
    "a step's compute)",
    f"adaptive ACCO + offload >= {ADAPTIVE_MIN_FRACTION:.0%} of compute-only samples/s (host step <= "
    f"{ADAPTIVE_REGIME_MAX:g}x a step's compute)",
    "adaptive ACCO + offload samples/s >= ZenFlow's",
    f"loss after the same samples within {LOSS_REL_TOL:.0%} of ZeRO-Offload's (ACCO + offload, fixed and adaptive)",
    "no fp32 master and no moments on the GPU (ACCO + offload)",
    "host AdamW >= DeepSpeedCPUAdam's throughput on the same cores",
    "every contender ran",
)


def _ok(data: dict, label: str) -> dict | None:
    c = data.get("contenders", {}).get(label)
    return c if c and c.get("status") == "ok" else None


def _num(x) -> float | None:
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _why_missing(data: dict, labels) -> str:
    parts = []
    for label in labels:
        c = data.get("contenders", {}).get(label)
        if c is None:
            parts.append(f"{label}: not in the results")
        elif c.get("status") != "ok":
            why = (c.get("error") or "").strip().splitlines()
            parts.append(f"{label}: {c.get('status')}" + (f" ({why[-1][:160]})" if why else ""))
    return "; ".join(parts)


def host_rows(data: dict) -> dict:
    return data.get("meta", {}).get("calibration", {}).get("host_rows", {}) or {}


def host_step_s(data: dict) -> float | None:
    """DeepSpeedCPUAdam's step over the model's parameters: its host row's median scaled by params / row size."""
    row = host_rows(data).get("deepspeed_cpu_adam")
    params = _num(data.get("meta", {}).get("params"))
    if not row or params is None or _num(row.get("median_s")) is None or not row.get("n"):
        return None
    return row["median_s"] * params / row["n"]


def host_over_compute(data: dict) -> float | None:
    """host / compute: the host step over the compute-only contender's step time (None when either is missing)."""
    h = host_step_s(data)
    c = _ok(data, "compute-only")
    t = _num(c.get("step_time_s")) if c else None
    return h / t if h is not None and t else None


def _regime(r: float | None) -> str:
    return (
        "host / compute unknown (no compute-only step time or host rows)"
        if r is None
        else f"host / compute {r:.2f}"
    )


def fixed_goal(data: dict) -> dict:
    a, z = _ok(data, "acco-offload-fixed"), _ok(data, "zero1-offload")
    r = host_over_compute(data)
    if not a or not z or _num(a.get("steps_per_s")) is None or not _num(z.get("steps_per_s")):
        return {"goal": GOALS[0], "figure": _why_missing(data, ("acco-offload-fixed", "zero1-offload")) or
                "no steps/s", "met": None}  # fmt: skip
    x = a["steps_per_s"] / z["steps_per_s"]
    z2 = _ok(data, "zero2-offload")
    beside = f"; vs ZeRO-2 + offload {a['steps_per_s'] / z2['steps_per_s']:.2f}x" if z2 and _num(
        z2.get("steps_per_s")) else ""  # fmt: skip
    in_regime = r is not None and FIXED_REGIME[0] <= r <= FIXED_REGIME[1]
    figure = (f"{x:.2f}x ({a['steps_per_s']:.3f} vs {z['steps_per_s']:.3f} steps/s){beside}; {_regime(r)}"
              + ("" if in_regime else " (outside the goal's regime: no verdict)"))  # fmt: skip
    return {"goal": GOALS[0], "figure": figure, "met": x >= FIXED_MIN_X if in_regime else None}


def adaptive_goals(data: dict) -> list:
    a, c, zf = _ok(data, "acco-offload-adaptive"), _ok(data, "compute-only"), _ok(data, "zenflow")
    r = host_over_compute(data)
    rows = []
    if a and c and _num(a.get("samples_per_s")) is not None and _num(c.get("samples_per_s")):
        frac = a["samples_per_s"] / c["samples_per_s"]
        alone = _num(data.get("meta", {}).get("calibration", {}).get("model_alone_samples_per_s"))
        beside = f"; {a['samples_per_s'] / alone:.0%} of the model alone's {alone:.2f}" if alone else ""
        in_regime = r is not None and r <= ADAPTIVE_REGIME_MAX
        figure = (f"{frac:.0%} ({a['samples_per_s']:.2f} vs {c['samples_per_s']:.2f} samples/s){beside}; "
                  f"{_regime(r)}" + ("" if in_regime else " (outside the goal's regime: no verdict)"))  # fmt: skip
        met = frac >= ADAPTIVE_MIN_FRACTION if in_regime else None
        rows.append({"goal": GOALS[1], "figure": figure, "met": met})
    else:
        rows.append({"goal": GOALS[1], "figure": _why_missing(data, ("acco-offload-adaptive", "compute-only"))
                     or "no samples/s", "met": None})  # fmt: skip
    if a and zf and _num(a.get("samples_per_s")) is not None and _num(zf.get("samples_per_s")):
        x = a["samples_per_s"] / zf["samples_per_s"]
        rows.append({"goal": GOALS[2], "figure": f"{x:.2f}x ({a['samples_per_s']:.2f} vs {zf['samples_per_s']:.2f} "
                     "samples/s)", "met": x >= 1.0})  # fmt: skip
    else:
        rows.append({"goal": GOALS[2], "figure": _why_missing(data, ("acco-offload-adaptive", "zenflow"))
                     or "no samples/s", "met": None})  # fmt: skip
    return rows


def loss_gap(data: dict, label: str) -> float | None:
    """(loss - ZeRO-Offload's loss) / ZeRO-Offload's loss, after the same samples; None when either is missing."""
    c, z = _ok(data, label), _ok(data, "zero1-offload")
    if not c or not z or _num(c.get("eval_loss")) is None or not _num(z.get("eval_loss")):
        return None
    return (c["eval_loss"] - z["eval_loss"]) / z["eval_loss"]


def loss_goal(data: dict) -> dict:
    gaps = {label: loss_gap(data, label) for label in ("acco-offload-fixed", "acco-offload-adaptive")}
    z = _ok(data, "zero1-offload")
    if any(g is None for g in gaps.values()):
        missing = _why_missing(data, ("zero1-offload", *gaps)) or "no eval loss"
        return {"goal": GOALS[3], "figure": missing, "met": None}
    zf = loss_gap(data, "zenflow")
    beside = f"; ZenFlow {zf:+.2%}" if zf is not None else "; ZenFlow: no loss"
    figure = (f"fixed {gaps['acco-offload-fixed']:+.2%}, adaptive {gaps['acco-offload-adaptive']:+.2%}{beside} "
              f"(ZeRO-Offload's loss {z['eval_loss']:.4f})")  # fmt: skip
    return {"goal": GOALS[3], "figure": figure, "met": all(abs(g) <= LOSS_REL_TOL for g in gaps.values())}


def memory_goal(data: dict) -> dict:
    """Met when each ACCO + offload process held under 1 B/param of fp32 CUDA tensors and peaked at least 8 B/param
    below the compute-only contender (a CPU run: no result)."""
    if data.get("meta", {}).get("device") != "cuda":
        return {"goal": GOALS[4], "figure": "n/a: not a GPU run", "met": None}
    params = _num(data.get("meta", {}).get("params"))
    c = _ok(data, "compute-only")
    base = _num(c.get("peak_gpu_bytes")) if c else None
    parts, verdicts = [], []
    for label in ACCO_OFFLOAD_LABELS:
        a = _ok(data, label)
        fp32, peak = (_num(a.get("fp32_gpu_bytes")), _num(a.get("peak_gpu_bytes"))) if a else (None, None)
        if not params or fp32 is None or peak is None or base is None:
            parts.append(_why_missing(data, (label, "compute-only")) or f"{label}: no memory figure")
            verdicts.append(None)
            continue
        saving = (base - peak) / params
        parts.append(f"{label}: fp32 on the GPU {fp32 / params:.2f} B/param, peak {peak / 2**30:.1f} GiB, "
                     f"{saving:.1f} B/param below compute-only's {base / 2**30:.1f} GiB")  # fmt: skip
        verdicts.append(
            fp32 / params < FP32_GPU_MAX_BYTES_PER_PARAM and saving >= PEAK_SAVING_MIN_BYTES_PER_PARAM
        )
    z = _ok(data, "zero1-offload")
    if z and _num(z.get("peak_gpu_bytes")):
        parts.append(f"ZeRO-Offload's peak {z['peak_gpu_bytes'] / 2**30:.1f} GiB")
    met = False if False in verdicts else (None if None in verdicts else True)
    return {"goal": GOALS[4], "figure": "; ".join(parts), "met": met}


def host_goal(data: dict) -> dict:
    rows = host_rows(data)
    commit, ds = rows.get("acco_commit"), rows.get("deepspeed_cpu_adam")
    if not commit or not ds or not _num(commit.get("median_s")) or not _num(ds.get("median_s")):
        return {
            "goal": GOALS[5],
            "figure": "no host rows (measured in the compute-only process)",
            "met": None,
        }
    x = ds["median_s"] / commit["median_s"]
    peek = rows.get("acco_peek")
    beside = (
        f"; the peek {ds['median_s'] / peek['median_s']:.2f}x" if peek and _num(peek.get("median_s")) else ""
    )
    threads = data.get("meta", {}).get("calibration", {}).get("threads", "?")
    figure = (f"commit {x:.2f}x DeepSpeedCPUAdam's step ({commit['median_s'] * 1e3:.1f} vs {ds['median_s'] * 1e3:.1f} "
              f"ms at {commit['n'] / 1e6:g}M parameters, {threads} threads){beside}")  # fmt: skip
    return {"goal": GOALS[5], "figure": figure, "met": x >= HOST_MIN_RATIO}


def ran_goal(data: dict) -> dict:
    contenders = data.get("contenders", {})
    expected = data.get("meta", {}).get("contenders") or list(contenders)
    bad = [label for label in expected if not _ok(data, label)]
    if not expected:
        return {"goal": GOALS[6], "figure": "no contender", "met": False}
    figure = f"{len(expected) - len(bad)} of {len(expected)}" + (
        f"; {_why_missing(data, bad)}" if bad else ""
    )
    return {"goal": GOALS[6], "figure": figure, "met": not bad}


def judge(data: dict) -> list:
    """Every goal's row, in ``GOALS`` order."""
    return [fixed_goal(data), *adaptive_goals(data), loss_goal(data), memory_goal(data), host_goal(data),
            ran_goal(data)]  # fmt: skip


def verdict(met) -> str:
    return {True: "MET", False: "NOT MET", None: "NOT MET (no result)"}[met]
