"""Analysis of the e2e and topology benchmarks' raw results: per-rate throughput and loss rows, both
framings of the comm-bound claim, the heterogeneous table; ``analyse(results, goals)`` adds the
benchmark's own goals (``goals(analysis, results)``: ``benchmarks.e2e.goals``,
``benchmarks.topology.report``).

Definitions (BENCHMARKS.md section 2, measured in the same run):
- seeds: every contender runs once per seed at every rate, interleaved. The seed fixes the model's
  initialisation and the data order, the same for every contender, so figures of one seed form a
  pair; the seeds double as the repeats of the throughput figures.
- throughput (time per optimizer step: median over the steps after warm-up of the slowest
  replica's step time; samples/s: global samples computed after warm-up over the time they took):
  the seed with the highest samples/s is reported (best-of-N: other jobs share these machines,
  and the best is also the figure most favourable to every contender alike); the median over the
  seeds is beside it and every run's figure is listed.
- compute-only bound (``runs.run_compute_only``): the contenders' training loop with the
  communication removed - every replica its own acco_ds job (dpu: forward, backward, accumulation
  into ACCO's buffer, the optimizer step on the communication thread), all concurrently, started
  together; samples/s = the sum of the replicas' own samples/s over the window where all run. The
  highest of the compute-only runs is the bound.
- T_compute of a round: micro-batches of the round per replica x the mean over replicas of the
  median time of one micro-batch in that compute-only run.
- T_comm of a round: the comm-only probe at that rate, the cheapest of (reduce-scatter,
  all-reduce, acco_ds's point-to-point reduce-scatter) + all-gather of the model's (slice's) size
  (ZeRO-2's round also counts its per-micro-batch reductions).
- overlap efficiency: max(T_compute, T_comm) / T_round, T_round = step time / rounds per step
  (acco: 2, adaptive: rounds/steps from its stats, others: 1).
- loss figures, per seed, paired with ZeRO-1's run of the same seed, then mean and spread
  (min/max, sd) over the seeds (``seeds``); a verdict is made against the spread:
  - loss at ZeRO-1's samples: training loss averaged over the trailing 20% of ZeRO-1's samples,
    at ZeRO-1's final sample count; val loss: on the committed parameters at the end.
  - framing (a), same optimizer steps: time to ZeRO-1's final loss = the first time that
    trailing-average training loss is at or below ZeRO-1's final one (x: over ZeRO-1's own time
    to it); validation: whether the run's final val loss is at or below ZeRO-1's, and if so its
    training time over ZeRO-1's (an upper bound: validation is measured only at the end). With ``--eval-every``
    (the runs' ``val_curve``): the time to ZeRO-1's final val loss, the first crossing interpolated between the
    evaluations, over ZeRO-1's own time to it (``x_time_to_val_curve``: ``acco_ds.cli.time_to_loss``).
  - framing (b), same token budget (the paper's): every contender gets the samples a fixed
    contender computes in the run's steps; adaptive ACCO, which computes more per step, runs
    ``runs.budget_schedule`` steps with its LR schedule compressed to them (its run at the
    full step count is reused when its samples are within 5% of the budget). Reported: wall-clock
    (training time), the final val loss and the optimizer steps each made.
"""

from __future__ import annotations

import math
import statistics
from typing import Callable

from acco_ds.cli.metrics import smoothed_loss, time_to_loss
from acco_ds.cli.time_to_loss import versus_baseline
from acco_ds.core.phase_clock import PHASES as JOB_PHASES
from benchmarks.harness import link
from benchmarks.harness import seeds as sd

ORDER = (
    "zero1",
    "zero1-overlap",
    "zero2",
    "zero1-bf16comm",
    "sync",
    "sync-int8",
    "sync-int4",
    "dpu",
    "acco",
    "acco-adaptive",
    "acco-int8",
    "acco-adaptive-int8",
    "acco-int4",
    "acco-adaptive-int4",
    "acco-int8-noef",
    "acco-int8-exact-peek",
    "acco-int8-peek-int4",
    "acco-adaptive-int8-peek-int4",
    "dpu-int8",
    "acco-int8-unfused",
    "acco-int4-unfused",
)


def compute_only(results: dict) -> dict:
    """The compute-only bound: the fastest of the compute-only runs, which, like the contenders'
    best-of-N, is the strictest reference for "samples/s vs compute-only" and gives the smallest
    T_compute, hence the most conservative overlap efficiency."""
    runs = results["compute"]
    best = max(runs, key=lambda r: r["samples_per_s"])
    return {
        "t_mb": list(best["t_mb"]),
        "t_mb_mean": statistics.mean(best["t_mb"]),
        "samples_per_s": best["samples_per_s"],
        "rank_samples_per_s": list(best.get("rank_samples_per_s", [])),
        "each_samples_per_s": [r["samples_per_s"] for r in runs],
        "loop": results.get("bound_loop"),
    }


def rounds_per_step(label: str, s: dict) -> float:
    """Communication rounds per optimizer step: acco's two (adaptive: counted), one otherwise (labels
    ``acco...`` are ACCO's contenders, compressed or not)."""
    if label.startswith("acco-adaptive"):
        stats = [x for x in s.get("acco_stats", []) if x.get("rounds")]
        if stats and s["steps"]:
            return statistics.mean(x["rounds"] for x in stats) / s["steps"]
        return 2.0
    return 2.0 if label.startswith("acco") else 1.0


def _loss_at(records: list, samples: int, window: int):
    for rec, value in zip(records, smoothed_loss(records, window)):
        if rec["samples"] >= samples and value is not None:
            return value
    return None


def step_time_p20(s: dict) -> float:
    """20th percentile of the per-step times after warm-up (slowest replica): the step time when
    other jobs on the machine leave the run alone."""
    recs = s["records"][s.get("warmup_steps", 0) :]
    dts = sorted((b["time_s"] - a["time_s"]) / (b["step"] - a["step"]) for a, b in zip(recs, recs[1:]))
    return dts[int(0.2 * (len(dts) - 1))] if dts else s["step_time_s"]


def seed_runs(block: dict, label: str, default_seed: int = 0) -> dict:
    """{seed: run} of ``label`` in a rate block (results saved before seeds: its one run)."""
    if "seeds" in block:
        return {s.get("seed", default_seed): s for s in block["seeds"].get(label, [])}
    run = block["runs"].get(label)
    return {default_seed: run} if run else {}


def ordered(labels) -> list:
    labels = list(labels)
    return [x for x in ORDER if x in labels] + [x for x in labels if x not in ORDER]


def x_time_to_val(run: dict, base: dict) -> float | None:
    """``run``'s time to ``base``'s final validation loss over ``base``'s own time to it, both first crossings
    interpolated between the evaluations of their ``val_curve`` (``acco_ds.cli.time_to_loss.versus_baseline``);
    inf when ``run`` never reached it; None unless both curves have evaluations during the run (two or more)."""
    curves = {"run": run.get("val_curve"), "base": base.get("val_curve")}
    if not all(c and len(c.get("val_loss") or []) > 1 for c in curves.values()):
        return None
    try:
        v = versus_baseline(curves, "base")["runs"]["run"]
    except ValueError:  # the baseline's final loss is not finite
        return None
    if not v["crossing"].reached:
        return math.inf
    return v["x_baseline"]


def _pair_figures(s: dict, base: dict) -> dict:
    """One seed's loss figures of run ``s`` against ZeRO-1's run ``base`` of the same seed."""
    window = max(1, int(0.2 * base["samples"]))
    target = _loss_at(base["records"], base["samples"], window)
    base_ttl = time_to_loss(base["records"], target, window) if target is not None else None
    ttl = time_to_loss(s["records"], target, window) if target is not None else None
    val_ok = s["val_loss"] is not None and base["val_loss"] is not None and s["val_loss"] <= base["val_loss"]
    return {
        "loss_at_base_samples": _loss_at(s["records"], base["samples"], window),
        "val_gap": s["val_loss"] / base["val_loss"] - 1 if base["val_loss"] else None,
        "time_to_base_loss_s": math.inf if ttl is None else ttl,
        "x_time_to_base_loss": (ttl / base_ttl) if (ttl is not None and base_ttl) else math.inf,
        "x_time_to_base_val": s["train_s"] / base["train_s"] if val_ok else math.inf,
        "x_time_to_val_curve": x_time_to_val(s, base),
    }


def analyse_rate(block: dict, comp: dict, gas: int, world: int, default_seed: int = 0) -> dict:
    """Rows (one per contender) for one link rate: throughput from the best-of-seeds run (median
    beside), loss figures per seed paired with ZeRO-1's and summarised over the seeds."""
    runs, comm = block["runs"], block["comm"]
    base = runs.get("zero1")
    sync = runs.get("sync")
    base_seeds = seed_runs(block, "zero1", default_seed)
    rows = {}
    for label in ordered(runs):
        s = runs[label]
        rps = rounds_per_step(label, s)
        t_round = s["step_time_s"] / rps
        mb_round = s["samples"] / s["steps"] / world / s_micro(s) / rps if s["steps"] else 0.0
        t_cmp = mb_round * comp["t_mb_mean"]
        t_comm = comm["t_comm_s"] + (gas - 1) * comm["t_reduce_s"] * (label == "zero2")
        p20 = step_time_p20(s)
        mine = seed_runs(block, label, default_seed)
        pairs = sd.paired(mine, base_seeds, _pair_figures)
        fig = {k: sd.spread(p[k] for p in pairs.values()) for k in next(iter(pairs.values()), {})}
        val = sd.spread(x["val_loss"] for x in mine.values())
        rows[label] = {
            "step_time_s": s["step_time_s"],
            "step_time_p20_s": p20,
            "median_step_time_s": s.get("median_step_time_s", s["step_time_s"]),
            "x_steps_p20": step_time_p20(base) / p20 if base else None,
            "samples_per_s": s["samples_per_s"],
            "median_samples_per_s": s.get("median_samples_per_s", s["samples_per_s"]),
            "x_steps": base["step_time_s"] / s["step_time_s"] if base else None,
            "x_steps_median": base.get("median_step_time_s", base["step_time_s"])
            / s.get("median_step_time_s", s["step_time_s"])
            if base
            else None,
            "x_samples": s["samples_per_s"] / base["samples_per_s"] if base else None,
            "x_sync_steps": sync["step_time_s"] / s["step_time_s"] if sync else None,
            "vs_compute_only": s["samples_per_s"] / comp["samples_per_s"],
            "t_round_s": t_round,
            "t_compute_round_s": t_cmp,
            "t_comm_round_s": t_comm,
            "overlap_eff": max(t_cmp, t_comm) / t_round if t_round > 0 else None,
            "samples": s["samples"],
            "steps": s["steps"],
            "seeds": sorted(mine),
            "val": val,
            "val_loss": val["mean"] if val else None,
            "paired": fig,  # spreads over seeds of the _pair_figures keys
            "loss_at_base_samples": (fig.get("loss_at_base_samples") or {}).get("mean"),
            "peak_mem_mib": s["peak_mem_mib"],
            "peak_mem_seeds": [x["peak_mem_mib"] for x in mine.values()],
            "comm_wait_s": [x.get("comm_wait_s") for x in s.get("acco_stats", [])],
            "load": [s["load_before"], s["load_after"]],
            "repeats": [x["samples_per_s"] for x in s.get("repeats", [])],
            "wire_bytes_per_step": s.get("wire_bytes_per_step"),
            "job_phase_ms_per_round": job_phase_ms_per_round(s),
        }
    return rows


def job_phase_ms_per_round(s: dict) -> dict | None:
    """Where acco_ds's jobs spent their time in run ``s``: each phase's ``stats()['job_<phase>_s']`` over the
    rank's rounds, in ms, mean over the ranks; None for DeepSpeed's contenders and runs that predate the
    figures."""
    stats = [x for x in s.get("acco_stats", []) if x.get("rounds") and "job_step_s" in x]
    if not stats:
        return None
    return {p: statistics.mean(1e3 * x[f"job_{p}_s"] / x["rounds"] for x in stats) for p in JOB_PHASES}


def analyse_budget(block: dict, setup: dict, default_seed: int = 0) -> dict | None:
    """Framing (b): every contender at the token budget. Fixed contenders' runs are their runs of
    the sweep (the budget is their samples); adaptive ACCO's are its budget runs."""
    if not block["runs"]:
        return None
    budget = block.get("budget") or {}
    samples = budget.get("samples") or setup["steps"] * setup["grad_accum"] * setup["micro_batch"] * (
        setup["world"] // setup.get("tp", 1)
    )
    base = seed_runs(block, "zero1", default_seed)
    rows = {}
    for label in ordered(block["runs"]):
        mine = seed_runs(block, label, default_seed)
        how = "the sweep's run"
        if label == "acco-adaptive":
            got = {s["seed"]: s for s in budget.get("runs", [])}
            if not got:
                continue
            mine = got
            how = "; ".join(sorted({s.get("how", "budget run") for s in got.values()}))
        pairs = sd.paired(
            mine,
            base,
            lambda s, b: {
                "x_wall": b["train_s"] / s["train_s"],
                "val_gap": s["val_loss"] / b["val_loss"] - 1,
            },
        )
        rows[label] = {
            "how": how,
            "steps": sd.spread(s["steps"] for s in mine.values()),
            "samples": sd.spread(s["samples"] for s in mine.values()),
            "wall_s": sd.spread(s["train_s"] for s in mine.values()),
            "val": sd.spread(s["val_loss"] for s in mine.values()),
            "samples_per_s": sd.spread(s["samples_per_s"] for s in mine.values()),
            "x_wall": sd.spread(p["x_wall"] for p in pairs.values()),
            "val_gap": sd.spread(p["val_gap"] for p in pairs.values()),
            "schedule": [s.get("schedule") for s in mine.values()] if label == "acco-adaptive" else None,
        }
    return {"samples": samples, "rows": rows}


def s_micro(s: dict) -> int:
    """Micro-batch size of a run (samples per micro-batch), from its records."""
    last = s["records"][-1]
    return max(1, round(last["samples"] / max(1, last["mb_total"])))


def balanced_rate(results: dict, comp: dict, gas: int) -> str:
    """The swept rate whose T_comm is closest (in ratio) to the compute of one acco round."""
    t_round = comp["t_mb_mean"] * gas / 2
    rates = list(results["rates"])
    return min(rates, key=lambda r: abs(math.log(results["rates"][r]["comm"]["t_comm_s"] / t_round)))


def analyse(results: dict, goals: Callable[[dict, dict], list]) -> dict:
    """Every figure of ``results`` (a raw JSON's ``results``), with ``goals(analysis, results)``
    under ``"goals"``."""
    setup = results["setup"]
    gas, world = setup["grad_accum"], setup["world"] // setup.get("tp", 1)
    seed0 = setup.get("seed", 0)
    comp = compute_only(results)
    tables = {rate: analyse_rate(block, comp, gas, world, seed0) for rate, block in results["rates"].items()}
    budget = {rate: analyse_budget(block, setup, seed0) for rate, block in results["rates"].items()}
    out = {"compute_only": comp, "tables": tables, "budget": {r: b for r, b in budget.items() if b}}
    if tables:
        out["balanced_rate"] = balanced_rate(results, comp, gas)
        out["slowest_rate"] = min(results["rates"], key=link.rate_mbit)
    out["seeds"] = results.get("seeds") or [seed0]
    out["hetero"] = analyse_hetero(results.get("hetero"), seed0)
    out["goals"] = goals(out, results)
    return out


def analyse_hetero(h: dict | None, default_seed: int = 0) -> dict | None:
    if not h:
        return None
    rows = {}
    base = h["runs"].get("zero1")
    for label, s in h["runs"].items():
        mine = seed_runs(h, label, default_seed)
        rows[label] = {
            "rank_samples_per_s": s["rank_samples_per_s"],
            "samples_per_s": s["samples_per_s"],
            "x_samples": s["samples_per_s"] / base["samples_per_s"] if base else None,
            "steps_per_s": 1.0 / s["step_time_s"],
            "x_steps": base["step_time_s"] / s["step_time_s"] if base else None,
            "step_time_s": s["step_time_s"],
            "rank_micro_batches": s["rank_micro_batches"],
            "val_loss": s["val_loss"],
            "val": sd.spread(x["val_loss"] for x in mine.values()),
            "slow_extra_s": s["slow_extra_s"],
            "repeats": [x["samples_per_s"] for x in s.get("repeats", [])],
        }
    return {"rate": h["rate"], "slow_rank": h["slow_rank"], "slow_factor": h["slow_factor"], "rows": rows}
