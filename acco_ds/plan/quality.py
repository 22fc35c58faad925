"""acco-plan's measured samples-to-loss factor: from a samples/s speed-up to a time-to-the-same-loss speed-up.

ACCO's steps are not quite ZeRO-1's: the quality study (``python -m benchmarks.quality``) measures, per setting, the
optimizer steps acco needs to reach sync's (ZeRO-1's math) final validation loss over sync's own, ``f``
(``benchmarks.quality.factors`` writes them to ``quality_factors.json`` beside this module, package data). With
fixed accumulation a step holds the same samples, so ACCO's time to ZeRO-1's loss is ``f`` x its steps at its step
time, and the speed-up in time to the same loss is ``samples/s speed-up / f``.

Contract:
- ``load(path=None) -> dict``: the factors file (default: the package's ``quality_factors.json``); ``ValueError``
  naming the key when one the plan reads is missing.
- ``choose(factors, tokens_per_step=None, steps=None, mode="acco") -> dict``: the regime of the study closest to
  the plan: among the settings run at the base setting's peak LR (the plan knows no LR) that measured ``mode``, the
  one nearest in ``|ln(tokens ratio)|`` (when ``tokens_per_step`` is known) plus ``|ln(steps ratio)|`` (when
  ``steps`` is); the base setting on a tie and when the plan knows neither. Returns the setting's figures, the
  mode's ``factor`` (mean / min / max over seeds), ``reached`` (every seed reached sync's final loss: the factor is a
  measured number; else it is only a lower bound), ``why`` (how it was chosen) and ``source``.
- ``verdict(speedup, regime) -> dict``: ``speedup`` (ACCO's samples/s over ZeRO-1's) with the regime's factor:
  ``time_speedup = speedup / f`` when ``reached``, else None (unknown: ACCO never got to ZeRO-1's loss in the
  study's steps there).
- ``describe(regime) -> str``: the regime in words ("quality study run1, setting base: 150 steps, 4,096 tokens/step,
  acco needs 1.07x the steps of ZeRO-1 ...", or that acco never reached ZeRO-1's final loss there).
"""

from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path

FACTORS_FILE = "quality_factors.json"


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
    doc["_file"] = where
    return doc


def choose(
    factors: dict, tokens_per_step: float | None = None, steps: int | None = None, mode: str = "acco"
) -> dict:
    """The study's regime closest to the plan (module docstring)."""
    settings, base = factors["settings"], factors["base_setting"]
    lr = settings[base]["peak_lr"]
    candidates = [n for n, s in settings.items() if mode in s["modes"] and math.isclose(s["peak_lr"], lr)]
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

        name = min(candidates, key=lambda n: (round(distance(n), 12), n != base, n))
        chosen = settings[name]
        gave = [
            f"{value:,.0f} {what} ({value / chosen[key]:.3g}x this setting's)"
            for value, what, key in (
                (tokens_per_step, "tokens per step", "tokens_per_step"),
                (steps, "steps", "steps"),
            )
            if value
        ]
        why = "the study's setting closest to the plan's " + " and ".join(gave)
    s, m = settings[name], settings[name]["modes"][mode]
    return {
        "study": factors["source"].get("study"),
        "setting": name,
        "mode": mode,
        "steps": s["steps"],
        "tokens_per_step": s["tokens_per_step"],
        "peak_lr": s["peak_lr"],
        "factor": m["factor"],
        "reached": not m["lower_bound"],
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
    known = regime["reached"] and speedup is not None and f > 0
    return {"samples_speedup": speedup, "factor": f, "time_speedup": speedup / f if known else None}


def describe(regime: dict) -> str:
    """The regime and its factor in words (module docstring)."""
    r, f = regime, regime["factor"]
    head = (
        f"quality study {r['study']}, setting {r['setting']}: {r['steps']} steps, {r['tokens_per_step']:,} "
        f"tokens/step, peak LR {r['peak_lr']:g}, chosen as {r['why']}"
    )
    n = f["n"]
    if r["reached"]:
        spread = f" [{f['min']:.2f}x, {f['max']:.2f}x]" if n > 1 else ""
        said = (
            f"{r['mode']} needs {f['mean']:.2f}x the steps of ZeRO-1 to reach its final validation loss "
            f"(mean of {n} seed{'s' if n != 1 else ''}{spread})"
        )
    else:
        short = len(r["not_reached_seeds"])
        best = r.get("best_val_loss_mean")
        target = r.get("sync_final_val_loss_mean")
        losses = f" (best {best:.4f} against {target:.4f}, means over the seeds)" if best and target else ""
        said = (
            f"{r['mode']} never reached sync's (ZeRO-1's math) final validation loss within the {r['steps']} steps "
            f"in {short} of {n} seeds{losses}: it needs more than {f['mean']:.2f}x the steps of ZeRO-1, how many "
            "more is not measured"
        )
    src = r["source"]
    return (
        f"{head}; {said}. Factor from {r['file']} (benchmarks.quality.factors on {src.get('path')}, "
        f"{src.get('date')})"
    )
