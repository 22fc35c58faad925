"""Two-node topology benchmark: tensor parallelism inside a node, ACCO's data parallelism across
nodes, over a rate-limited inter-node link.

    python -m benchmarks.topology            # the sweep: 3 inter-node rates x 5 contenders x 3 seeds (about 60 min on 2 cores)
    python -m benchmarks.topology --quick    # one rate, few steps, one seed, ZeRO-1 vs ACCO (what the test runs)
    python -m benchmarks.topology --from-json benchmarks/results/topology/topology.json   # re-render

The two "nodes" are two network namespaces this benchmark creates and removes afterwards
(``benchmarks.harness.nodes.TwoNodes``): a veth pair joins them, limited by ``tc`` on both ends at the
inter-node rate, with 10.77.0.1/24 and 10.77.0.2/24 on its ends, addresses that exist only inside
those namespaces. Each node runs ``--tp`` ranks, which talk to each other over the node's own
unlimited loopback (they bind the node's address: Linux routes it over ``lo``). A run is started
as on a cluster without ssh: one DeepSpeed launcher per node inside its namespace, with
``--hostfile``, ``--no_ssh``, ``--node_rank`` and the master address on the link
(``benchmarks.topology.runs``). The contenders train ``acco-train``'s worker with ``--tp`` and a Llama built
from a transformers config (DeepSpeed AutoTP inside a node), same model, batch, LR schedule and
data for every one: DeepSpeed ZeRO-1 AdamW + AutoTP (overlap_comm off and on), acco_ds sync, ACCO
fixed, ACCO adaptive (and dpu on request; the compressed contenders on request: sync-int8, acco-int8,
acco-adaptive-int8, acco-adaptive-int8-peek-int4, compression over the data-parallel group). Measured as the e2e benchmark measures (``benchmarks.harness``):
per rate, a comm-only probe (one round's data-parallel communication of each rank's slice, both
data-parallel groups at once), every contender once per seed (the seeds pair the loss figures
and double as the throughput repeats), adaptive ACCO at the fixed contenders' token budget; the
compute-only bound (each node's replica alone, its tensor-parallel collectives kept) at the start,
after each rate and at the end. Writes ``<prefix>.md``, ``<prefix>.json`` (raw; ``--from-json``
re-renders) and ``<prefix>.png`` into ``--out`` (default ``benchmarks/results/topology/``).

Exit status: 0 when every run ran; 1 when some run could not run (the others are still written);
2 when this machine cannot build the two-node network (no root, no iproute2): it never fakes the
link.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import tempfile
from pathlib import Path

from acco_ds.cli.dsconfig import build_config
from acco_ds.cli.job import acco_registered
from acco_ds.cli.metrics import machine_info
from benchmarks.harness import nodes, records, runs, sweep
from benchmarks.harness.cli import add_outputs, parser, rates, sweep_defaults
from benchmarks.harness.sweep import seeds_arg
from benchmarks.topology import report as topology_report
from benchmarks.topology import runs as topology_runs

DEFAULT_RATES = "400mbit,200mbit,50mbit"
CONTENDERS = (
    "zero1",
    "zero1-overlap",
    "sync",
    "dpu",
    "acco",
    "acco-adaptive",
    # compressed rounds over the data-parallel group (benchmarks.harness.runs.CONFIG_CHANGES)
    "sync-int8",
    "acco-int8",
    "acco-adaptive-int8",
    "acco-adaptive-int8-peek-int4",
)
DEFAULT_CONTENDERS = "zero1,zero1-overlap,sync,acco,acco-adaptive"
DS_LABELS = ("zero1", "zero1-overlap")

_log = sweep.logger("benchmarks.topology")


def parse(argv=None) -> argparse.Namespace:
    ap = parser("topology", __doc__)
    ap.add_argument(
        "--quick", action="store_true", help="one rate, 6 steps, one seed, zero1 + acco (the test)"
    )
    ap.add_argument("--rates", default=None, help=f"inter-node tc rates or 'none' (default: {DEFAULT_RATES})")
    ap.add_argument(
        "--contenders", default=None, help=f"subset of {','.join(CONTENDERS)} (default: {DEFAULT_CONTENDERS})"
    )
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 30, quick 6)")
    ap.add_argument(
        "--warmup", type=int, default=None, help="steps left out of the timings (default 5, quick 2)"
    )
    ap.add_argument("--seeds", type=seeds_arg, default=None, help="default 0,1,2; quick 0")
    ap.add_argument("--tp", type=int, default=2, help="ranks per node = tensor-parallel size (AutoTP)")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--grad-accum", type=int, default=4)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--bf16", action="store_true", help="bf16 parameters and communication (default fp32)")
    ap.add_argument(
        "--warmup-lr-steps", type=int, default=None, help="LR warm-up steps (default: a quarter of --steps)"
    )
    ap.add_argument(
        "--probe-reps",
        type=int,
        default=None,
        help="calls per timing window of the comm probe (default 3, quick 2)",
    )
    ap.add_argument("--no-budget", action="store_true", help="skip adaptive ACCO's runs at the token budget")
    ap.add_argument("--nice", type=int, default=0, help="niceness of every run's ranks (the same for all)")
    add_outputs(ap, "topology")
    a = ap.parse_args(argv)
    a.rates = rates(ap, a.rates, a.quick, DEFAULT_RATES)
    a.contenders = (a.contenders or ("zero1,acco" if a.quick else DEFAULT_CONTENDERS)).split(",")
    for c in a.contenders:
        if c not in CONTENDERS:
            ap.error(f"unknown contender {c!r}; choose from {','.join(CONTENDERS)}")
    if a.tp < 2:
        ap.error(f"--tp must be >= 2 (tensor parallelism inside a node), got {a.tp}")
    for flag, n in (("--n-head", a.n_head),):
        if n % a.tp:
            ap.error(f"--tp {a.tp} must divide {flag} ({n}): AutoTP splits the attention heads")
    if "acco" in a.contenders and a.grad_accum % 2:
        ap.error(f"acco needs an even --grad-accum (two rounds of GAS/2 per step), got {a.grad_accum}")
    sweep_defaults(ap, a, "topology", 30)
    a.warmup_lr_steps = a.warmup_lr_steps or max(1, a.steps // 4)
    a.probe_reps = a.probe_reps or (2 if a.quick else 3)
    a.no_budget = a.no_budget or a.quick
    return a


def _model(a) -> dict:
    from acco_ds.models import HFModelConfig

    return HFModelConfig(
        arch="llama", n_layer=a.n_layer, n_head=a.n_head, d_model=a.d_model, context=a.context
    ).to_dict()


def _network(net) -> dict:
    n0, n1 = net.names
    return {
        "names": list(net.names),
        "addresses": list(nodes.ADDRS),
        "description": (
            f"two network namespaces ({n0}, {n1}) joined by a veth pair {nodes.IFNAMES[0]} "
            f"{nodes.ADDRS[0]}/24 - {nodes.IFNAMES[1]} {nodes.ADDRS[1]}/24, both ends limited by "
            "`tc qdisc replace dev <end> root tbf rate <rate> burst 256kb latency 200ms` (the inter-node link); "
            "the ranks of a node reach each other at the node's own address, over its unlimited loopback"
        ),
        "launch": (
            "one launcher per node inside its namespace: `ip netns exec <node> python -m deepspeed.launcher.runner "
            "--hostfile H --no_ssh --node_rank <r> --master_addr 10.77.0.1 --master_port P --module "
            "acco_ds.cli.worker --spec S` (hostfile: node0 slots=T / node1 slots=T), GLOO_SOCKET_IFNAME = the "
            "node's end of the link"
        ),
    }


def run_all(a, net) -> dict:
    """Every run of the sweep inside the two nodes ``net``; a run that fails twice is recorded in
    ``results["failed"]`` and the sweep goes on."""
    from acco_ds.models import model_num_params

    failed: list = []
    ok, why = acco_registered()
    if not ok:
        for label in [c for c in a.contenders if c not in DS_LABELS]:
            sweep.fail(failed, label, "all rates", f"not run: {why}", _log)
        a.contenders = [c for c in a.contenders if c in DS_LABELS]
    model = _model(a)
    work = Path(a.work or tempfile.mkdtemp(prefix="acco_bench_topology_"))
    setup = runs.Setup(
        work=work,
        model=model,
        n_params=model_num_params(model),
        steps=a.steps,
        warmup=a.warmup,
        micro_batch=a.micro_batch,
        grad_accum=a.grad_accum,
        world=2 * a.tp,
        threads=1,
        seed=a.seeds[0],
        bf16=a.bf16,
        nice=a.nice,
        tp=a.tp,
        warmup_lr_steps=a.warmup_lr_steps,
        eval_windows=64,
    )
    results = {
        "command": shlex.join([sys.executable, "-m", "benchmarks.topology", *sys.argv[1:]]),
        "machine": machine_info(),
        "network": _network(net),
        "model_params": setup.n_params,
        "seeds": a.seeds,
        "bound_loop": " ".join(runs.BOUND_LOOP),
        "rates": {},
        "compute": [],
        "failed": failed,
    }
    _log(f"work folder {work}; nodes {net.names}; model {setup.n_params / 1e6:.2f}M params; seeds {a.seeds}")

    probes = {}

    def probe(rate: str) -> dict | None:
        net.set_rate(rate)
        comm, err = sweep.attempt(lambda: topology_runs.run_comm_probe(setup, net, rate, a.probe_reps), _log)
        if comm is None:
            why = (
                f"the comm-only probe at {rate} failed twice ({err}; see {setup.work}): not run at this rate"
            )
            for label in a.contenders:
                sweep.fail(failed, label, rate, why, _log)
        probes[rate] = comm
        return comm

    first = probe(a.rates[0])
    if first:  # the rank's tensor-parallel slice: what its data-parallel buffers hold and a round moves
        setup.n_params = max(first["slice_numel"])
    results["setup"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(setup).items()}
    results["ds_settings"] = {
        c: build_config(c, setup.knobs("fixed"))["zero_optimization"] for c in DS_LABELS if c in a.contenders
    }
    for label, zero in results["ds_settings"].items():
        _log(f"{label} settings: {json.dumps(zero)}")
    if not first:
        return results  # no slice, no link: nothing to run (the failure is recorded)
    sweep.compute_bound(setup, results, failed, "-start", _log)
    if not results["compute"]:
        return results
    for rate in a.rates:
        comm = probes.get(rate) or probe(rate)
        if comm is None:
            continue
        net.set_rate(rate)
        _log(
            f"{rate}: T_comm {comm['t_comm_s']:.3f} s per round ({comm['numel']:,} parameters per rank; "
            f"qdisc {net.qdisc(0)})"
        )

        def one(label, seed, rate=rate):
            return topology_runs.run_contender(setup, net, label, rate, seed, f"/s{seed}")

        rounds = sweep.seed_rounds(one, a.contenders, a.seeds, failed, rate, _log)
        block = dict(sweep.rate_block(rounds), comm=comm)
        if not a.no_budget and "acco-adaptive" in rounds:

            def at_budget(seed, schedule, rate=rate):
                return topology_runs.run_contender(
                    setup, net, "acco-adaptive", rate, seed, f"/s{seed}", schedule
                )

            block["budget"] = sweep.budget_runs(setup, block, rate, failed, _log, at_budget)
        results["rates"][rate] = block
        if not a.quick:
            sweep.compute_bound(setup, results, failed, f"-{rate}", _log)
    return results


def report(results: dict, out: Path, prefix: str) -> str:
    """Analyse ``results`` and write the table, the raw JSON and the plot into ``out``."""
    an = topology_report.analyse(results)
    md = topology_report.render(results, an)

    def plot(out: Path, prefix: str) -> list:
        if not an["tables"]:
            return []
        topology_report.plot(results, an, out / f"{prefix}.png")
        return [out / f"{prefix}.png"]

    return records.write_report(out, prefix, md, {"results": results, "analysis": an}, plot)


def _sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through TwoNodes.__exit__: the namespaces are removed


def main(argv=None) -> int:
    a = parse(argv)
    if a.from_json:
        print(report(records.load_results(a.from_json), Path(a.out), a.prefix))
        return 0
    why = nodes.unavailable()
    if why:
        return sweep.refuse(
            "topology",
            "build the two-node network",
            why,
            "a real rate-limited link between two network namespaces",
        )
    stale = nodes.remove_stale()
    if stale:
        _log(f"removed namespaces left by runs that no longer exist: {stale}")
    previous = signal.signal(signal.SIGTERM, _sigterm)
    try:
        with nodes.TwoNodes() as net:
            results = run_all(a, net)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if results["compute"] and results["rates"]:
        print(report(results, Path(a.out), a.prefix))
    return sweep.exit_status("benchmarks.topology", results, a.out)
