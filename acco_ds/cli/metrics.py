"""Merging the ranks' raw records of a run into global metrics, and summarising a run.

Contracts:
- ``merge_ranks(run_dir, world, micro_batch)`` aligns the ranks' cumulative step records on the
  steps every rank logged and returns one record per step: ``step``, ``time_s`` (the slowest
  rank's time: a step is done when every rank is past it), ``samples`` (global samples computed so
  far, all ranks), ``loss`` (mean loss of the micro-batches computed since the previous record),
  ``samples_per_s`` (samples over time so far) and ``rank_mb`` (cumulative micro-batches per rank); with fp16
  also ``loss_scale`` and ``skipped_steps`` (rank 0's: every rank takes the same decisions).
- ``summarize(records, ranks, warmup, micro_batch)`` gives the steady-state figures of a run:
  median time per optimizer step after ``warmup`` steps, samples/s over the steps after warm-up
  (overall and per rank), the final training loss (mean over the last ``tail`` of the samples),
  the validation loss and its curve (``val_curve``: the evaluations during the run), the peak memory per rank
  and, with fp16, the final loss scale and the steps the engine skipped (``engine.skipped_steps``; None without
  fp16 for the scale).
- ``time_to_loss(records, target, window)`` is the first time the training loss averaged over the
  trailing ``window`` samples is at or below ``target`` (None when never).
"""

from __future__ import annotations

import bisect
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import List


def read_ranks(run_dir: Path, world: int):
    """(per-rank step records, per-rank summaries) of a finished run."""
    run_dir = Path(run_dir)
    logs, sums = [], []
    for r in range(world):
        lines = (run_dir / f"rank{r}.jsonl").read_text().splitlines()
        logs.append([json.loads(x) for x in lines if x.strip()])
        sums.append(json.loads((run_dir / f"rank{r}.json").read_text()))
    return logs, sums


FP16_KEYS = ("loss_scale", "skipped_steps")
"""The per-step figures an fp16 run's records carry (``acco_ds.cli.worker``)."""


def merge_ranks(logs: List[list], micro_batch: int) -> List[dict]:
    by_rank = [{rec["step"]: rec for rec in log} for log in logs]
    common = sorted(set.intersection(*(set(d) for d in by_rank))) if by_rank else []
    out, prev_mb, prev_loss = [], 0, 0.0
    for step in common:
        recs = [d[step] for d in by_rank]
        mb = sum(r["mb"] for r in recs)
        loss_sum = sum(r["loss_sum"] for r in recs)
        t = max(r["t"] for r in recs)
        if mb == prev_mb:
            continue
        out.append(
            {
                "step": step,
                "time_s": t,
                "samples": mb * micro_batch,
                "loss": (loss_sum - prev_loss) / (mb - prev_mb),
                "samples_per_s": mb * micro_batch / t if t > 0 else 0.0,
                "rank_mb": [r["mb"] for r in recs],
                "rank_t": [r["t"] for r in recs],
                "loss_sum": loss_sum,
                "mb_total": mb,
                **{k: recs[0][k] for k in FP16_KEYS if k in recs[0]},
            }
        )
        prev_mb, prev_loss = mb, loss_sum
    return out


def smoothed_loss(records: List[dict], window: int) -> List[float | None]:
    """Mean training loss of the micro-batches in the trailing ``window`` samples at each record
    (None until ``window`` samples are in)."""
    samples = [r["samples"] for r in records]
    out: List[float | None] = []
    for r in records:
        if r["samples"] < window:
            out.append(None)
            continue
        j = bisect.bisect_right(samples, r["samples"] - window) - 1
        base_mb, base_loss = (records[j]["mb_total"], records[j]["loss_sum"]) if j >= 0 else (0, 0.0)
        out.append((r["loss_sum"] - base_loss) / (r["mb_total"] - base_mb))
    return out


def time_to_loss(records: List[dict], target: float, window: int) -> float | None:
    for rec, value in zip(records, smoothed_loss(records, window)):
        if value is not None and value <= target:
            return rec["time_s"]
    return None


def summarize(
    records: List[dict], ranks: List[dict], warmup: int, micro_batch: int, tail: float = 0.2
) -> dict:
    if not records:
        raise ValueError("the run logged no optimizer step: nothing to summarise")
    w = min(warmup, len(records) - 2) if len(records) > 2 else 0
    steady = records[w:]
    base = (
        records[w - 1]
        if w > 0
        else {
            "time_s": 0.0,
            "samples": 0,
            "step": 0,
            "rank_mb": [0] * len(ranks),
            "rank_t": [0.0] * len(ranks),
        }
    )
    last = records[-1]
    dts = [
        (b["time_s"] - a["time_s"]) / (b["step"] - a["step"]) for a, b in zip([base] + steady[:-1], steady)
    ]
    span = last["time_s"] - base["time_s"]
    per_rank = [
        (last["rank_mb"][r] - base["rank_mb"][r]) * micro_batch / (last["rank_t"][r] - base["rank_t"][r])
        if last["rank_t"][r] > base["rank_t"][r]
        else 0.0
        for r in range(len(ranks))
    ]
    window = max(1, int(tail * last["samples"]))
    final = smoothed_loss(records, window)[-1]
    return {
        "steps": last["step"],
        "samples": last["samples"],
        "train_s": max(s["train_s"] for s in ranks),
        "step_time_s": statistics.median(dts),
        "samples_per_s": (last["samples"] - base["samples"]) / span if span > 0 else 0.0,
        "rank_samples_per_s": per_rank,
        "final_train_loss": final,
        "loss_window_samples": window,
        "val_loss": ranks[0].get("val_loss"),
        "val_curve": val_curve(ranks),
        "peak_mem_mib": [s["peak_mem_mib"] for s in ranks],
        "rank_micro_batches": [s["micro_batches_local"] for s in ranks],
        "acco_stats": [s.get("stats", {}) for s in ranks],
        **overlap_shares([s.get("stats") or {} for s in ranks], max(s["train_s"] for s in ranks)),
        # bytes each rank sent while training (acco_ds.cli.wire_bytes), per optimizer step, mean over ranks
        "wire_bytes_per_step": (
            statistics.mean(s["wire_bytes_sent"] for s in ranks) / last["step"]
            if last["step"] and all("wire_bytes_sent" in s for s in ranks)
            else None
        ),
        # with tensor parallelism inside nodes: the bytes of the calls that span nodes only (WireCounter)
        "wire_bytes_internode_per_step": (
            statistics.mean(s["wire_bytes_internode_sent"] for s in ranks) / last["step"]
            if last["step"] and all(s.get("wire_bytes_internode_sent") is not None for s in ranks)
            else None
        ),
        "warmup_steps": w,
        "fp16": bool(ranks[0].get("fp16", False)),
        "loss_scale": ranks[0].get("loss_scale"),
        "skipped_steps": ranks[0].get("skipped_steps"),
        "fp16_allowed_on_cpu": bool(ranks[0].get("fp16_allowed_on_cpu", False)),
    }


def val_curve(ranks: List[dict]) -> dict | None:
    """The run's validation-loss curve (``acco_ds.cli.val_curve``): rank 0's steps and losses (every rank's are the
    same: the evaluation is a collective), each time the slowest rank's; None for ranks that recorded none."""
    curves = [r.get("val_curve") for r in ranks]
    if not curves or any(not c for c in curves) or len({len(c["step"]) for c in curves}) != 1:
        return curves[0] if curves and curves[0] else None
    return {
        "step": list(curves[0]["step"]),
        "time_s": [max(ts) for ts in zip(*(c["time_s"] for c in curves))],
        "val_loss": list(curves[0]["val_loss"]),
    }


def overlap_shares(stats: list, train_s: float) -> dict:
    """What a run's ACCO communication cost and how much of it ACCO hid, from each rank's ``stats()`` (means over
    the ranks): ``comm_share``, the round jobs' own time (``core.overlap.job_seconds``) over the training time, and
    ``hidden_share``, the part of that time the training thread did not wait for (1 - ``comm_wait_share``). None
    for a run without ACCO (DeepSpeed's ZeRO-1 reports no such figures) or before a job's time is known."""
    from acco_ds.core.overlap import JOB_PHASES

    jobs = [sum(float(st.get(k, 0.0)) for k in JOB_PHASES) for st in stats if st]
    if not jobs or not all(j > 0 for j in jobs) or train_s <= 0:
        return {"comm_share": None, "hidden_share": None}
    waits = [float(st.get("comm_wait_s", 0.0)) for st in stats if st]
    return {
        "comm_share": statistics.mean(jobs) / train_s,
        "hidden_share": statistics.mean(max(0.0, 1.0 - min(1.0, w / j)) for w, j in zip(waits, jobs)),
    }


def machine_info() -> dict:
    """CPU model, cores, GPU (if any), library versions, date: the context of every result."""
    import torch

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "platform": platform.platform(),
    }
    try:
        import deepspeed

        info["deepspeed"] = deepspeed.__version__
    except Exception as err:  # pragma: no cover - reported, not fatal
        info["deepspeed"] = f"unavailable ({err})"
    info["acco_ds"] = _acco_ds_version()
    return info


def _acco_ds_version() -> str:
    """The package version plus the source commit: ``$ACCO_DS_SOURCE_COMMIT`` (set it when running
    from an exported tree) or ``git rev-parse`` of the checkout this package lives in."""
    import subprocess

    from acco_ds.cli.launch import PACKAGE_PARENT

    try:
        from importlib.metadata import version

        ver = version("acco_ds")
    except Exception:
        ver = "source tree"
    commit = os.environ.get("ACCO_DS_SOURCE_COMMIT")
    if not commit:
        try:
            out = subprocess.run(
                ["git", "-C", PACKAGE_PARENT, "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            commit = out.stdout.strip() if out.returncode == 0 else ""
        except (OSError, subprocess.SubprocessError):
            commit = ""
    return f"{ver} ({commit})" if commit else ver
