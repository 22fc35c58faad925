"""End-to-end benchmark on a bandwidth-limited link (BENCHMARKS.md section 2), with heterogeneous
workers, over several seeds, under both framings of the comm-bound claim.

    python -m benchmarks.e2e            # the sweep: 4 rates x 6 contenders x 3 seeds (about 80 min on 2 cores)
    python -m benchmarks.e2e --quick    # one rate, few steps, one seed (what the tests run)
    python -m benchmarks.e2e --from-json benchmarks/results/e2e/e2e.json   # re-render table and plots

All ranks of a run share one link: a private network namespace (``unshare -n``) whose loopback is
rate-limited with ``tc`` (needs root and iproute2; without them the benchmark says so and exits
with status 2 - it never fakes the link with sleeps). For every link rate of the sweep, in the
same invocation and with the same model, data, batch, dtype and threads: a comm-only probe
(T_comm of one round), then every contender once per seed, interleaved (seed 0: every contender,
then seed 1, ...): DeepSpeed ZeRO-1 (AdamW), ZeRO-1 with ``overlap_comm``, ZeRO-2 (on request),
acco_ds sync, dpu, acco fixed, acco adaptive. The seed fixes the initialisation and the data
order, the same for every contender, so the loss figures of a seed are paired; the seeds double
as the throughput repeats. Then adaptive ACCO at the token budget of the fixed contenders (framing
b: ``benchmarks.harness.runs.budget_schedule``). The compute-only bound (the same training loop with
the communication removed: ``benchmarks.harness.runs.run_compute_only``) runs at the start, after every rate and at
the end; its highest figure is the reference. Then the heterogeneous case: one rank made
``--slow-factor`` times slower by real extra compute per micro-batch, ZeRO-1 against ACCO, every
seed. Writes ``<prefix>.md`` (tables, machine, versions, date), ``<prefix>.json`` (raw) and
``<prefix>_*.png`` into ``--out`` (default ``benchmarks/results/e2e/``) and prints the table last.
Definitions of every column: ``benchmarks/harness/analysis.py``.

Exit status: 0 when every run ran; 1 when a contender (or a reference run) could not run, even
after one retry - the others' results are still written, and stderr and the table name each
missing run; 2 when this machine cannot throttle a link.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

from acco_ds.cli.dsconfig import build_config
from acco_ds.cli.job import acco_registered
from acco_ds.cli.metrics import machine_info
from acco_ds.models import GPTConfig, TinyGPT
from benchmarks.e2e import goals, plots, table
from benchmarks.harness import analysis, link, records, runs, sweep
from benchmarks.harness.cli import add_outputs, parser, rates, sweep_defaults
from benchmarks.harness.sweep import seeds_arg

DEFAULT_RATES = "none,400mbit,200mbit,50mbit"
ALL = ",".join(runs.CONTENDERS)
DEFAULT_CONTENDERS = "zero1,zero1-overlap,sync,dpu,acco,acco-adaptive"
COMPRESSION_CONTENDERS = "zero1,zero1-bf16comm,sync-int8,acco,acco-adaptive,acco-int8,acco-adaptive-int8"
DS_LABELS = ("zero1", "zero1-overlap", "zero2", "zero1-bf16comm")

_log = sweep.logger("benchmarks.e2e")


def ds_settings(contenders: list, knobs: dict) -> dict:
    """{DeepSpeed contender: its zero_optimization block as run} (a contender's mode from runs.CONTENDERS:
    ``zero1-bf16comm`` is ZeRO-1 with bf16 communication)."""
    return {
        c: build_config(runs.CONTENDERS[c][0], knobs)["zero_optimization"]
        for c in DS_LABELS
        if c in contenders
    }


def parse(argv=None) -> argparse.Namespace:
    ap = parser("e2e", __doc__)
    ap.add_argument(
        "--quick", action="store_true", help="one rate, few steps, one seed, 2 contenders (the test)"
    )
    ap.add_argument(
        "--rates", default=None, help=f"comma-separated tc rates or 'none' (default: {DEFAULT_RATES})"
    )
    ap.add_argument(
        "--contenders",
        default=None,
        help=f"comma-separated subset of {ALL}, or 'all', or 'compression' ({COMPRESSION_CONTENDERS}) "
        f"(default: {DEFAULT_CONTENDERS})",
    )
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 40, quick 6)")
    ap.add_argument(
        "--warmup", type=int, default=None, help="steps left out of the timings (default 5, quick 2)"
    )
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--grad-accum", type=int, default=4)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank, every contender")
    ap.add_argument(
        "--seeds",
        type=seeds_arg,
        default=None,
        help="comma-separated seeds, each run by every contender (default 0,1,2; quick 0). Loss verdicts "
        "need >= 3; the seeds double as the throughput repeats",
    )
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument(
        "--bf16", action="store_true", help="bf16 parameters and communication (default fp32 on CPU)"
    )
    ap.add_argument("--slow-rank", type=int, default=1, help="the rank slowed in the heterogeneous case")
    ap.add_argument("--slow-factor", type=float, default=2.0, help="how many times slower it computes")
    ap.add_argument(
        "--hetero-rate",
        default="auto",
        help="link of the heterogeneous case: auto (the comm~compute rate), a rate, or off",
    )
    ap.add_argument("--hetero-contenders", default="zero1,acco,acco-adaptive")
    ap.add_argument(
        "--no-budget",
        action="store_true",
        help="skip adaptive ACCO's runs at the token budget (framing b then shows no adaptive row)",
    )
    ap.add_argument(
        "--probe-reps",
        type=int,
        default=None,
        help="calls per timing window of the comm-only probe (default 5, quick 2)",
    )
    ap.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="validation loss at the start and every N optimizer steps too (default 0: at the end only); with it "
        "the loss table gives each contender's time to ZeRO-1's final validation loss, interpolated between them "
        "(their time is left out of the training clock)",
    )
    ap.add_argument(
        "--nice",
        type=int,
        default=0,
        help="niceness of every run's ranks (e.g. -10 as root on a machine shared with other jobs: the same for all)",
    )
    add_outputs(ap, "e2e")
    a = ap.parse_args(argv)
    a.rates = rates(ap, a.rates, a.quick, DEFAULT_RATES)
    default_c = "zero1,acco-adaptive" if a.quick else DEFAULT_CONTENDERS
    named = {"all": ALL, "compression": COMPRESSION_CONTENDERS}
    a.contenders = named.get(a.contenders, a.contenders or default_c).split(",")
    a.hetero_contenders = a.hetero_contenders.split(",")
    a.probe_reps = a.probe_reps or (2 if a.quick else 5)
    if a.quick and a.hetero_contenders == ["zero1", "acco", "acco-adaptive"]:
        a.hetero_contenders = ["zero1", "acco-adaptive"]
    for c in a.contenders + a.hetero_contenders:
        if c not in runs.CONTENDERS:
            ap.error(f"unknown contender {c!r}; choose from {ALL}")
    sweep_defaults(ap, a, "e2e", 40)
    if a.eval_every < 0:
        ap.error(f"--eval-every must be >= 0 (0: at the end only), got {a.eval_every}")
    return a


def _drop_unavailable(a, failed: list) -> None:
    """Without an acco_ds that registers ACCO, the acco_ds contenders cannot run: each is recorded
    as failed (the benchmark then exits non-zero) and the DeepSpeed baselines still run."""
    ok, why = acco_registered()
    if ok:
        return
    for tag, labels in (("", a.contenders), ("-hetero", a.hetero_contenders)):
        for label in labels:
            if label not in DS_LABELS:
                where = "all rates" if not tag else "heterogeneous"
                sweep.fail(failed, label, where, f"not run: {why}", _log)
    a.contenders = [c for c in a.contenders if c in DS_LABELS]
    a.hetero_contenders = [c for c in a.hetero_contenders if c in DS_LABELS]


def run_all(a) -> dict:
    """Every run of the sweep. A run that fails twice is recorded in ``results["failed"]`` and the
    sweep goes on without it (``main`` then exits non-zero naming it); only a sweep left with no
    compute-only bound stops early."""
    failed: list = []
    _drop_unavailable(a, failed)
    model = GPTConfig(n_layer=a.n_layer, n_head=a.n_head, d_model=a.d_model, context=a.context).to_dict()
    work = Path(a.work or tempfile.mkdtemp(prefix="acco_bench_e2e_"))
    setup = runs.Setup(
        work=work,
        model=model,
        n_params=TinyGPT(GPTConfig(**model)).num_params(),
        steps=a.steps,
        warmup=a.warmup,
        micro_batch=a.micro_batch,
        grad_accum=a.grad_accum,
        world=a.world_size,
        threads=a.threads,
        seed=a.seeds[0],
        bf16=a.bf16,
        nice=a.nice,
        eval_every=a.eval_every,
    )
    results = {
        "command": shlex.join([sys.executable, "-m", "benchmarks.e2e", *sys.argv[1:]]),
        "machine": machine_info(),
        "setup": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(setup).items()},
        "seeds": a.seeds,
        "repeats": len(a.seeds),
        "bound_loop": " ".join(runs.BOUND_LOOP),
        "ds_settings": ds_settings(a.contenders + a.hetero_contenders, setup.knobs("fixed")),
        "rates": {},
        "compute": [],
        "failed": failed,
    }
    for label, zero in results["ds_settings"].items():
        _log(f"{label} settings: {json.dumps(zero)}")
    _log(f"work folder {work}; model {setup.n_params / 1e6:.2f}M params; seeds {a.seeds}")

    def bound(tag: str) -> None:
        sweep.compute_bound(setup, results, failed, tag, _log)

    bound("-start")
    if not results["compute"]:
        return results  # nothing to measure against; main reports the failure
    for rate in a.rates:
        comm, err = sweep.attempt(lambda rate=rate: runs.run_comm_probe(setup, rate, a.probe_reps), _log)
        if comm is None:
            why = (
                f"the comm-only probe at {rate} failed twice ({err}; see {setup.work}): not run at this rate"
            )
            for label in a.contenders:
                sweep.fail(failed, label, rate, why, _log)
            continue
        parts = ", ".join(f"{k[:-2]} {comm[k]:.3f}" for k in ("rs_ag_s", "ar_ag_s", "p2p_ag_s") if k in comm)
        _log(f"{rate}: T_comm {comm['t_comm_s']:.3f} s ({parts})")

        def one(label, seed, rate=rate):
            return runs.run_contender(setup, label, rate, None, f"/s{seed}", seed)

        rounds = sweep.seed_rounds(one, a.contenders, a.seeds, failed, rate, _log)
        block = dict(sweep.rate_block(rounds), comm=comm)
        if not a.no_budget and "acco-adaptive" in rounds:

            def at_budget(seed, schedule, rate=rate):
                return runs.run_contender(
                    setup, "acco-adaptive", rate, None, f"/s{seed}", seed, schedule=schedule
                )

            block["budget"] = sweep.budget_runs(setup, block, rate, failed, _log, at_budget)
        results["rates"][rate] = block
        if not a.quick:
            bound(f"-{rate}")
    if not a.quick:
        bound("-end")
    if a.hetero_rate != "off" and a.hetero_contenders and a.slow_factor > 1:
        comp = analysis.compute_only(results)
        rate = a.hetero_rate
        if rate == "auto":
            rate = analysis.balanced_rate(results, comp, a.grad_accum) if results["rates"] else "none"
        extra = (a.slow_factor - 1.0) * comp["t_mb"][a.slow_rank]
        slow = {"rank": a.slow_rank, "extra_s": extra}
        _log(
            f"heterogeneous: link {rate}, rank {a.slow_rank} +{1000 * extra:.1f} ms of compute per micro-batch"
        )

        def slowed(label, seed, rate=rate):
            return runs.run_contender(setup, label, rate, slow, f"-hetero/s{seed}", seed)

        rounds = sweep.seed_rounds(slowed, a.hetero_contenders, a.seeds, failed, f"{rate}-hetero", _log)
        results["hetero"] = dict(
            sweep.rate_block(rounds),
            rate=rate,
            slow_rank=a.slow_rank,
            slow_factor=a.slow_factor,
            extra_s=extra,
        )
    return results


def report(results: dict, out: Path, prefix: str) -> str:
    """Analyse ``results`` and write the table, the raw JSON and the plots into ``out``."""
    an = analysis.analyse(results, goals.goals)
    md = table.render(results, an)
    raw = {"results": results, "analysis": an}
    return records.write_report(out, prefix, md, raw, lambda o, p: plots.plot_all(results, an, o, p))


def main(argv=None) -> int:
    """0 when every run of the sweep ran; 1 when some contender (or reference run) could not run -
    the results of the others are still written, and the failures are named on stderr and in the
    table; 2 when the link cannot be throttled here."""
    a = parse(argv)
    if a.from_json:
        print(report(records.load_results(a.from_json), Path(a.out), a.prefix))
        return 0
    why = link.throttle_unavailable()
    if why:
        return sweep.refuse("e2e", "throttle the link", why, "a real bandwidth-limited link")
    results = run_all(a)
    if results["compute"]:
        print(report(results, Path(a.out), a.prefix))
    return sweep.exit_status("benchmarks.e2e", results, a.out)
