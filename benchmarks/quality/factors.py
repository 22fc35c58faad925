"""acco-plan's samples-to-loss factors, from the quality study's results (``python -m benchmarks.quality``).

    python -m benchmarks.quality.factors --from-json benchmarks/results/quality/run1/quality.json \\
        --out acco_ds/plan/quality_factors.json

The runs measured against sync: every run name other than ``sync`` found in a seed, the modes first (``MODES``:
acco, dpu), then acco's variants of the study in the order first seen (``peek_lr_x1.5``, ``split_q``, ...;
``variant_knobs`` gives each one's knobs, copied from ``results.setup.variant_knobs``: the variant is acco with
those knobs changed). ``runs`` lists them in that order.

**Within a run** (``settings[name].modes[run]``). The factor of a run in a setting, per seed: ``f = (the optimizer
steps the run needs to reach sync's FINAL validation loss) / (the steps sync itself needs to reach it)``, both the
first crossing of their validation curves, interpolated between the evaluations on ``val_step``
(``acco_ds.cli.time_to_loss``; sync's own is its last step unless its curve dipped there earlier), paired with the
sync run of the same seed. A run that never reached that loss within the setting's steps is recorded
``reached: false`` with the factor ``steps / sync's steps`` and ``lower_bound: true`` (the true factor is above it).
Per run: the factor's mean / min / max over the seeds, with ``lower_bound`` when any seed did not reach the loss
(the mean is then a lower bound too) and the seeds that did not. Per setting also: the tokens per optimizer step
(micro-batch x GAS x world size x context, the setting's world size where it sets one, else ``results.setup``'s),
the peak LR, the steps, the warm-up steps (the setting's, else the setup's) and ``family`` (below; None when the
setting's family has one length only).

**Across run lengths** (``families``). The LR schedule is a cosine to each run's last step, so a run cannot be
continued: where a run stays above sync's final loss, the settings that differ only in their steps answer instead.
A family is the settings sharing ``lr``, ``grad_accum``, ``micro_batch``, ``world_size`` and ``warmup_steps``
(resolved as above; its key ``"lr=0.002 gas=4 mb=8 world=2 warmup=15"``); one with two lengths or more is written:

- ``lr``, ``grad_accum``, ``micro_batch``, ``world_size``, ``warmup_steps``, ``tokens_per_step``: what it shares;
  ``settings``: ``[[steps, setting name], ...]`` by steps (the first setting at a length, where two share one).
- ``modes[run].lengths`` / ``.seeds``: the lengths the run was measured at beside sync, and the seeds present (with
  a finite sync final loss) at all of them, the only seeds used; where none is, the length with the fewest seeds is
  left out (``dropped_lengths``) until one is (two lengths at least, else the run has no entry).
- ``modes[run].final_val_loss``: ``{"sync": {seed: [S(N) per length]}, run: {seed: [M(N) per length]}}``.
- ``modes[run].at[str(N)]``, at sync length ``N``: ``setting``, ``seeds[seed]`` (``sync_final_val_loss`` S(N),
  ``steps`` N' (None for a bound), ``factor``, ``lower_bound``, ``upper_bound``, ``within_run``, ``between``: the
  two lengths interpolated between, or None), ``factor`` (mean / min / max / n over the seeds), ``lower_bound``,
  ``upper_bound``, ``lower_bound_seeds``, ``upper_bound_seeds``, ``within_run_seeds``.

The factor at sync length ``N``, per seed: ``f(N) = N' / N``, ``N'`` the run length at which the run's final loss
``M`` equals ``S(N)``: the first crossing from the shortest length upward (``M`` is not assumed monotone),
interpolated linearly in ``log(N)`` between the two measured lengths around it (at the length itself after a
non-finite loss). ``M > S(N)`` at every length: ``N_max / N``, ``lower_bound``. ``M <= S(N)`` at the shortest length
already: ``N_min / N``, ``upper_bound``; unless ``N`` is the shortest, where ``f <= 1`` and the within-run factor
(which exists then: ``M(N) <= S(N)``) is taken, ``within_run``. The mean is a lower (upper) bound when any seed's is.

The file says which results it came from (``source``: the path as given, relative to the repository when inside
it, the results' date and command, the file's sha256) and the command that wrote it; the same results file always
gives the same bytes. This command is the only way ``acco_ds/plan/quality_factors.json`` is made
(``acco_ds.plan.quality`` reads it; a test checks that the committed file is what this command writes from its
source).

Bad input exits with status 2 and a message naming the key: a results file without ``settings``, a seed without a
``sync`` run, a curve without ``val_step`` / ``val_loss``, a setup without ``world_size`` or ``context``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shlex
import statistics
import sys
from pathlib import Path

from acco_ds.cli.time_to_loss import time_to_loss

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = "sync"
MODES = ("acco", "dpu")  # the modes measured against sync, first; then any other run (a variant)
DEFAULT_OUT = ROOT / "acco_ds" / "plan" / "quality_factors.json"


class ResultsError(ValueError):
    """The results file lacks what the factors need (the message names the key)."""


def _get(d: dict, key: str, where: str):
    if not isinstance(d, dict) or key not in d:
        raise ResultsError(f"{where}: no {key!r}")
    return d[key]


def _curve(run: dict, where: str) -> tuple:
    steps, losses = _get(run, "val_step", where), _get(run, "val_loss", where)
    if not steps:
        raise ResultsError(f"{where}: 'val_step' is empty")
    return steps, losses


def seed_factor(mode_run: dict, sync_run: dict, steps: int, where: str) -> dict:
    """One seed's factor of a mode against the sync run of the same seed (module docstring)."""
    sync_steps, sync_losses = _curve(sync_run, f"{where}.sync")
    target = sync_losses[-1]
    own = time_to_loss(sync_steps, None, sync_losses, target)
    if not own.step:
        raise ResultsError(f"{where}.sync: reached its final loss at step {own.step}: no factor to divide by")
    m_steps, m_losses = _curve(mode_run, where)
    c = time_to_loss(m_steps, None, m_losses, target)
    reached = c.reached
    return {
        "sync_final_val_loss": target,
        "sync_steps_to_it": own.step,
        "reached": reached,
        "steps_to_it": c.step,
        "factor": (c.step if reached else steps) / own.step,
        "lower_bound": not reached,
        "final_val_loss": m_losses[-1],
        "best_val_loss": c.best_loss,
        "best_step": c.best_step,
    }


def run_names(settings: dict) -> list:
    """Every run name other than sync in the settings' seeds: ``MODES`` first (those present), then the rest in the
    order first seen."""
    seen = []
    for block in settings.values():
        for runs in (block.get("seeds") or {}).values() if isinstance(block, dict) else ():
            seen += [r for r in runs if r != REFERENCE and r not in seen]
    return [m for m in MODES if m in seen] + [r for r in seen if r not in MODES]


def _stats(values: list) -> dict:
    return {"mean": statistics.mean(values), "min": min(values), "max": max(values), "n": len(values)}


def setting_factors(block: dict, setup: dict, name: str, runs_order: list = MODES) -> dict:
    """The factors of one setting's block (``results.settings[name]``) and what the plan matches it by."""
    where = f"settings[{name!r}]"
    s = _get(block, "setting", where)
    steps = _get(s, "steps", f"{where}.setting")
    world = s.get("world_size") or _get(setup, "world_size", "setup")
    context = _get(setup, "context", "setup")
    mb, gas = _get(s, "micro_batch", f"{where}.setting"), _get(s, "grad_accum", f"{where}.setting")
    seeds = _get(block, "seeds", where)
    if not seeds:
        raise ResultsError(f"{where}.seeds: no seed")
    modes = {}
    for mode in runs_order:
        per = {}
        for seed, runs in seeds.items():
            if mode not in runs:
                continue
            if REFERENCE not in runs:
                raise ResultsError(f"{where}.seeds[{seed!r}]: no {REFERENCE!r} run to measure {mode} against")
            per[str(seed)] = seed_factor(
                runs[mode], runs[REFERENCE], steps, f"{where}.seeds[{seed!r}].{mode}"
            )
        if not per:
            continue
        short = [seed for seed, x in per.items() if not x["reached"]]
        modes[mode] = {
            "seeds": per,
            "factor": _stats([x["factor"] for x in per.values()]),
            "lower_bound": bool(short),
            "not_reached_seeds": short,
            "sync_final_val_loss_mean": statistics.mean(x["sync_final_val_loss"] for x in per.values()),
            "best_val_loss_mean": statistics.mean(x["best_val_loss"] for x in per.values()),
        }
    return {
        "group": s.get("group"),
        "steps": steps,
        "peak_lr": _get(s, "lr", f"{where}.setting"),
        "micro_batch": mb,
        "grad_accum": gas,
        "world_size": world,
        "warmup_steps": s["warmup_steps"] if s.get("warmup_steps") is not None else setup.get("warmup_steps"),
        "context": context,
        "tokens_per_step": mb * gas * world * context,
        "family": None,
        "modes": modes,
    }


def family_key(s: dict) -> str:
    """The key of a setting's family (``setting_factors``' output): everything but its steps."""
    return (
        f"lr={s['peak_lr']:g} gas={s['grad_accum']} mb={s['micro_batch']} world={s['world_size']} "
        f"warmup={s['warmup_steps']}"
    )


def _final(run: dict) -> float:
    loss = run["val_loss"][-1] if run.get("val_loss") else math.nan
    return float(loss) if isinstance(loss, (int, float)) else math.nan


def across_seed(lengths: list, sync_final: float, finals: list, n: int, within: dict) -> dict:
    """One seed's across-lengths factor at sync length ``n`` (module docstring): ``finals`` the run's final losses
    at ``lengths`` (increasing), ``sync_final`` S(n), ``within`` the seed's within-run factor at ``n``."""
    out = {"sync_final_val_loss": sync_final, "steps": None, "lower_bound": False, "upper_bound": False}
    out |= {"within_run": False, "between": None}
    first = next((i for i, m in enumerate(finals) if m <= sync_final), None)  # NaN is never <= anything
    if first is None:
        return out | {"factor": lengths[-1] / n, "lower_bound": True}
    if first == 0:
        if lengths[0] == n:
            return out | {"factor": within["factor"], "steps": within["steps_to_it"], "within_run": True}
        return out | {"factor": lengths[0] / n, "upper_bound": True}
    lo, hi, m_lo, m_hi = lengths[first - 1], lengths[first], finals[first - 1], finals[first]
    if math.isfinite(m_lo):
        x = (m_lo - sync_final) / (m_lo - m_hi)  # in (0, 1]: m_lo > sync_final >= m_hi
        reach = math.exp(math.log(lo) + x * (math.log(hi) - math.log(lo)))
    else:
        reach = float(hi)  # right after a non-finite loss: the length itself
    return out | {"factor": reach / n, "steps": reach, "between": [lo, hi]}


def family_factors(members: list, blocks: dict, out: dict, runs_order: list) -> dict:
    """The across-lengths factors of one family (module docstring); ``members``: ``[(steps, name)]`` by steps,
    ``blocks``: ``results.settings``, ``out``: ``setting_factors``' outputs."""
    modes = {}
    for run in runs_order:
        have = {}  # steps -> {seed: (sync final, run final)}
        for steps, name in members:
            per = {}
            for seed, runs in blocks[name]["seeds"].items():
                if run in runs and REFERENCE in runs:
                    sync_final = _final(runs[REFERENCE])
                    if math.isfinite(sync_final):
                        per[str(seed)] = (sync_final, _final(runs[run]))
            if per:
                have[steps] = per
        dropped = []
        while len(have) >= 2 and not set.intersection(*(set(p) for p in have.values())):
            fewest = min(have, key=lambda n: (len(have[n]), -n))
            dropped.append(fewest)
            del have[fewest]
        if len(have) < 2:
            continue
        lengths = sorted(have)
        seeds = sorted(set.intersection(*(set(p) for p in have.values())), key=lambda x: (len(x), x))
        names = dict(members)
        at = {}
        for n in lengths:
            within = out[names[n]]["modes"][run]["seeds"]
            per = {
                seed: across_seed(
                    lengths, have[n][seed][0], [have[k][seed][1] for k in lengths], n, within[seed]
                )
                for seed in seeds
            }
            low = [x for x, v in per.items() if v["lower_bound"]]
            up = [x for x, v in per.items() if v["upper_bound"]]
            at[str(n)] = {
                "setting": names[n],
                "seeds": per,
                "factor": _stats([v["factor"] for v in per.values()]),
                "lower_bound": bool(low),
                "upper_bound": bool(up),
                "lower_bound_seeds": low,
                "upper_bound_seeds": up,
                "within_run_seeds": [x for x, v in per.items() if v["within_run"]],
            }
        modes[run] = {
            "lengths": lengths,
            "seeds": seeds,
            "dropped_lengths": sorted(dropped),
            "final_val_loss": {
                who: {seed: [have[k][seed][i] for k in lengths] for seed in seeds}
                for i, who in ((0, REFERENCE), (1, run))
            },
            "at": at,
        }
    first = out[members[0][1]]
    return {
        "lr": first["peak_lr"],
        **{
            k: first[k]
            for k in ("grad_accum", "micro_batch", "world_size", "warmup_steps", "tokens_per_step")
        },
        "settings": [[steps, name] for steps, name in members],
        "modes": modes,
    }


def families(blocks: dict, out: dict, runs_order: list) -> dict:
    """``{key: family_factors}`` of the families with two lengths or more; sets each member's ``family``."""
    grouped = {}
    for name, s in out.items():
        grouped.setdefault(family_key(s), {}).setdefault(s["steps"], name)  # the first setting at a length
    fams = {}
    for key, by_steps in grouped.items():
        if len(by_steps) < 2:
            continue
        members = sorted(by_steps.items())
        fams[key] = family_factors(members, blocks, out, runs_order)
        for _, name in members:
            out[name]["family"] = key
    return fams


def _shown_path(path: Path) -> str:
    path = path.resolve()
    try:
        return path.relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def factors(results: dict, source: Path) -> dict:
    """The factors file's content from the quality study's ``results`` (``quality.json``'s ``"results"``)."""
    settings = _get(results, "settings", "results")
    setup = _get(results, "setup", "results")
    if not settings:
        raise ResultsError("results.settings: no setting")
    order = run_names(settings)
    out = {name: setting_factors(block, setup, name, order) for name, block in settings.items()}
    fams = families(settings, out, order)
    base = next((n for n, s in out.items() if s["group"] == "base"), next(iter(out)))
    shown = _shown_path(source)
    knobs = setup.get("variant_knobs") or {}
    return {
        "about": "acco-plan's samples-to-loss factors: per setting of the quality study and run, the optimizer "
        "steps the run needs to reach sync's final validation loss over sync's own, and across the settings that "
        "differ only in their steps (benchmarks.quality.factors)",
        "command": shlex.join(
            [
                "python",
                "-m",
                "benchmarks.quality.factors",
                "--from-json",
                shown,
                "--out",
                _shown_path(DEFAULT_OUT),
            ]
        ),
        "source": {
            "path": shown,
            "study": source.resolve().parent.name,
            "date": results.get("date"),
            "command": results.get("command"),
            "sha256": hashlib.sha256(source.read_bytes()).hexdigest(),
        },
        "reference": REFERENCE,
        "runs": order,
        "variant_knobs": {r: knobs.get(r) for r in order if r not in MODES},
        "base_setting": base,
        "eval_every": setup.get("eval_every"),
        "seeds": setup.get("seeds"),
        "settings": out,
        "families": fams,
    }


def _factor_cell(f: dict, sign: str) -> str:
    """A factor's mean [min, max], the mean prefixed with its bound's sign (">", "<=" or "")."""
    return f"{sign}{f['mean']:.3f} [{f['min']:.3f}, {f['max']:.3f}]"


def render(doc: dict) -> str:
    """A short table of the factors (printed by ``main``)."""
    lines = [
        f"samples-to-loss factors from {doc['source']['path']} ({doc['source']['date']}); base setting "
        f"{doc['base_setting']}",
        "| setting | steps | tokens/step | peak LR | run | factor mean [min, max] | seeds not reaching sync's loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in doc["settings"].items():
        for mode, m in s["modes"].items():
            f = m["factor"]
            low = ">" if m["lower_bound"] else ""
            lines.append(
                f"| {name} | {s['steps']} | {s['tokens_per_step']:,} | {s['peak_lr']:g} | {mode} | "
                f"{_factor_cell(f, low)} | {', '.join(m['not_reached_seeds']) or '-'} |"
            )
    for key, fam in doc.get("families", {}).items():
        lines += [
            "",
            f"across run lengths, family {key} ({', '.join(f'{n} {s}' for s, n in fam['settings'])})",
            "| run | sync's length N | N' mean | factor N'/N mean [min, max] | seeds | bounds |",
            "|---|---|---|---|---|---|",
        ]
        for run, m in fam["modes"].items():
            for n, a in m["at"].items():
                f = a["factor"]
                sign = ">" if a["lower_bound"] else "<=" if a["upper_bound"] else ""
                bounds = [f"lower: {', '.join(a['lower_bound_seeds'])}"] if a["lower_bound"] else []
                bounds += [f"upper: {', '.join(a['upper_bound_seeds'])}"] if a["upper_bound"] else []
                bounds += [f"within run: {', '.join(a['within_run_seeds'])}"] if a["within_run_seeds"] else []
                lines.append(
                    f"| {run} | {n} | {f['mean'] * int(n):.0f} | {_factor_cell(f, sign)} | "
                    f"{', '.join(m['seeds'])} | {'; '.join(bounds) or '-'} |"
                )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.quality.factors", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--from-json", required=True, help="the quality study's quality.json")
    ap.add_argument(
        "--out", default=str(DEFAULT_OUT), help=f"the factors file (default {_shown_path(DEFAULT_OUT)})"
    )
    a = ap.parse_args(argv)
    source = Path(a.from_json)
    try:
        results = _get(json.loads(source.read_text()), "results", str(source))
        doc = factors(results, source)
    except (OSError, json.JSONDecodeError) as err:
        ap.error(f"--from-json {a.from_json}: {err}")
    except ResultsError as err:
        ap.error(f"--from-json {a.from_json}: {err}")
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(render(doc))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
