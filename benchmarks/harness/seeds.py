"""Seed statistics of the benchmarks' loss verdicts.

Contract:
- A loss figure is measured once per seed; the seed fixes the model's initialisation and the data
  order (``acco_ds.data.batches``: micro-batch i of data-parallel rank r under seed s is the same
  for every contender), so two contenders' figures of the same seed are a pair.
- ``spread(values)`` summarises one figure over the seeds: n, mean, min, max, sd (sample sd; 0 for
  one value), the values. ``paired(a, b, fn)`` applies ``fn(a_s, b_s)`` to the seeds both have.
- ``verdict_within(values, lo, hi)`` and ``verdict_at_most(values, bound)`` judge a figure
  against its spread: ``met`` when every seed's value satisfies the bound, ``MISSED`` when the mean
  does not, ``not shown`` when the mean does but some seed does not (the spread crosses the
  bound). With fewer than ``MIN_SEEDS`` values the verdict says how many seeds it rests on.
- ``fmt(s, ...)`` renders "mean [min, max] (n seeds)".
"""

from __future__ import annotations

import math
import statistics
from typing import Callable, Iterable

MIN_SEEDS = 3  # loss verdicts over at least 3 seeds


def spread(values: Iterable) -> dict | None:
    """n, mean, min, max, sd of the finite values (None when there is none). ``inf`` values (a
    target never reached) are kept in ``values`` and counted in ``n_inf``; the mean is then inf."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None
    finite = [v for v in vals if math.isfinite(v)]
    n_inf = len(vals) - len(finite)
    mean = statistics.mean(finite) if finite and not n_inf else math.inf
    return {
        "n": len(vals),
        "mean": mean,
        "min": min(vals),
        "max": max(vals),
        "sd": statistics.stdev(finite) if len(finite) > 1 and not n_inf else 0.0,
        "values": vals,
        "n_inf": n_inf,
    }


def paired(a: dict, b: dict, fn: Callable) -> dict:
    """{seed: fn(a[seed], b[seed])} over the seeds both dicts have (None results dropped)."""
    out = {}
    for seed in sorted(set(a) & set(b)):
        v = fn(a[seed], b[seed])
        if v is not None:
            out[seed] = v
    return out


def _seeds_note(n: int) -> str:
    return "" if n >= MIN_SEEDS else f" ({n} seed{'s' if n != 1 else ''}: fewer than {MIN_SEEDS}, no verdict)"


def _judge(ok_each: list, ok_mean: bool, n: int) -> str:
    if n < MIN_SEEDS:
        base = "met" if all(ok_each) else ("MISSED" if not ok_mean else "not shown")
        return f"indicative: {base}{_seeds_note(n)}"
    if all(ok_each):
        return "met"
    if not ok_mean:
        return "MISSED"
    return "not shown (the spread crosses the bound)"


def verdict_within(s: dict | None, lo: float, hi: float) -> str:
    """Every seed's value in [lo, hi]: met; the mean outside: MISSED; else not shown."""
    if not s:
        return "n/a"
    ok_each = [lo <= v <= hi for v in s["values"]]
    return _judge(ok_each, lo <= s["mean"] <= hi, s["n"])


def verdict_at_most(s: dict | None, bound: float) -> str:
    """Every seed's value <= bound: met; the mean above: MISSED; else not shown."""
    if not s:
        return "n/a"
    return _judge([v <= bound for v in s["values"]], s["mean"] <= bound, s["n"])


def verdict_at_least(s: dict | None, bound: float) -> str:
    if not s:
        return "n/a"
    return _judge([v >= bound for v in s["values"]], s["mean"] >= bound, s["n"])


def combine(*verdicts: str) -> str:
    """The weakest of several verdicts (MISSED < not shown < n/a < met)."""
    for word in ("MISSED", "not shown", "n/a"):
        for v in verdicts:
            if word in v:
                return v
    return verdicts[0] if verdicts else "n/a"


def fmt(s: dict | None, spec: str = ".4f", scale: float = 1.0, suffix: str = "", sign: bool = False) -> str:
    """'mean [min, max] (n seeds)' of a spread (values x scale); '-' for none."""
    if not s:
        return "-"
    f = ("+" if sign else "") + spec

    def one(v: float) -> str:
        return "not reached" if math.isinf(v) else format(v * scale, f) + suffix

    if s["n"] == 1:
        return f"{one(s['values'][0])} (1 seed)"
    return f"{one(s['mean'])} [{one(s['min'])}, {one(s['max'])}] ({s['n']} seeds)"


def fmt_sd(s: dict | None, spec: str = ".4f") -> str:
    """'mean +- sd (n seeds)'."""
    if not s:
        return "-"
    return f"{format(s['mean'], spec)} +- {format(s['sd'], spec)} ({s['n']} seeds)"
