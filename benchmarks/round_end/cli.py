"""The training thread's work at ACCO's round ends, measured on this machine's CPU (one rank, gloo).

For each mode (sync, dpu, acco), parameter dtype (fp32, bf16, fp16 with its loss scaler) and exchange (uncompressed;
int8 with the fused round end where the mode compresses), a TinyGPT in two or six parameter groups trains
``--steps`` optimizer steps through a bare ``ACCOPipeline`` (the DeepSpeed engine adds nothing to a round end), with
``benchmarks.round_end.probe`` installed. Per setting: the largest number of operations the training thread
dispatched inside one round end, the fewest a round's job dispatched (on the executor's worker thread), whether
every job ran off the training thread, and the training thread's host time per round end (median and largest over
the steady rounds, its waits for jobs excluded: ``stats.round_end_host_s``, read per round).

    python -m benchmarks.round_end --out benchmarks/results/round_end/cpu       # ~1 min here
    python -m benchmarks.round_end --out DIR --from-json DIR/round_end.json    # re-render

Writes round_end.json and round_end.md to --out. tests/core/test_round_end_host_work.py asserts the operation
bounds on the same probe; this command records them with the host times (speed belongs here, not in a test).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import List

import torch

SETTINGS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
WARMUP_ROUNDS = 2


def settings() -> List[dict]:
    out = []
    for mode in ("sync", "dpu", "acco"):
        for dtype in SETTINGS_DTYPES:
            for compressed in (False, True):
                for groups in (2, 6):
                    out.append({"mode": mode, "dtype": dtype, "compressed": compressed, "groups": groups})
    return out


def build(setting: dict, seed: int = 0):
    """(model, pipeline) of ``setting``, in this process's one-rank group."""
    from acco_ds.config import ACCOConfig
    from acco_ds.core.loss_scale import LossScaleSpec
    from acco_ds.core.pipeline import ACCOPipeline
    from acco_ds.models import GPTConfig, TinyGPT
    from acco_ds.ops.adamw_settings import AdamWSettings

    torch.manual_seed(seed)
    model = TinyGPT(GPTConfig(context=32, n_layer=5, d_model=64)).to(SETTINGS_DTYPES[setting["dtype"]])
    params = list(model.parameters())
    n = setting["groups"]
    groups = [params[i::n] for i in range(n)]
    comp = {}
    if setting["compressed"]:
        comp = {"compression": {"commit": "int8", "peek": "int8" if setting["mode"] == "acco" else "none"}}
    cfg = ACCOConfig(mode=setting["mode"], **comp)
    scale = LossScaleSpec(True, 2.0**8) if setting["dtype"] == "fp16" else None
    hypers = [AdamWSettings(1e-3, 0.9, 0.999, 1e-8, 0.01)] * n
    return model, ACCOPipeline(groups, lambda: hypers, cfg, 2, 1.0, loss_scale=scale)


def drive(model, pipe, micro_batches: int, gas: int = 2, seed: int = 1) -> List[float]:
    """Train ``micro_batches`` micro-batches as the DeepSpeed engine drives the pipeline, each backward declared with
    its boundary (so a compressed round's last backward quantizes as it goes: the fused round end); the host seconds
    of each round end."""
    g = torch.Generator().manual_seed(seed)
    per_round = []
    for i in range(micro_batches):
        boundary = (i + 1) % gas == 0
        x = torch.randint(0, 256, (4, 32), generator=g)
        before = (pipe.stats.rounds, pipe.stats.round_end_host_s)
        pipe.on_backward_start(boundary=boundary)
        pipe.scale_loss(model(x, x)).backward()
        pipe.on_micro_batch_end(boundary=boundary)
        if boundary:  # the engine's optimizer step (sync launches its step's job here)
            pipe.end_step()
            pipe.on_engine_step()
        if pipe.stats.rounds > before[0]:
            per_round.append(pipe.stats.round_end_host_s - before[1])
    return per_round


def measure(setting: dict, micro_batches: int) -> dict:
    from benchmarks.round_end.probe import RoundEndProbe

    model, pipe = build(setting)
    probe = RoundEndProbe(pipe)
    try:
        host = drive(model, pipe, micro_batches)
        pipe.finish()
    finally:
        probe.remove()
        pipe.close()
    c = probe.counts
    steady = host[WARMUP_ROUNDS:] or host
    return {
        **setting,
        "round_ends": len(c.training_ops),
        "max_training_ops": c.max_training_ops,
        "training_ops_of_the_largest": dict(max(c.training_ops, key=lambda o: sum(o.values()))),
        "min_job_ops": c.min_job_ops,
        "jobs_off_the_training_thread": all(t != probe.training_thread for t in c.job_threads),
        "host_us_median": 1e6 * statistics.median(steady),
        "host_us_max": 1e6 * max(steady),
    }


def render(raw: dict) -> str:
    lines = [
        "# The training thread's work at a round end (CPU)",
        "",
        f"Measured {raw['date']} on {raw['machine']} (torch {raw['torch']}), one rank, "
        f"{raw['micro_batches']} micro-batches per setting, GAS 2. Command: `{raw['command']}`.",
        "",
        "Operations: ATen operations dispatched inside one round end by the training thread (the largest over the "
        "run) and by the round's job on the executor's worker thread (the fewest). Host time: the training thread "
        f"inside `end_round`, its waits for jobs excluded, over the rounds after the first {WARMUP_ROUNDS}.",
        "",
        "| mode | dtype | exchange | groups | round ends | training-thread ops (max) | job ops (min) | "
        "jobs off the training thread | host us/round end (median) | (max) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in raw["rows"]:
        lines.append(
            f"| {r['mode']} | {r['dtype']} | {'int8, fused' if r['compressed'] else 'none'} | {r['groups']} | "
            f"{r['round_ends']} | {r['max_training_ops']} | {r['min_job_ops']} | "
            f"{'yes' if r['jobs_off_the_training_thread'] else 'NO'} | {r['host_us_median']:.0f} | "
            f"{r['host_us_max']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.round_end", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--micro-batches", type=int, default=24)
    ap.add_argument("--from-json", type=Path)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        raw = json.loads(args.from_json.read_text())
    else:
        from acco_ds.deepspeed.cpu_fp16 import allow_fp16_on_cpu
        from tests.ranks.inproc import ensure_single_rank_group

        allow_fp16_on_cpu()
        ensure_single_rank_group()
        torch.set_num_threads(1)
        raw = {
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch thread",
            "torch": torch.__version__,
            "micro_batches": args.micro_batches,
            "command": "python -m benchmarks.round_end "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "rows": [measure(s, args.micro_batches) for s in settings()],
        }
        (args.out / "round_end.json").write_text(json.dumps(raw, indent=1) + "\n")
    (args.out / "round_end.md").write_text(render(raw))
    print(render(raw))
    return 0
