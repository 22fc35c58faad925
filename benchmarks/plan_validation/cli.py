"""acco-plan's predictions against what was measured on this machine, and against the paper's ratios.

    python -m benchmarks.plan_validation                # reads benchmarks/results/{e2e,topology,memory,kernels}/
    python -m benchmarks.plan_validation --note "..."   # a line for the Notes section (kept in the JSON)
    python -m benchmarks.plan_validation --from-json benchmarks/results/plan_validation/plan_validation.json

Re-runnable from whatever the result files hold. The calibration inputs are the
quantities measured SEPARATELY from the runs predicted, never the contender runs themselves:

- the micro-batch compute time: the e2e benchmark's compute-only bound (``analysis.compute_only``: the mean
  over ranks of the median micro-batch time of its best run);
- the link: per rate, the e2e comm-only probe (``benchmarks.ranks.comm_probe``): the bus bandwidth per rank is
  ``(W-1)/W x bytes / t`` of acco_ds's reduce-scatter alone; latency 0 (the probe has one message
  size, so it cannot separate a latency from a bandwidth); the tc rate / W (all ranks share one
  throttled loopback) is shown beside it as a check;
- the optimizer's memory bandwidth: the streaming (triad) bandwidth the kernel benchmark measured
  (``kernels/kernels_cpu.md``); its share of a step here is below 0.5%;
- ``--accelerator cpu``: gloo on CPU, where DeepSpeed's side streams are no-ops.

Then every e2e contender at every rate, the heterogeneous runs (ZeRO-1 and fixed ACCO at the slow
rank's pace), and the memory benchmark's peaks are predicted and compared; the paper's reported ratios
are compared with predictions from stated, assumed inputs. Writes ``<out>/plan_validation.md`` and
``.json`` (default ``benchmarks/results/plan_validation/``) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from pathlib import Path

from acco_ds.plan import units
from acco_ds.plan.model import COMPRESSED_CONTENDERS, CONTENDERS, PlanInputs, predict
from benchmarks.harness import analysis
from benchmarks.harness.cli import parser
from benchmarks.harness.records import results_dir
from benchmarks.plan_validation.paper import validate_paper
from benchmarks.plan_validation.report import render

PREDICTED = CONTENDERS + COMPRESSED_CONTENDERS
"""The contenders acco-plan has a row for (the compressed ones: every exchange int8)."""
DEFAULT_STREAM_BW = 30e9  # only if kernels_cpu.md is missing; the optimizer step is < 0.5% of a step here


def parse(argv=None) -> argparse.Namespace:
    ap = parser("plan_validation", __doc__)
    ap.add_argument(
        "--e2e", default=str(results_dir("e2e") / "e2e.json"), help="the e2e benchmark's raw JSON"
    )
    ap.add_argument(
        "--e2e-compression",
        default=str(results_dir("e2e") / "e2e_compression.json"),
        help="the e2e benchmark's raw JSON of the compressed contenders (skipped if absent)",
    )
    ap.add_argument(
        "--memory",
        default=str(results_dir("memory") / "memory.json"),
        help="the memory benchmark's raw JSON (skipped if absent)",
    )
    ap.add_argument(
        "--kernels",
        default=str(results_dir("kernels") / "kernels_cpu.md"),
        help="the kernel benchmark's table (stream bandwidth)",
    )
    ap.add_argument(
        "--topology",
        default=str(results_dir("topology") / "topology.json"),
        help="the topology benchmark's raw JSON (skipped if absent)",
    )
    ap.add_argument(
        "--out", default=str(results_dir("plan_validation")), help="folder of plan_validation.md / .json"
    )
    ap.add_argument("--prefix", default="plan_validation")
    ap.add_argument(
        "--note", action="append", default=[], help="a line for the Notes section (kept in the JSON)"
    )
    ap.add_argument("--from-json", default=None, help="re-render from a saved plan_validation.json")
    return ap.parse_args(argv)


def stream_bw(path: Path) -> tuple:
    """The streaming bandwidth bench_kernels measured (the best of copy/triad), bytes/s, and its source."""
    if not path.is_file():
        return DEFAULT_STREAM_BW, f"default {DEFAULT_STREAM_BW / 1e9:g} GB/s ({path.name} missing)"
    text = path.read_text()
    m = re.search(r"copy ([0-9.]+) GB/s, triad ([0-9.]+) GB/s", text)
    if not m:
        return (
            DEFAULT_STREAM_BW,
            f"default {DEFAULT_STREAM_BW / 1e9:g} GB/s (no bandwidth line in {path.name})",
        )
    bw = max(float(m.group(1)), float(m.group(2))) * 1e9
    return bw, f"{bw / 1e9:.1f} GB/s, streaming bandwidth measured by bench_kernels ({path.name})"


def _err(pred, meas):
    return None if pred is None or not meas else pred / meas - 1


def step_row(rate: str, label: str, run: dict, p, dp_world: int, micro_batch: int) -> dict:
    """One measured run beside acco-plan's row ``p`` for it: step time, samples/s, micro-batches per
    step per data-parallel rank."""
    mbs = run["samples"] / run["steps"] / dp_world / micro_batch if run["steps"] else None
    return {
        "rate": rate,
        "contender": label,
        "measured_step_s": run["step_time_s"],
        "predicted_step_s": p.step_s,
        "step_err": _err(p.step_s, run["step_time_s"]),
        "measured_samples_per_s": run["samples_per_s"],
        "predicted_samples_per_s": p.samples_per_s,
        "samples_err": _err(p.samples_per_s, run["samples_per_s"]),
        "measured_mb_per_step": mbs,
        "predicted_mb_per_step": p.micro_batches_per_step,
        "repeats": [x.get("samples_per_s") for x in run.get("repeats", [])],
    }


def cpu_inputs(setup: dict, t_mb: float, hbm: float, bucket: float, **topology) -> PlanInputs:
    """The plan's inputs for a CPU benchmark run of ``setup`` (its micro-batch, GAS, and bf16 or fp32 for the
    parameters and the communication): one micro-batch ``t_mb`` s, memory bandwidth ``hbm``, reduce bucket
    ``bucket``; ``topology``: the parameters, nodes, ranks per node, tp and the link."""
    dt = "bf16" if setup.get("bf16") else "fp32"
    return PlanInputs(
        t_micro_batch=t_mb,
        micro_batch=setup["micro_batch"],
        gas=setup["grad_accum"],
        param_dtype=dt,
        comm_dtype=dt,
        hbm_bw=hbm,
        accelerator="cpu",
        reduce_bucket=bucket,
        **topology,
    )


def e2e_inputs(setup: dict, t_mb: float, bw: float, hbm: float, bucket: float) -> PlanInputs:
    topology = dict(params=setup["n_params"], nodes=1, gpus_per_node=setup["world"], tp=1)
    return cpu_inputs(setup, t_mb, hbm, bucket, intra_bw=bw, intra_latency=0.0, **topology)


def _calibrated(res: dict) -> tuple:
    """A sweep's compute-only figures (``analysis.compute_only``), their mean micro-batch time, and the
    DeepSpeed settings each contender ran with (``{}`` where the results predate them)."""
    comp = analysis.compute_only(res)
    return comp, comp["t_mb_mean"], res.get("ds_settings", {})


def _measured_runs(block: dict, ds: dict, default_bucket: float):
    """``(label, run, reduce bucket)`` for each contender's run of one rate's ``block`` that has a step time;
    the bucket: the one DeepSpeed's settings ``ds`` name for it, else ``default_bucket``."""
    for label, run in block["runs"].items():
        if label not in PREDICTED or not isinstance(run, dict) or "step_time_s" not in run:
            continue
        yield label, run, (ds.get(label) or {}).get("reduce_bucket_size") or default_bucket


def validate_e2e(e2e: dict, hbm: float) -> dict:
    res = e2e["results"]
    setup, W = res["setup"], res["setup"]["world"]
    comp, t_mb, ds = _calibrated(res)
    rows, calib = [], []
    for rate, block in res["rates"].items():
        c = block["comm"]
        t_rs = c.get("p2p_s") or c["rs_s"]
        bw = (W - 1) / W * c["bytes"] / t_rs
        tc = None if rate == "none" else units.parse_bandwidth(rate) / W
        calib.append(
            {
                "rate": rate,
                "probe_rs_s": t_rs,
                "probe_ag_s": c["ag_s"],
                "probe_ar_s": c["ar_s"],
                "bw": bw,
                "bw_from_tc_rate": tc,
                "bw_from_ag": (W - 1) / W * c["bytes"] / c["ag_s"],
            }
        )
        for label, run, bucket in _measured_runs(block, ds, setup["n_params"]):
            p = predict(e2e_inputs(setup, t_mb, bw, hbm, bucket)).row(label)
            rows.append(step_row(rate, label, run, p, W, setup["micro_batch"]))
    hetero = []
    h = res.get("hetero")
    if h:
        block = res["rates"][h["rate"]]
        cal = next(x for x in calib if x["rate"] == h["rate"])
        slow = comp["t_mb"][h["slow_rank"]] + h["extra_s"]
        for label, run in h["runs"].items():
            if label == "acco-adaptive" or label not in CONTENDERS:
                hetero.append({"contender": label, "measured_step_s": run["step_time_s"], "predicted_step_s": None,
                               "step_err": None, "why": "acco-plan has one micro-batch time for every GPU"})  # fmt: skip
                continue
            bucket = (ds.get(label) or {}).get("reduce_bucket_size") or setup["n_params"]
            p = predict(e2e_inputs(setup, slow, cal["bw"], hbm, bucket)).row(label)
            hetero.append(
                {
                    "contender": label,
                    "measured_step_s": run["step_time_s"],
                    "predicted_step_s": p.step_s,
                    "step_err": _err(p.step_s, run["step_time_s"]),
                    "why": f"the slow rank sets the pace: t_mb {slow * 1e3:.1f} ms",
                }
            )
    m = res["machine"]
    return {
        "source": {
            "date": m.get("date"),
            "command": res.get("command"),
            "acco_ds": m.get("acco_ds"),
            "bound": res.get("bound_loop")
            or "the earlier compute-only run (a plain model loop on the 2 ranks of one job; the sweep "
            "predates the corrected bound)",
        },
        "t_mb_s": t_mb,
        "t_mb_ranks_s": list(comp["t_mb"]),
        "world": W,
        "setup": {k: setup[k] for k in ("n_params", "micro_batch", "grad_accum", "world", "steps", "warmup")},
        "calibration": calib,
        "rows": rows,
        "hetero": hetero,
        "hetero_rate": h["rate"] if h else None,
    }


def validate_topology(topo: dict, hbm: float) -> dict:
    """bench_topology's runs: 2 nodes x ``tp`` ranks, tensor parallelism inside a node, data
    parallelism (W = 2) across. Calibration, measured separately from the runs: the micro-batch time
    of its compute-only bound (each node's replica alone, its tensor-parallel all-reduces inside the
    micro-batch) and, per rate, its comm-only probe, which times both data-parallel groups at once
    over the one link: the node's bandwidth is then ``tp x (W-1)/W x slice bytes / t`` (each group
    gets ``bw_node / tp`` in the model)."""
    res = topo["results"]
    setup = res["setup"]
    tp, slice_numel = setup["tp"], setup["n_params"]
    comp, t_mb, ds = _calibrated(res)
    rows, calib = [], []
    for rate, block in res["rates"].items():
        c = block["comm"]
        W = c["dp_world"]
        t_rs = c.get("p2p_s") or c["rs_s"]
        node_bw = tp * (W - 1) / W * c["bytes"] / t_rs
        calib.append(
            {
                "rate": rate,
                "probe_rs_s": t_rs,
                "probe_ag_s": c["ag_s"],
                "node_bw": node_bw,
                "bw_from_tc_rate": None if rate == "none" else units.parse_bandwidth(rate),
            }
        )
        for label, run, bucket in _measured_runs(block, ds, slice_numel):
            # params: the plan divides by tp: each rank's slice
            topology = dict(params=slice_numel * tp, nodes=W, gpus_per_node=tp, tp=tp)
            inputs = cpu_inputs(setup, t_mb, hbm, bucket, inter_bw=node_bw, inter_latency=0.0, **topology)
            p = predict(inputs).row(label)
            rows.append(step_row(rate, label, run, p, W, setup["micro_batch"]))
    m = res["machine"]
    return {
        "source": {"date": m.get("date"), "command": res.get("command"), "acco_ds": m.get("acco_ds")},
        "t_mb_s": t_mb,
        "t_mb_ranks_s": list(comp["t_mb"]),
        "tp": tp,
        "slice_params": slice_numel,
        "model_params": res.get("model_params"),
        "setup": {k: setup[k] for k in ("micro_batch", "grad_accum", "world", "steps", "warmup")},
        "calibration": calib,
        "rows": rows,
    }


def validate_memory(mem: dict) -> dict:
    res = mem["results"]
    rows = []
    for case in res["cases"]:
        n, W, dt = case["params"], case["world"], case["dtype"]
        largest = case.get("largest", 0) / n
        for label, run in case["runs"].items():
            if not isinstance(run, dict) or "peak" not in run or label not in CONTENDERS:
                continue
            # bench_memory's configs: zero1 one bucket of all parameters, zero2 a quarter
            bucket = n / 4 if label == "zero2" else n
            i = PlanInputs(
                params=n, t_micro_batch=1.0, micro_batch=1, gas=2, gpus_per_node=W, param_dtype=dt,
                comm_dtype=dt, intra_bw=1e9, accelerator="cpu", reduce_bucket=bucket, largest_frac=largest,
            )  # fmt: skip
            pred = predict(i).row(label).memory_bytes
            meas = run["peak"] - run["baseline"]
            rows.append(
                {
                    "case": case["key"],
                    "contender": label,
                    "params": n,
                    "measured_bytes": meas,
                    "predicted_bytes": pred,
                    "err": _err(pred, meas),
                    "unexplained_mib": (meas - pred) / 2**20,
                }
            )
    return {"source": {"date": res["machine"].get("date"), "command": res.get("command")}, "rows": rows}


def _command(argv: list) -> str:
    """The command line of the options ``argv``, its --note texts replaced by a count (they are in
    the Notes section)."""
    keep, notes, it = [], 0, iter(argv)
    for x in it:
        if x == "--note":
            next(it, None)
            notes += 1
        elif x.startswith("--note="):
            notes += 1
        else:
            keep.append(x)
    tail = f" (+ {notes} --note, in Notes)" if notes else ""
    return " ".join(["python -m benchmarks.plan_validation", *map(shlex.quote, keep)]) + tail


def main(argv=None) -> int:
    a = parse(argv)
    out = Path(a.out)
    if a.from_json:
        v = json.loads(Path(a.from_json).read_text())
        v["notes"] = v.get("notes", []) + a.note
    else:
        hbm, hbm_source = stream_bw(Path(a.kernels))
        mem_path, topo_path, comp_path = Path(a.memory), Path(a.topology), Path(a.e2e_compression)
        v = {
            "meta": {
                "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                "command": _command(sys.argv[1:] if argv is None else argv),
                "hbm_bw": hbm,
                "hbm_source": hbm_source,
            },
            "e2e": validate_e2e(json.loads(Path(a.e2e).read_text()), hbm),
            "e2e_compression": validate_e2e(json.loads(comp_path.read_text()), hbm)
            if comp_path.is_file()
            else None,
            "topology": validate_topology(json.loads(topo_path.read_text()), hbm)
            if topo_path.is_file()
            else None,
            "memory": validate_memory(json.loads(mem_path.read_text())) if mem_path.is_file() else None,
            "paper": validate_paper(),
            "notes": a.note,
        }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.prefix}.json").write_text(json.dumps(v, indent=1) + "\n")
    md = render(v)
    (out / f"{a.prefix}.md").write_text(md)
    print(md)
    return 0
