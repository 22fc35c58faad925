"""Soak run: ACCO in adaptive accumulation for thousands of optimizer steps while the ranks' speeds
keep changing, then check that no micro-batch was lost or counted twice and that memory stayed flat.

Usage (CPU, the ``deepspeed`` launcher with gloo on 127.0.0.1)::

    python benchmarks/soak.py                      # 2000 steps of the default TinyGPT, 2 ranks
    python benchmarks/soak.py --steps 150 --small  # the short version the tests run

What runs: the default model of the main job (``acco_ds.models.TinyGPT`` with ``GPTConfig()``: 4 layers,
d_model 128, context 128, byte vocabulary) on the default corpus (the Python standard library
sources), ``"optimizer": {"type": "ACCO", "params": {"mode": "acco", "accumulation": "adaptive"}}``,
ZeRO-1, gradient_accumulation_steps 2 (each round takes at least one micro-batch), warm-up/decay LR.
Every ``--phase`` steps each rank draws a new slowdown factor in [1, ``--max-slow``] (its own seeded
generator) and spends (factor - 1) x its measured micro-batch time in extra compute after each
micro-batch (``acco_ds.cli.slowdown.Spinner``: real work, not sleep), so which rank is slower, and by
how much, changes all along the run.

Checks (the run fails, exit code 1, when one does not hold):

1. accounting: the micro-batches computed on all ranks equal those committed plus those the spec
   discards (ACCO.md: training stops after a commit; the g~ of the last peek and the micro-batches of
   the unfinished round enter no commit); no commit skipped (the run has no non-finite gradient);
   the discarded ones are at most the last two rounds' worth;
2. memory: the peak RSS of each rank, sampled every ``--sample-every`` steps and taken per tenth of
   the run after the warm-up (the first ``--warmup`` fraction), grows by at most ``--rss-tol-mb`` MB
   from the first post-warm-up tenth to any later one; the threads and open files of each rank are
   the same at the end as after the first step;
3. the loss went down (mean of the last 10% of steps below the mean of the first 10%).

Writes ``soak.json`` (raw: every rank's counters, losses and RSS samples, with the machine, versions,
date, command and duration), ``soak.md`` (the table) and ``checks.json`` to ``--out``, and copies the
JSON and the table to ``benchmarks/results/soak.{json,md}`` (``--small``: ``soak_small.*``) unless
``--no-write``. ``--from-json F`` re-checks the raw results in F and re-renders the same table into
F's folder (``<F's name>.md``), without running anything::

    python benchmarks/soak.py --from-json benchmarks/results/soak.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


# -- the rank's side (started by the deepspeed launcher) ------------------------------------------------
def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _open_files() -> int:
    import psutil

    return psutil.Process().num_fds()


def worker(args) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO))
    import acco_ds  # noqa: F401
    from acco_ds.cli.slowdown import Spinner
    from acco_ds.core.snapshot import drain
    from acco_ds.data.batches import micro_batch
    from acco_ds.data.corpus import load_corpus
    from acco_ds.models.gpt import GPTConfig, TinyGPT

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gcfg = GPTConfig(n_layer=2, d_model=64, n_head=4, context=64) if args.small else GPTConfig()
    torch.manual_seed(0)
    model = TinyGPT(gcfg)
    gas = 2
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": gas,
        "optimizer": {
            "type": "ACCO",
            "params": {
                "lr": 2e-3,
                "weight_decay": 0.1,
                "mode": "acco",
                "accumulation": "adaptive",
                "max_micro_batches_per_round": args.cap or None,
            },
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": 2e-4,
                "warmup_max_lr": 2e-3,
                "warmup_num_steps": max(1, args.steps // 20),
                "total_num_steps": args.max_engine_steps,
            },
        },
        "zero_optimization": {"stage": 1},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    data = load_corpus().train
    spinner = Spinner(0.0)
    rng = random.Random(1000 + rank)
    compute_s, computed = 0.0, 0
    factors, losses, samples = [], [], []
    threads0 = files0 = None
    index, max_round, shapes = 0, 0, {}
    t_start = time.perf_counter()
    step = 0
    while True:
        if step % args.phase == 0:
            factors.append(round(rng.uniform(1.0, args.max_slow), 3))
        step_loss = 0.0
        for _ in range(gas):
            x, y = micro_batch(data, gcfg.context, args.micro_batch, 0, rank, index)
            t0 = time.perf_counter()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            compute_s += time.perf_counter() - t0
            computed += 1
            index += 1
            step_loss += float(loss.detach()) / gas
            spinner.extra_s = (factors[-1] - 1.0) * compute_s / computed
            spinner.spin()
        losses.append(step_loss)
        counts = tuple(engine.optimizer.pipeline.stats.last_round_counts)
        max_round = max(max_round, sum(counts))
        shapes[counts] = shapes.get(counts, 0) + 1
        if step == 0:
            threads0, files0 = threading.active_count(), _open_files()
        if step % args.sample_every == 0:
            samples.append((step, _rss_mb()))
        step += 1
        if step % args.check_every == 0 or step >= args.max_engine_steps:
            # stop together: when every rank has swapped in args.steps commits (a collective decision,
            # taken at the same engine step everywhere). In adaptive accumulation a rank may be one round
            # ahead and, at max_micro_batches_per_round, wait for a job its peer has not launched yet: a
            # collective of the script would then block both. drain() first makes the ranks agree on the
            # round count and finishes the job in flight (docs/RELIABILITY.md).
            drain(engine.optimizer.pipeline)
            done = torch.tensor([float(engine.optimizer.committed_steps)])
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
            if done.item() >= args.steps or step >= args.max_engine_steps:
                break
    samples.append((step, _rss_mb()))
    wall = time.perf_counter() - t_start
    opt = engine.optimizer
    opt.finish()
    stats = opt.stats()
    mine = {
        "rank": rank,
        "stats": stats,
        "factors": factors,
        "losses": losses,
        "rss": samples,
        "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "threads": [threads0, threading.active_count()],
        "open_files": [files0, _open_files()],
        "wall_s": wall,
        "spin_s": spinner.total_s,
        "compute_s": compute_s,
        "engine_skipped_steps": int(engine.skipped_steps),
        "global_steps": int(engine.global_steps),
        "max_round_global": max_round,
        "round_shapes": sorted([list(k), v] for k, v in shapes.items()),
    }
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    opt.pipeline.close()
    if rank == 0:
        out = {
            "args": vars(args),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
            "versions": f"python {platform.python_version()}, torch {torch.__version__}, "
            f"deepspeed {deepspeed.__version__}",
            "model": gcfg.to_dict(),
            "params": sum(p.numel() for p in model.parameters()),
            "ranks": everyone,
        }
        Path(args.out, "soak.json").write_text(json.dumps(out))


# -- checks and report (the driver) ---------------------------------------------------------------------
def window_peaks(r: dict, args) -> list:
    """Peak RSS (MB) of rank ``r`` per tenth of the run after the warm-up fraction."""
    total = r["global_steps"]
    warm = int(args.warmup * total)
    tenth = max(1, (total - warm) // 10)
    windows: dict = {}
    for step, mb in r["rss"]:
        if step >= warm:
            windows.setdefault(min((step - warm) // tenth, 9), []).append(mb)
    return [max(windows[k]) for k in sorted(windows)]


def check(res: dict, args) -> list:
    """[(check, ok, detail)] for the run in ``res``."""
    ranks = res["ranks"]
    s0 = ranks[0]["stats"]
    out = []
    computed = sum(r["stats"]["micro_batches_local"] for r in ranks)
    committed, discarded = s0["micro_batches_committed"], s0["micro_batches_discarded"]
    same = all(
        r["stats"][k] == s0[k]
        for r in ranks
        for k in ("micro_batches_committed", "micro_batches_discarded", "committed_steps", "rounds")
    )
    out.append(
        (
            "computed = committed + discarded",
            computed == committed + discarded and same,
            f"{computed} = {committed} + {discarded}" + ("" if same else " (ranks disagree)"),
        )
    )
    biggest = max(r["max_round_global"] for r in ranks)
    out.append(
        (
            "discarded only at the end",
            s0["skipped_steps"] == 0 and discarded <= 2 * biggest,
            f"{discarded} discarded <= 2 x {biggest} (the largest round, all ranks): the g~ of the last peek and "
            f"the unfinished round; {s0['skipped_steps']} skipped commits",
        )
    )
    rounds = s0["rounds"]
    out.append(
        (
            f"at least {args.steps} optimizer steps",
            s0["committed_steps"] >= args.steps
            and s0["applied_steps"] + s0.get("empty_commits", 0) == s0["committed_steps"],
            f"{s0['committed_steps']} commits ({s0['applied_steps']} applied, {s0.get('empty_commits', 0)} empty "
            f"ones ended by the drains) in {ranks[0]['global_steps']} engine steps, {rounds} rounds",
        )
    )
    for r in ranks:
        peaks = window_peaks(r, args)
        growth = max(peaks) - peaks[0] if peaks else 0.0
        out.append(
            (
                f"rank {r['rank']} memory flat",
                growth <= args.rss_tol_mb,
                f"peak RSS per tenth after warm-up {peaks[0]:.0f}..{max(peaks):.0f} MB (+{growth:.1f} MB, "
                f"tolerance {args.rss_tol_mb:g})",
            )
        )
        out.append(
            (
                f"rank {r['rank']} threads and files flat",
                r["threads"][0] == r["threads"][1] and r["open_files"][0] == r["open_files"][1],
                f"threads {r['threads'][0]} -> {r['threads'][1]}, open files {r['open_files'][0]} -> "
                f"{r['open_files'][1]}",
            )
        )
    losses = ranks[0]["losses"]
    k = max(1, len(losses) // 10)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    out.append(
        ("loss went down", last < first, f"{first:.3f} -> {last:.3f} (rank 0, mean of first/last 10%)")
    )
    return out


def report(res: dict, checks: list, args) -> str:
    """The Markdown table: a function of the raw results ``res`` alone (``--from-json`` re-renders it)."""
    ranks = res["ranks"]
    s0 = ranks[0]["stats"]
    lines = [
        f"# Soak: ACCO adaptive, {s0['committed_steps']} optimizer steps, {len(ranks)} ranks"
        f"{' (small model)' if args.small else ''}",
        "",
        f"- Date: {res['date']}",
        f"- Machine: {res['machine']}",
        f"- Versions: {res['versions']}",
        f"- Model: TinyGPT {res['model']} ({res['params']:,} parameters), micro-batch {args.micro_batch}, "
        f"gradient_accumulation_steps 2, max_micro_batches_per_round {args.cap or 'null'}, fp32, gloo",
        f"- Speeds: every {args.phase} steps each rank draws a slowdown factor in [1, {args.max_slow:g}] "
        "(extra real compute per micro-batch)",
        f"- Command: `{res['command']}` ({res['elapsed_s']:.0f} s); raw results: the JSON beside this file "
        "(`python benchmarks/soak.py --from-json <it>` re-renders this table)",
        "",
        "| rank | micro-batches computed | wall s | extra compute s | slowdown factors (first 8) | peak RSS MB "
        "per tenth after warm-up | threads | open files |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in ranks:
        peaks = window_peaks(r, args)
        lines.append(
            f"| {r['rank']} | {r['stats']['micro_batches_local']} | {r['wall_s']:.0f} | {r['spin_s']:.0f} | "
            f"{', '.join(f'{f:.2f}' for f in r['factors'][:8])} | {', '.join(f'{p:.0f}' for p in peaks)} | "
            f"{r['threads'][0]} -> {r['threads'][1]} | {r['open_files'][0]} -> {r['open_files'][1]} |"
        )
    lines += [
        "",
        f"Rounds {s0['rounds']}, commits {s0['committed_steps']}, micro-batches committed "
        f"{s0['micro_batches_committed']}, discarded {s0['micro_batches_discarded']}, skipped commits "
        f"{s0['skipped_steps']}; micro-batches per round in the last round: {s0['last_round_counts']}.",
        "",
        "| check | result | detail |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {'pass' if ok else 'FAIL'} | {detail} |" for name, ok, detail in checks]
    return "\n".join(lines) + "\n"


def render(args, res: dict, out: Path, name: str = "soak", checks_json: bool = True) -> int:
    """Check ``res``, write ``<out>/<name>.md`` (and ``<out>/checks.json``); 0 when every check holds."""
    checks = check(res, args)
    text = report(res, checks, args)
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(text)
    if checks_json:
        rows = [{"check": n, "ok": ok, "detail": d} for n, ok, d in checks]
        (out / "checks.json").write_text(json.dumps(rows))
    return 0 if all(ok for _, ok, _ in checks) else 1


def driver(args) -> int:
    if args.from_json:
        src = Path(args.from_json)
        res = json.loads(src.read_text())
        return render(argparse.Namespace(**res["args"]), res, src.parent, src.stem, checks_json=False)
    sys.path.insert(0, str(REPO))
    from tests.launch import deepspeed_cmd, free_port

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    passthrough = list(sys.argv[1:])
    cmd = deepspeed_cmd() + [
        "--num_gpus",
        str(args.world),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(Path(__file__).resolve()),
        "--worker",
        *passthrough,
        "--out",
        str(out),
    ]
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    )
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    elapsed = time.time() - t0
    if proc.returncode != 0:
        print((proc.stdout + proc.stderr)[-6000:], file=sys.stderr)
        print(f"soak: the ranks failed (rc={proc.returncode})", file=sys.stderr)
        return 2
    res = json.loads((out / "soak.json").read_text())
    res["elapsed_s"] = elapsed
    res["date"] = datetime.datetime.now().isoformat(timespec="seconds")
    res["command"] = "python benchmarks/soak.py " + " ".join(sys.argv[1:])
    (out / "soak.json").write_text(json.dumps(res, indent=1) + "\n")
    rc = render(argparse.Namespace(**res["args"]), res, out)  # as --from-json does: the same table
    if not args.no_write:
        name = "soak_small" if args.small else "soak"
        RESULTS.mkdir(parents=True, exist_ok=True)
        for ext in ("json", "md"):
            (RESULTS / f"{name}.{ext}").write_text((out / f"soak.{ext}").read_text())
    return rc


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000, help="optimizer steps (commits) to reach")
    ap.add_argument(
        "--max-engine-steps", type=int, default=20000, help="stop there even if --steps is not reached"
    )
    ap.add_argument("--cap", type=int, default=4, help="max_micro_batches_per_round (null: 0)")
    ap.add_argument("--check-every", type=int, default=50, help="engine steps between two stop checks")
    ap.add_argument("--world", type=int, default=2, help="ranks")
    ap.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch per rank")
    ap.add_argument("--small", action="store_true", help="a 2-layer d_model 64 context 64 model (tests)")
    ap.add_argument("--phase", type=int, default=50, help="steps between two changes of the ranks' speeds")
    ap.add_argument("--max-slow", type=float, default=2.0, help="largest slowdown factor drawn")
    ap.add_argument("--sample-every", type=int, default=10, help="steps between two RSS samples")
    ap.add_argument(
        "--warmup", type=float, default=0.2, help="fraction of the run before memory must be flat"
    )
    ap.add_argument("--rss-tol-mb", type=float, default=16.0, help="allowed peak-RSS growth after warm-up")
    ap.add_argument("--out", default=str(REPO / "acco_out" / "soak"), help="folder for soak.json")
    ap.add_argument("--no-write", action="store_true", help="do not write benchmarks/results/")
    ap.add_argument(
        "--from-json", default=None, help="re-check and re-render a soak.json of an earlier run beside it"
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main() -> int:
    args = parse()
    if args.worker:
        worker(args)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
