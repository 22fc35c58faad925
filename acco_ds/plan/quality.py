"""acco-plan's measured samples-to-loss factor: from a samples/s speed-up to a time-to-the-same-loss speed-up.

ACCO's steps are not quite ZeRO-1's: the quality study (``python -m benchmarks.quality``) measures, per setting, the
optimizer steps acco needs to reach sync's (ZeRO-1's math) final validation loss over sync's own, ``f``
(``benchmarks.quality.factors`` writes them to ``quality_factors.json`` beside this module, package data). With
fixed accumulation a step holds the same samples, so ACCO's time to ZeRO-1's loss is ``f`` x its steps at its step
time, and the speed-up in time to the same loss is ``samples/s speed-up / f``.

Contract:
- ``load(path=None) -> dict``: the factors file (default: the package's ``quality_factors.json``); ``ValueError``
  naming the key when one the plan reads is missing.
- ``choose(factors, tokens_per_step=None, steps=None, mode="acco", peek_lr_scale=1.0) -> dict``: the regime of the
  study closest to the plan: among the settings run at the base setting's peak LR (the plan knows no LR) that
  measured the run, the one nearest in ``|ln(tokens ratio)|`` (when ``tokens_per_step`` is known) plus
  ``|ln(steps ratio)|`` (when ``steps`` is); the base setting on a tie and when the plan knows neither. The run is
  ``mode``, or with ``mode="acco"`` and ``peek_lr_scale != 1`` the study's variant whose only knob is that
  ``peek_lr_scale`` (``variant_knobs``) where it was measured at that LR, else acco's (``run_note`` says which).
  The factor: the setting's within-run factor; where that is only a lower bound (a seed never reached sync's final
  loss within the run) and the setting's family (the settings differing only in steps) holds an across-lengths
  factor for the run, that factor at the family's length closest to ``steps`` (else to the base setting's steps).
  Returns the setting's figures, ``factor`` (mean / min / max over seeds), ``basis`` (``within_run`` /
  ``across_lengths``), ``bound`` (None: a measured number; ``lower`` / ``upper``: only a bound; ``both``: the seeds
  disagree), ``reached`` (``bound`` is None), ``within_run`` and ``across_lengths`` (the figures of both; the latter
  None where not used), ``run`` / ``variant`` / ``run_note``, ``why`` (how it was chosen) and ``source``.
- ``verdict(speedup, regime) -> dict``: ``speedup`` (ACCO's samples/s over ZeRO-1's) with the regime's factor:
  ``time_speedup = speedup / f`` when ``reached``, else None (unknown); ``time_speedup_at_least = speedup / f``
  where ``f`` is an upper bound (``bound == "upper"``), else None.
- ``describe(regime) -> str``: the regime in words ("quality study run1, setting base: 150 steps, 4,096 tokens/step,
  acco needs 1.07x the steps of ZeRO-1 ...", or that acco never reached ZeRO-1's final loss there, and what the
  runs of other lengths say: "across run lengths: acco's 240-step run reaches sync's 150-step loss, f = 1.60x").
- ``unknown_why(regime) -> str`` / ``basis_note(regime) -> str``: the clauses ``recommend`` says where the factor is
  not a number / which factor it used.
"""

from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path

FACTORS_FILE = "quality_factors.json"
MAX_PEEK_LR_SCALE = 4.0
"""``acco_ds.config.MAX_PEEK_LR_SCALE`` (the planner stands alone; a test keeps the two equal)."""


def _need(d: dict, key: str, where: str):
    if not isinstance(d, dict) or key not in d:
        raise ValueError(f"acco-plan's quality factors ({where}): no {key!r}; regenerate the file with "
                         "python -m benchmarks.quality.factors")  # fmt: skip
    return d[key]


def load(path: str | Path | None = None) -> dict:
    """The factors file (module docstring), checked for what ``choose`` reads."""
    if path is None:
        text = resources.files("acco_ds.plan").joinpath(FACTORS_FILE).read_text()
        where = f"acco_ds/plan/{FACTORS_FILE}"
    else:
        text, where = Path(path).read_text(), str(path)
    doc = json.loads(text)
    for key in ("source", "base_setting", "settings"):
        _need(doc, key, where)
    if doc["base_setting"] not in doc["settings"]:
        raise ValueError(
            f"acco-plan's quality factors ({where}): base_setting {doc['base_setting']!r} is not a setting"
        )
    for name, s in doc["settings"].items():
        for key in ("steps", "tokens_per_step", "peak_lr", "modes"):
            _need(s, key, f"{where}: settings[{name!r}]")
    for key, fam in (doc.get("families") or {}).items():
        for run, m in _need(fam, "modes", f"{where}: families[{key!r}]").items():
            _need(m, "at", f"{where}: families[{key!r}].modes[{run!r}]")
    doc["_file"] = where
    return doc


def _peek_variant(factors: dict, scale: float) -> str | None:
    """The study's variant that is acco with only ``peek_lr_scale`` changed, to ``scale``; None without one."""
    for name, knobs in (factors.get("variant_knobs") or {}).items():
        only_peek = isinstance(knobs, dict) and set(knobs) == {"peek_lr_scale"}
        if only_peek and math.isclose(float(knobs["peek_lr_scale"]), scale):
            return name
    return None


def _candidates(factors: dict, run: str) -> list:
    settings, base = factors["settings"], factors["base_setting"]
    lr = settings[base]["peak_lr"]
    return [n for n, s in settings.items() if run in s["modes"] and math.isclose(s["peak_lr"], lr)]


def _across(factors: dict, setting: dict, run: str, steps: int | None) -> dict | None:
    """The across-lengths factor of ``run`` in ``setting``'s family at the length closest to ``steps`` (else to
    the base setting's), or None where the file has none."""
    key = setting.get("family")
    fam = (factors.get("families") or {}).get(key) if key else None
    m = (fam or {}).get("modes", {}).get(run)
    if not m or not m["at"]:
        return None
    target = steps or factors["settings"][factors["base_setting"]]["steps"]
    n = min(m["at"], key=lambda k: (round(abs(math.log(target / int(k))), 12), int(k)))
    a = m["at"][n]
    steps_of = [v["steps"] for v in a["seeds"].values() if v.get("steps") is not None]
    return {
        "family": key,
        "length": int(n),
        "setting": a.get("setting"),
        "factor": a["factor"],
        "lower_bound": a["lower_bound"],
        "upper_bound": a["upper_bound"],
        "lower_bound_seeds": a.get("lower_bound_seeds", []),
        "upper_bound_seeds": a.get("upper_bound_seeds", []),
        "reach_steps_mean": a["factor"]["mean"] * int(n),
        "reached_seeds": len(steps_of),
        "lengths": m.get("lengths", []),
        "seeds": m.get("seeds", []),
    }


def choose(
    factors: dict,
    tokens_per_step: float | None = None,
    steps: int | None = None,
    mode: str = "acco",
    peek_lr_scale: float = 1.0,
) -> dict:
    """The study's regime closest to the plan (module docstring)."""
    settings, base = factors["settings"], factors["base_setting"]
    run, variant, run_note = mode, None, None
    if mode == "acco" and not math.isclose(peek_lr_scale, 1.0):
        variant = _peek_variant(factors, peek_lr_scale)
        if variant and _candidates(factors, variant):
            run = variant
            run_note = (
                f"the factor is the study's variant {variant}'s (acco with peek_lr_scale={peek_lr_scale:g}, "
                "as --peek-lr-scale sets)"
            )
        else:
            variant = None
            run_note = (
                f"the factor is acco's as specified (peek_lr_scale 1): the study measured no variant with "
                f"peek_lr_scale={peek_lr_scale:g} (--peek-lr-scale) at the base setting's LR"
            )
    candidates = _candidates(factors, run)
    if not candidates:
        raise ValueError(
            f"acco-plan's quality factors ({factors.get('_file')}): no setting measured mode {mode!r}"
        )
    known = [x for x in (tokens_per_step, steps) if x]
    if not known:
        name = base if base in candidates else candidates[0]
        why = (
            "the study's base setting, as the plan knows neither its tokens per step (--seq-len or "
            "--tokens-per-micro-batch) nor its run length (--train-steps)"
        )
    else:

        def distance(n: str) -> float:
            s, d = settings[n], 0.0
            if tokens_per_step:
                d += abs(math.log(tokens_per_step / s["tokens_per_step"]))
            if steps:
                d += abs(math.log(steps / s["steps"]))
            return d

        def measured(n: str) -> bool:
            m = settings[n]["modes"][run]
            if not m["lower_bound"]:
                return True
            across = _across(factors, settings[n], run, steps)
            return bool(across) and not across["lower_bound"]

        pool = [n for n in candidates if measured(n)] or candidates
        name = min(pool, key=lambda n: (round(distance(n), 12), n != base, n))
        chosen = settings[name]
        gave = [
            f"{value:,.0f} {what} ({value / chosen[key]:.3g}x this setting's)"
            for value, what, key in (
                (tokens_per_step, "tokens per step", "tokens_per_step"),
                (steps, "steps", "steps"),
            )
            if value
        ]
        why = (
            "the study's setting closest to the plan's "
            + " and ".join(gave)
            + (" among those with a measured factor" if len(pool) < len(candidates) else "")
        )
    s, m = settings[name], settings[name]["modes"][run]
    within = {
        "factor": m["factor"],
        "lower_bound": m["lower_bound"],
        "not_reached_seeds": m["not_reached_seeds"],
    }
    across = _across(factors, s, run, steps) if m["lower_bound"] else None
    if across:
        used, basis = across["factor"], "across_lengths"
        low, up = across["lower_bound"], across["upper_bound"]
        bound = "both" if low and up else "lower" if low else "upper" if up else None
    else:
        used, basis, bound = m["factor"], "within_run", "lower" if m["lower_bound"] else None
    return {
        "study": factors["source"].get("study"),
        "setting": name,
        "mode": mode,
        "run": run,
        "variant": variant,
        "run_note": run_note,
        "steps": s["steps"],
        "tokens_per_step": s["tokens_per_step"],
        "peak_lr": s["peak_lr"],
        "factor": used,
        "basis": basis,
        "bound": bound,
        "reached": bound is None,
        "within_run": within,
        "across_lengths": across,
        "not_reached_seeds": m["not_reached_seeds"],
        "sync_final_val_loss_mean": m.get("sync_final_val_loss_mean"),
        "best_val_loss_mean": m.get("best_val_loss_mean"),
        "why": why,
        "file": factors.get("_file"),
        "source": factors["source"],
    }


def verdict(speedup: float | None, regime: dict) -> dict:
    """ACCO's time-to-the-same-loss speed-up over ZeRO-1 from its samples/s speed-up (module docstring)."""
    f = regime["factor"]["mean"]
    usable = speedup is not None and f > 0
    return {
        "samples_speedup": speedup,
        "factor": f,
        "factor_basis": regime.get("basis", "within_run"),
        "time_speedup": speedup / f if usable and regime["reached"] else None,
        "time_speedup_at_least": speedup / f if usable and regime.get("bound") == "upper" else None,
    }


def _who(r: dict) -> str:
    return r["mode"] if r.get("run", r["mode"]) == r["mode"] else f"{r['mode']}'s variant {r['run']}"


def _across_words(r: dict) -> str:
    """What the runs of other lengths say (``across_lengths``), after "across run lengths: "."""
    a, who, f = r["across_lengths"], _who(r), r["across_lengths"]["factor"]
    n, k = a["length"], f["n"]
    spread = f" [{f['min']:.2f}x, {f['max']:.2f}x]" if k > 1 else ""
    seeds = f"{k} seed{'s' if k != 1 else ''}"
    runs = "/".join(str(x) for x in a["lengths"])
    if r["bound"] == "both":
        return (
            f"the seeds disagree at sync's {n}-step loss (a lower bound in seeds "
            f"{', '.join(a['lower_bound_seeds'])}, an upper bound in {', '.join(a['upper_bound_seeds'])}; the "
            f"{runs}-step runs): not known"
        )
    if r["bound"] == "lower":
        return (
            f"even {who}'s {max(a['lengths'])}-step run stays above sync's {n}-step loss in "
            f"{len(a['lower_bound_seeds'])} of {k} seeds (the {runs}-step runs): f > {f['mean']:.2f}x, how much more "
            "is not measured"
        )
    if r["bound"] == "upper":
        return (
            f"{who}'s shortest run, {min(a['lengths'])} steps, already reaches sync's {n}-step loss in "
            f"{len(a['upper_bound_seeds'])} of {k} seeds (the {runs}-step runs): f <= {f['mean']:.2f}x{spread}"
        )
    return (
        f"{who}'s {a['reach_steps_mean']:,.0f}-step run reaches sync's {n}-step loss, f = {f['mean']:.2f}x{spread} "
        f"(mean of {seeds}; the {runs}-step runs' final losses, interpolated in log steps)"
    )


def describe(regime: dict) -> str:
    """The regime and its factor in words (module docstring)."""
    r = regime
    within = r.get("within_run") or {"factor": r["factor"], "lower_bound": not r["reached"]}
    f, who = within["factor"], _who(r)
    head = (
        f"quality study {r['study']}, setting {r['setting']}: {r['steps']} steps, {r['tokens_per_step']:,} "
        f"tokens/step, peak LR {r['peak_lr']:g}, chosen as {r['why']}"
    )
    n = f["n"]
    if not within["lower_bound"]:
        spread = f" [{f['min']:.2f}x, {f['max']:.2f}x]" if n > 1 else ""
        said = (
            f"{who} needs {f['mean']:.2f}x the steps of ZeRO-1 to reach its final validation loss "
            f"(mean of {n} seed{'s' if n != 1 else ''}{spread})"
        )
    else:
        short = len(r["not_reached_seeds"])
        best = r.get("best_val_loss_mean")
        target = r.get("sync_final_val_loss_mean")
        losses = f" (best {best:.4f} against {target:.4f}, means over the seeds)" if best and target else ""
        said = (
            f"{who} never reached sync's (ZeRO-1's math) final validation loss within the {r['steps']} steps "
            f"in {short} of {n} seeds{losses}: it needs more than {f['mean']:.2f}x the steps of ZeRO-1"
        )
        if r.get("across_lengths"):
            said += f"; across run lengths: {_across_words(r)}"
        else:
            said += ", how many more is not measured (no runs of other lengths in this setting's family)"
    note = f"; {r['run_note']}" if r.get("run_note") else ""
    src = r["source"]
    return (
        f"{head}; {said}{note}. Factor from {r['file']} (benchmarks.quality.factors on {src.get('path')}, "
        f"{src.get('date')})"
    )


def unknown_why(regime: dict) -> str:
    """Why the regime's factor is no number, as a clause ("in the quality study's setting base ACCO never ...")."""
    r, a = regime, regime.get("across_lengths")
    where = f"in the quality study's setting {r['setting']}"
    never = f"{where} ACCO never reached ZeRO-1's final validation loss within its {r['steps']} steps"
    if not a or r["bound"] is None:
        return never
    if r["bound"] == "lower":
        return f"{never}, nor did its {max(a['lengths'])}-step run reach sync's {a['length']}-step loss"
    if r["bound"] == "upper":
        return (
            f"{never}, but its {min(a['lengths'])}-step run already reached sync's {a['length']}-step loss (f at "
            f"most {a['factor']['mean']:.2f}x, only a bound)"
        )
    return f"{never}, and across run lengths its seeds give bounds both ways"


def basis_note(regime: dict) -> str:
    """'' for a within-run factor; else how the across-lengths factor was read (after the setting's name)."""
    a = regime.get("across_lengths")
    if regime.get("basis") != "across_lengths" or not a:
        return ""
    return f", across run lengths: its {a['reach_steps_mean']:,.0f}-step run reaches sync's {a['length']}-step loss"
