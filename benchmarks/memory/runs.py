"""One memory benchmark run: the ranks of one contender on one model, launched and summarised.

Contract: ``run_one(work, case, contender, ...)`` writes ``<work>/<case>/<contender>/spec.json`` and
``ds_config.json``, starts the ranks exactly as ``acco-train`` does (``acco_ds.cli.launch``: the
DeepSpeed launcher on 127.0.0.1, gloo on CPU, ``threads`` per rank), each running
``benchmarks.ranks.memory`` (as a module), and returns the run's figures: per rank the baseline, the
peak and the phase of the peak (fp16: its skipped steps and final loss scale), and the row's figures taken on the
rank with the highest peak. ``env`` is added to the ranks' environment. A failed launch raises ``LaunchError`` (with the end of the ranks' log).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from acco_ds.cli import dsconfig
from acco_ds.cli.launch import free_port, launch_command, run_ranks
from acco_ds.plan.memory_model import COMPRESSED
from acco_ds.plan.model import COMPRESSION_CONFIG

RANK_MODULE = "benchmarks.ranks.memory"


def ds_config(
    contender: str,
    world: int,
    dtype: str,
    n_params: int,
    micro_batch: int,
    grad_accum: int,
    steps: int,
    initial_scale_power: int = 16,
):
    """The contender's DeepSpeed config: acco-train's (``acco_ds.cli.dsconfig``) for these knobs; ``acco-int8``:
    acco's with every exchange int8 (``optimizer.params.compression``). ``dtype`` "fp16": every contender the same
    ``fp16`` section (dynamic loss scaling from 2 ** ``initial_scale_power``)."""
    if dtype not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"unknown dtype {dtype!r}: bf16, fp16 or fp32")
    knobs = dsconfig.Knobs(
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        world_size=world,
        warmup_steps=1,
        total_steps=steps,
        bf16=dtype == "bf16",
        fp16=dtype == "fp16",
        initial_scale_power=initial_scale_power,
        num_params=n_params,
    )
    if contender in COMPRESSED:
        cfg = dsconfig.build_config(contender.removesuffix("-int8"), knobs)
        cfg["optimizer"]["params"]["compression"] = dict(COMPRESSION_CONFIG)
        return cfg
    return dsconfig.build_config(contender, knobs)


def run_one(
    work: Path,
    case: str,
    contender: str,
    model: dict,
    n_params: int,
    dtype: str,
    world: int,
    steps: int,
    micro_batch: int,
    grad_accum: int,
    threads: int,
    seed: int,
    device: str,
    timeout: float,
    env: dict | None = None,
    initial_scale_power: int = 16,
) -> dict:
    run_dir = Path(work) / case / contender
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in run_dir.glob("rank*.json"):
        old.unlink()
    cfg = ds_config(contender, world, dtype, n_params, micro_batch, grad_accum, steps, initial_scale_power)
    spec = {
        "run_dir": str(run_dir),
        "model": model,
        "ds_config": cfg,
        "dtype": dtype,
        "steps": steps,
        "micro_batch": micro_batch,
        "grad_accum": grad_accum,
        "threads": threads,
        "seed": seed,
        "device": device,
    }
    (run_dir / "spec.json").write_text(json.dumps(spec, indent=1))
    (run_dir / "ds_config.json").write_text(json.dumps(cfg, indent=1))
    cmd = launch_command(
        None, world, free_port(), target=RANK_MODULE, extra=["--spec", str(run_dir / "spec.json")]
    )
    extra = (
        {"DS_ACCELERATOR": "cuda"}
        if device == "cuda"
        else {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    )
    extra.update(env or {})
    started = time.perf_counter()
    run_ranks(cmd, threads, log_path=run_dir / "launch.log", timeout=timeout, env_extra=extra)
    wall = time.perf_counter() - started
    ranks = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(world)]
    return summarize(ranks, wall)


def summarize(ranks: list, wall_s: float) -> dict:
    """The row's figures from the ranks' records: the rank with the highest peak decides (its
    baseline beside it); every rank's baseline and peak are kept."""
    top = max(ranks, key=lambda r: r["peak"])
    return {
        "peak": top["peak"],
        "baseline": top["baseline"],
        "peak_phase": top["peak_phase"],
        "params": top["params"],
        "held": top["held"],
        "live_tensor_bytes_end": top["live_tensor_bytes_end"],
        "rank_peaks": [r["peak"] for r in ranks],
        "rank_baselines": [r["baseline"] for r in ranks],
        "marks": top["marks"],
        "device": top["device"],
        "threads": top["threads"],
        "max_reserved": top.get("max_reserved"),
        "wall_s": round(wall_s, 1),
        "param_dtype": top.get("param_dtype"),
        # fp16: every rank's engine.skipped_steps and loss scale at the end (None in bf16 / fp32)
        "skipped_steps": [r.get("skipped_steps") for r in ranks],
        "loss_scale": [r.get("loss_scale") for r in ranks],
    }
