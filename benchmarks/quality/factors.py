"""acco-plan's samples-to-loss factors, from the quality study's results (``python -m benchmarks.quality``).

    python -m benchmarks.quality.factors --from-json benchmarks/results/quality/run1/quality.json \\
        --out acco_ds/plan/quality_factors.json

The factor of a mode (acco, dpu) in a setting, per seed: ``f = (the optimizer steps the mode needs to reach sync's
FINAL validation loss) / (the steps sync itself needs to reach it)``, both the first crossing of their validation
curves, interpolated between the evaluations on ``val_step`` (``acco_ds.cli.time_to_loss``; sync's own is its last
step unless its curve dipped there earlier), paired with the sync run of the same seed. A mode that never reached
that loss within the setting's steps is recorded ``reached: false`` with the factor ``steps / sync's steps`` and
``lower_bound: true`` (the true factor is above it). Per mode: the factor's mean / min / max over the seeds, with
``lower_bound`` when any seed did not reach the loss (the mean is then a lower bound too) and the seeds that did not.
Per setting also: the tokens per optimizer step (micro-batch x GAS x world size x context, the setting's world size
where it sets one, else ``results.setup``'s), the peak LR, the steps. The file says which results it came from
(``source``: the path as given, relative to the repository when inside it, the results' date and command, the
file's sha256) and the command that wrote it; the same results file always gives the same bytes. This command is
the only way ``acco_ds/plan/quality_factors.json`` is made (``acco_ds.plan.quality`` reads it; a test checks that
the committed file is what this command writes from its source).

Bad input exits with status 2 and a message naming the key: a results file without ``settings``, a seed without a
``sync`` run, a curve without ``val_step`` / ``val_loss``, a setup without ``world_size`` or ``context``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import statistics
import sys
from pathlib import Path

from acco_ds.cli.time_to_loss import time_to_loss

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = "sync"
MODES = ("acco", "dpu")  # the modes measured against sync
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


def setting_factors(block: dict, setup: dict, name: str) -> dict:
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
    for mode in MODES:
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
        values = [x["factor"] for x in per.values()]
        short = [seed for seed, x in per.items() if not x["reached"]]
        modes[mode] = {
            "seeds": per,
            "factor": {
                "mean": statistics.mean(values),
                "min": min(values),
                "max": max(values),
                "n": len(values),
            },
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
        "context": context,
        "tokens_per_step": mb * gas * world * context,
        "modes": modes,
    }


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
    out = {name: setting_factors(block, setup, name) for name, block in settings.items()}
    base = next((n for n, s in out.items() if s["group"] == "base"), next(iter(out)))
    shown = _shown_path(source)
    return {
        "about": "acco-plan's samples-to-loss factors: per setting of the quality study and mode, the optimizer "
        "steps the mode needs to reach sync's final validation loss over sync's own (benchmarks.quality.factors)",
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
        "base_setting": base,
        "eval_every": setup.get("eval_every"),
        "seeds": setup.get("seeds"),
        "settings": out,
    }


def render(doc: dict) -> str:
    """A short table of the factors (printed by ``main``)."""
    lines = [
        f"samples-to-loss factors from {doc['source']['path']} ({doc['source']['date']}); base setting "
        f"{doc['base_setting']}",
        "| setting | steps | tokens/step | peak LR | mode | factor mean [min, max] | seeds not reaching sync's loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in doc["settings"].items():
        for mode, m in s["modes"].items():
            f = m["factor"]
            low = ">" if m["lower_bound"] else ""
            lines.append(
                f"| {name} | {s['steps']} | {s['tokens_per_step']:,} | {s['peak_lr']:g} | {mode} | {low}{f['mean']:.3f} "
                f"[{f['min']:.3f}, {f['max']:.3f}] | {', '.join(m['not_reached_seeds']) or '-'} |"
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
