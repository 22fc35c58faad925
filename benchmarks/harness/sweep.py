"""The sweep machinery shared by the e2e and topology benchmarks: seed rounds, retries, failures.

Contract:
- ``seed_rounds(run, labels, seeds, failed, where, log)`` runs ``run(label, seed)`` for every
  seed and contender, interleaved (seed 0: a, b, c; seed 1: a, b, c; ...). Each seed is a paired
  repetition: the seed fixes the model's initialisation and the data order, the same for every
  contender, so the loss figures of one seed compare like with like, and the seeds double as the
  repeats of the throughput figures. Returns ``{label: [summary + {"seed"}]}`` with the runs that
  ran; a run that fails twice is recorded in ``failed`` and the sweep goes on.
- ``best_of(runs)``: the run with the highest samples/s (the least disturbed by other jobs on a
  shared machine) with every run's figures (seed, samples/s, step time, load, val loss) kept in
  ``repeats``, and the median samples/s and step time beside it.
- ``rate_block(rounds)``: a rate's block of the results: best-of per contender and every seed's run.
- ``budget_runs(setup, block, rate, failed, log, run)``: framing (b) at one rate, adaptive ACCO at
  the token budget (``runs.budget_schedule``), one run per seed of its sweep runs.
- ``attempt(fn)``: ``(fn(), None)``, retried once on a launch failure or a run whose records
  cannot be summarised; ``(None, why)`` after two failures (``why``: the launch error in one line).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from typing import Callable

from acco_ds.cli.launch import LaunchError
from benchmarks.harness import runs


def seeds_arg(text: str) -> list:
    """The ``--seeds`` option: comma-separated integers, at least one, none twice."""
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds {text!r}: comma-separated integers, e.g. 0,1,2") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"--seeds {text!r}: at least one seed, none twice")
    return seeds


REUSE_BUDGET = 1.05  # adaptive's full-length run stands for its budget run within 5% of the samples


def logger(name: str) -> Callable[[str], None]:
    def log(msg: str) -> None:
        print(f"[{name} {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    return log


def fail(failed: list, label: str, where: str, why: str, log: Callable) -> None:
    """Record a contender (or reference run) that could not run; the benchmark exits non-zero."""
    failed.append({"label": label, "where": where, "why": why})
    log(f"FAILED {label} ({where}): {why}")


def best_of(runs: list) -> dict:
    best = dict(max(runs, key=lambda s: s["samples_per_s"]))
    best["repeats"] = [
        {
            "seed": s.get("seed"),
            "samples_per_s": s["samples_per_s"],
            "step_time_s": s["step_time_s"],
            "val_loss": s.get("val_loss"),
            "load": [s["load_before"], s["load_after"]],
        }
        for s in runs
    ]
    best["median_samples_per_s"] = statistics.median(s["samples_per_s"] for s in runs)
    best["median_step_time_s"] = statistics.median(s["step_time_s"] for s in runs)
    return best


def seed_rounds(
    run: Callable,
    labels: list,
    seeds: list,
    failed: list,
    where: str,
    log: Callable,
    after_seed: Callable | None = None,
) -> dict:
    done: dict = {label: [] for label in labels}
    for i, seed in enumerate(seeds):
        for label in labels:
            s, err = attempt(lambda label=label, seed=seed: run(label, seed), log)
            if s is None:
                fail(failed, label, f"{where} seed {seed}", f"failed twice ({err})", log)
                continue
            s = dict(s, seed=seed)
            done[label].append(s)
            log(
                f"{where} {label} (seed {seed}, {i + 1}/{len(seeds)}): {s['step_time_s']:.3f} s/step, "
                f"{s['samples_per_s']:.1f} samples/s, per replica {[round(x, 1) for x in s['rank_samples_per_s']]}, "
                f"val {s['val_loss']:.4f}, {s['train_s']:.1f} s, load {s['load_before']:.1f}->{s['load_after']:.1f}"
            )
        if after_seed is not None:
            after_seed(i)
    return {label: runs for label, runs in done.items() if runs}


def attempt(fn: Callable, log: Callable) -> tuple:
    why = ""
    for n in (1, 2):
        try:
            return fn(), None
        except (LaunchError, ValueError) as err:
            why = one_line(err) if isinstance(err, LaunchError) else f"{type(err).__name__}: {err}"
            log(f"run failed (attempt {n}/2): {why}")
    return None, why


RANK_PREFIX = re.compile(r"^\[rank\d+\]:? ?")
ERROR_LINE = re.compile(r"^([\w.]+(?:Error|Exception|Exit)\b.*)$")


def one_line(err: LaunchError) -> str:
    """The launch failure in one line: its first line, plus the last exception the ranks' log tail
    shows (with its indented continuation lines: what a planted bug or a bad option raised), else
    the tail's last line."""
    lines = [x for x in str(err).splitlines() if x.strip() and not x.startswith("command:")]
    if len(lines) < 2:
        return lines[0] if lines else "unknown failure"
    tail = [RANK_PREFIX.sub("", x) for x in lines[1:]]
    hits = [i for i, x in enumerate(tail) if ERROR_LINE.match(x)]
    if not hits:
        return f"{lines[0]} {tail[-1].strip()}"
    i = hits[-1]
    more = []
    for x in tail[i + 1 :]:
        if not x.startswith((" ", "\t")):
            break
        more.append(x.strip())
    return " ".join([lines[0], tail[i].strip(), *more])


def failure_summary(results: dict) -> str:
    """One line per run that could not run (empty when every run did), naming the contender."""
    return "\n".join(f"  {f['label']} ({f['where']}): {f['why']}" for f in results.get("failed", []))


def compute_bound(setup, results: dict, failed: list, tag: str, log) -> None:
    """One run of the compute-only bound (``runs.run_compute_only``), appended to
    ``results["compute"]``; failing twice, recorded in ``failed``."""
    s, err = attempt(lambda: runs.run_compute_only(setup, tag), log)
    if s is None:
        fail(failed, "compute-only", tag.lstrip("-"), f"failed twice ({err}; see {setup.work})", log)
        return
    results["compute"].append(s)
    log(
        f"compute-only{tag}: {s['samples_per_s']:.1f} samples/s (sum of the replicas' "
        f"{[round(x, 1) for x in s['rank_samples_per_s']]}), t_mb {[round(t, 4) for t in s['t_mb']]}, "
        f"load {s['load_before']:.1f}->{s['load_after']:.1f}"
    )


def exit_status(name: str, results: dict, out) -> int:
    """1 after naming on stderr every run that could not run (the others' results are in ``out``),
    0 when every run ran."""
    failures = failure_summary(results)
    if not failures:
        return 0
    labels = sorted({f["label"] for f in results["failed"]})
    print(
        f"{name}: {len(results['failed'])} run(s) could not run ({', '.join(labels)}); the results of the "
        f"others are in {out}:\n{failures}",
        file=sys.stderr,
    )
    return 1


def rate_block(rounds: dict) -> dict:
    """A rate's (or the heterogeneous case's) runs: best-of-seeds per contender and every seed's run."""
    return {
        "runs": {label: best_of(runs) for label, runs in rounds.items()},
        "seeds": rounds,
    }


def budget_runs(setup, block: dict, rate: str, failed: list, log, run) -> dict:
    """Framing (b) at one rate: adaptive ACCO at the token budget, one run per seed of its sweep
    runs (``run(seed, schedule)`` launches one; its full run stands for it within 5%)."""
    budget = setup.budget_samples
    out = {"samples": budget, "runs": []}
    for full in block["seeds"].get("acco-adaptive", []):
        seed = full["seed"]
        if full["samples"] <= REUSE_BUDGET * budget:
            out["runs"].append(dict(full, how=f"its {full['steps']}-step run (within 5% of the budget)"))
            continue
        schedule = runs.budget_schedule(setup, full["samples"] / full["steps"])
        s, err = attempt(lambda seed=seed, schedule=schedule: run(seed, schedule), log)
        if s is None:
            fail(failed, "acco-adaptive", f"{rate} budget seed {seed}", f"failed twice ({err})", log)
            continue
        s = dict(s, seed=seed, schedule=schedule, how="budget run")
        out["runs"].append(s)
        log(
            f"{rate} acco-adaptive at the budget (seed {seed}): {schedule['steps']} steps (warm-up "
            f"{schedule['warmup_lr_steps']}), {s['samples']} samples, {s['train_s']:.1f} s, val {s['val_loss']:.4f}"
        )
    return out


def refuse(benchmark: str, cannot: str, why: str, needs: str) -> int:
    """Say on stderr that this machine cannot provide the benchmark's network (``cannot``, because
    ``why``) and that the benchmark needs ``needs`` and never fakes it; returns the exit status 2."""
    print(
        f"benchmarks.{benchmark}: cannot {cannot} on this machine: {why}. The benchmark needs {needs} and does "
        "not fake one; stopping.",
        file=sys.stderr,
    )
    return 2
