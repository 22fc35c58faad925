"""Peak memory per rank: ACCO (acco / dpu / sync) against DeepSpeed ZeRO-1 and ZeRO-2.

    python -m benchmarks.memory            # the sweep: GPT-2 and Llama at ~10M, ~100M, ~350M, bf16 and fp32, W = 2 and 4
    python -m benchmarks.memory --quick    # one small GPT-2, bf16, W = 2, zero1 and acco (what the test runs)
    python -m benchmarks.memory --dtypes bf16,fp16 --world-sizes 2 --contenders zero1,acco   # fp16 beside bf16
    python -m benchmarks.memory --from-json benchmarks/results/memory/memory.json   # re-render table and plot

Every run starts its ranks with the DeepSpeed launcher on 127.0.0.1 exactly as ``acco-train`` does
(gloo on CPU, 1 thread per rank by default) and trains ``--steps`` optimizer steps of
``--grad-accum`` micro-batches of ``--micro-batch`` x ``--context`` random bytes on a model built from
a ``transformers`` config (``acco_ds.models.hf``: byte vocabulary, nothing downloaded), in the same
dtype for parameters and communication. fp16 runs every contender with the same dynamic loss scaling (the ``fp16``
section of ``acco_ds.cli.dsconfig``, its first scale 2 ** ``--initial-scale-power``); each rank records its skipped
steps and final loss scale, which the table lists. Each rank (``benchmarks.ranks.memory``) records its baseline (RSS after
the imports and the process group, before the model exists) and its peak (``VmHWM``; on GPU
``torch.cuda.max_memory_allocated``). Beside each measured figure: the analytic bytes per parameter
of every buffer (``acco_ds.plan.memory_model``), and every contender's extra peak over ZeRO-1's, measured
(``(peak - peak_zero1) / params``) and analytic. A run whose estimated memory (all its ranks) does
not fit in the memory available now (``MemAvailable`` minus ``--reserve-gib``) is skipped, with the
estimate and the reason recorded, never faked; a run that fails twice is recorded as failed.

Writes ``<out>/<prefix>.md`` (default ``benchmarks/results/memory/``: tables, goals, machine, versions, date,
command), ``<prefix>.json``
(raw: ``--from-json`` re-renders the same table) and ``<prefix>.png``; prints the table last.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

from acco_ds.cli.launch import LaunchError
from acco_ds.cli.metrics import machine_info
from acco_ds.plan import memory_model
from benchmarks.harness import records
from benchmarks.harness.cli import parser
from benchmarks.memory import plot as memory_plot
from benchmarks.memory import runs as memory_runs
from benchmarks.memory import table as memory_table

# size label -> (n_layer, d_model, n_head); the same shapes for both architectures
SIZES = {"3m": (4, 256, 4), "10m": (6, 384, 6), "100m": (14, 768, 12), "350m": (28, 1024, 16)}
ARCHS = ("gpt2", "llama")
GIB = 2**30


MEASURED_DTYPES = ("bf16", "fp16", "fp32")
"""The dtypes this benchmark's ranks build models and configs in (fp16: dynamic loss scaling, fp16 lifted on CPU
ranks by ``acco_ds.deepspeed.cpu_fp16.allow_fp16_on_cpu``)."""


def parse(argv=None) -> argparse.Namespace:
    ap = parser("memory", __doc__)
    ap.add_argument("--quick", action="store_true", help="one small GPT-2, bf16, W=2, zero1/acco (the test)")
    ap.add_argument("--archs", default=None, help="comma-separated: gpt2,llama (default both; quick gpt2)")
    ap.add_argument(
        "--sizes", default=None, help=f"comma-separated of {','.join(SIZES)} (default 10m,100m,350m)"
    )
    ap.add_argument(
        "--dtypes", default=None, help="comma-separated: bf16,fp16,fp32 (default bf16,fp32; quick bf16)"
    )
    ap.add_argument(
        "--initial-scale-power",
        type=int,
        default=16,
        help="fp16: the first loss scale is 2 ** this (DeepSpeed's and acco-train's default 16)",
    )
    ap.add_argument(
        "--world-sizes", default=None, help="comma-separated ranks per run (default 2,4; quick 2)"
    )
    ap.add_argument(
        "--contenders",
        default=None,
        help=f"comma-separated of {','.join(memory_model.CONTENDERS + memory_model.COMPRESSED)} (default "
        f"{','.join(memory_model.CONTENDERS)}; quick zero1,acco)",
    )
    ap.add_argument(
        "--cases",
        default="*",
        help="comma-separated shell patterns on the case names <arch>-<size>-<dtype>-w<W> to keep "
        "(e.g. '*-w2,gpt2-*-w4'); the others are not run and not listed",
    )
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per run")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--context", type=int, default=64, help="tokens (bytes) per sequence")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU per rank, NCCL")
    ap.add_argument(
        "--reserve-gib",
        type=float,
        default=2.0,
        help="memory left free for the rest of the machine: a run whose estimate exceeds MemAvailable minus this is skipped",
    )
    ap.add_argument(
        "--rank-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an environment variable for every rank (e.g. MALLOC_MMAP_THRESHOLD_=131072); recorded",
    )
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    ap.add_argument(
        "--out", default=str(records.results_dir("memory")), help="folder of the table, JSON and plot"
    )
    ap.add_argument("--prefix", default=None, help="file name prefix (default memory, quick: memory_quick)")
    ap.add_argument(
        "--work", default=None, help="scratch folder of the runs (reused: finished runs are kept)"
    )
    ap.add_argument("--from-json", default=None, help="re-render the table and plot from a saved raw JSON")
    ap.add_argument(
        "--note", action="append", default=[], help="a line for the Notes section (kept in the JSON)"
    )
    a = ap.parse_args(argv)
    a.archs = (a.archs or ("gpt2" if a.quick else ",".join(ARCHS))).split(",")
    a.sizes = (a.sizes or ("3m" if a.quick else "10m,100m,350m")).split(",")
    a.dtypes = (a.dtypes or ("bf16" if a.quick else "bf16,fp32")).split(",")
    a.world_sizes = [int(w) for w in (a.world_sizes or ("2" if a.quick else "2,4")).split(",")]
    a.contenders = (a.contenders or ("zero1,acco" if a.quick else ",".join(memory_model.CONTENDERS))).split(
        ","
    )
    for name, values, allowed in (
        ("--archs", a.archs, ARCHS),
        ("--sizes", a.sizes, tuple(SIZES)),
        ("--dtypes", a.dtypes, MEASURED_DTYPES),
        ("--contenders", a.contenders, memory_model.CONTENDERS + memory_model.COMPRESSED),
    ):
        for v in values:
            if v not in allowed:
                ap.error(f"{name}: unknown value {v!r}; choose from {', '.join(allowed)}")
    if "zero1" in a.contenders:  # the reference of every extra: run it first
        a.contenders = ["zero1"] + [c for c in a.contenders if c != "zero1"]
    for w in a.world_sizes:
        if w < 1:
            ap.error(f"--world-sizes: {w} is not a number of ranks >= 1")
    for name in ("steps", "micro_batch", "grad_accum", "context", "threads"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if {"acco", "acco-int8"} & set(a.contenders) and a.grad_accum % 2:
        ap.error(f"acco needs an even --grad-accum (two rounds of GAS/2 per step), got {a.grad_accum}")
    for kv in a.rank_env:
        if "=" not in kv or not kv.split("=", 1)[0]:
            ap.error(f"--rank-env {kv!r} is not KEY=VALUE")
    keys = [f"{x}-{s}-{d}-w{w}" for d in a.dtypes for w in a.world_sizes for s in a.sizes for x in a.archs]
    if not any(fnmatch.fnmatchcase(k, p) for k in keys for p in a.cases.split(",")):
        ap.error(f"--cases {a.cases!r} matches none of the cases: {', '.join(keys)}")
    a.prefix = a.prefix or ("memory_quick" if a.quick else "memory")
    return a


def _log(msg: str) -> None:
    print(f"[benchmarks.memory {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def meminfo() -> dict:
    """MemTotal and MemAvailable of this machine, in bytes (Linux)."""
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("MemTotal", "MemAvailable"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def model_dict(arch: str, size: str, context: int) -> dict:
    n_layer, d_model, n_head = SIZES[size]
    return {"arch": arch, "n_layer": n_layer, "d_model": d_model, "n_head": n_head, "context": context}


def shape_stats(model: dict) -> tuple:
    """(parameters, largest parameter's elements), counted on the meta device."""
    import torch

    from acco_ds.models.hf import build_model

    with torch.device("meta"):
        m = build_model(model)
    sizes = [p.numel() for p in m.parameters()]
    return sum(sizes), max(sizes)


def _versions() -> dict:
    info = machine_info()
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover - the dev extras install it
        info["transformers"] = None
    info["libc"] = " ".join(platform.libc_ver())
    info["mem_total"] = meminfo().get("MemTotal")
    return info


def _fits(contender: str, case: dict, a, baseline: float) -> tuple:
    """(fits, estimate of all ranks in bytes, MemAvailable now)."""
    D = memory_model.DTYPE_SIZE[case["dtype"]]
    per_rank = memory_model.estimate_rank_bytes(
        contender, D, case["world"], case["params"], case["largest"] / case["params"], baseline
    )
    total = per_rank * case["world"]
    avail = meminfo().get("MemAvailable", 0) if a.device == "cpu" else float("inf")
    return total <= avail - a.reserve_gib * GIB, total, avail


def _run_case(case: dict, a, work: Path, failed: list, baseline_guess: list) -> None:
    env = dict(kv.split("=", 1) for kv in a.rank_env)
    for contender in a.contenders:
        run_dir = work / case["key"] / contender
        saved = run_dir / "row.json"
        if saved.exists():
            case["runs"][contender] = json.loads(saved.read_text())
            _log(f"{case['key']} {contender}: reused {saved}")
            continue
        fits, est, avail = _fits(contender, case, a, baseline_guess[0])
        if not fits:
            why = (
                f"estimated {est / GIB:.1f} GiB for {case['world']} ranks > {avail / GIB:.1f} GiB available "
                f"now minus {a.reserve_gib:g} GiB reserve (machine total {meminfo()['MemTotal'] / GIB:.1f} GiB)"
            )
            case["runs"][contender] = {"skipped": why, "estimate": est, "available": avail}
            _log(f"{case['key']} {contender}: SKIPPED: {why}")
            continue
        row, err = None, ""
        for attempt in (1, 2):
            try:
                row = memory_runs.run_one(
                    work,
                    case["key"],
                    contender,
                    case["model"],
                    case["params"],
                    case["dtype"],
                    case["world"],
                    a.steps,
                    a.micro_batch,
                    a.grad_accum,
                    a.threads,
                    a.seed,
                    a.device,
                    a.timeout,
                    env,
                    initial_scale_power=a.initial_scale_power,
                )
                break
            except LaunchError as e:
                err = str(e).splitlines()[0]
                _log(f"{case['key']} {contender}: run failed (attempt {attempt}/2): {err}")
        if row is None:
            failed.append({"case": case["key"], "contender": contender, "why": err})
            case["runs"][contender] = {"failed": err}
            continue
        row["estimate"], row["available_before"] = est, avail
        saved.write_text(json.dumps(row, indent=1))
        case["runs"][contender] = row
        baseline_guess[0] = max(baseline_guess[0], row["baseline"])
        n = case["params"]
        _log(
            f"{case['key']} {contender}: peak {row['peak'] / 2**20:.0f} MiB/rank (baseline {row['baseline'] / 2**20:.0f}, "
            f"{(row['peak'] - row['baseline']) / n:.2f} B/param over it, at {row['peak_phase']}), {row['wall_s']:.0f} s"
        )


def run_all(a) -> dict:
    work = Path(a.work or tempfile.mkdtemp(prefix="acco_bench_memory_"))
    work.mkdir(parents=True, exist_ok=True)
    failed: list = []
    results = {
        "command": shlex.join([sys.executable, "-m", "benchmarks.memory", *sys.argv[1:]]),
        "machine": _versions(),
        "settings": {
            "steps": a.steps,
            "micro_batch": a.micro_batch,
            "grad_accum": a.grad_accum,
            "context": a.context,
            "threads": a.threads,
            "seed": a.seed,
            "device": a.device,
            "initial_scale_power": a.initial_scale_power,
            "reserve_gib": a.reserve_gib,
            "cases": a.cases,
            "rank_env": a.rank_env,
            "contenders": a.contenders,
            "work": str(work),
        },
        "cases": [],
        "failed": failed,
    }
    started = time.time()
    baseline_guess = [0.6 * GIB]
    _log(f"work folder {work}")
    for dtype in a.dtypes:
        for world in a.world_sizes:
            for size in a.sizes:
                for arch in a.archs:
                    key = f"{arch}-{size}-{dtype}-w{world}"
                    if not any(fnmatch.fnmatchcase(key, pat) for pat in a.cases.split(",")):
                        continue
                    model = model_dict(arch, size, a.context)
                    params, largest = shape_stats(model)
                    case = {
                        "key": key,
                        "arch": arch,
                        "size": size,
                        "dtype": dtype,
                        "world": world,
                        "model": model,
                        "params": params,
                        "largest": largest,
                        "runs": {},
                    }
                    _log(f"{case['key']}: {params / 1e6:.1f}M parameters")
                    _run_case(case, a, work, failed, baseline_guess)
                    results["cases"].append(case)
    results["duration_s"] = round(time.time() - started, 1)
    return results


def report(results: dict, out: Path, prefix: str) -> str:
    """Write the table, the raw JSON and the plot of ``results`` into ``out``."""
    md = memory_table.render(results)
    return records.write_report(
        out, prefix, md, {"results": results}, lambda o, p: [memory_plot.plot(results, o / f"{p}.png")]
    )


def main(argv=None) -> int:
    """0 when every run that fits ran; 1 when some run failed twice (named on stderr and in the table)."""
    a = parse(argv)
    if a.from_json:
        results = records.load_results(a.from_json)
        results["notes"] = results.get("notes", []) + a.note
        print(report(results, Path(a.out), a.prefix))
        return 0
    results = run_all(a)
    results["notes"] = list(a.note)
    print(report(results, Path(a.out), a.prefix))
    if results["failed"]:
        names = ", ".join(f"{f['case']}/{f['contender']}" for f in results["failed"])
        print(f"benchmarks.memory: {len(results['failed'])} run(s) failed twice: {names}", file=sys.stderr)
        return 1
    return 0
