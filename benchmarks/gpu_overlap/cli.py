"""Does ACCO's side stream overlap the compute on a real GPU? (docs/GPU.md)

One GPU, one rank (NCCL, W = 1), a bf16 Llama-architecture model of a few hundred million parameters built
from a ``transformers`` LlamaConfig (random weights, nothing downloaded), random token batches on the device.
At W = 1 the collectives are copies, so the real communication is a *stand-in*: every round's job on the side
stream first runs a device sleep (``torch.cuda._sleep``, calibrated in cycles per ms before the runs) of a
chosen multiple of a round's compute time (0, 0.25x ... 2x). Runs:

- ``compute``: the model's forward + backward alone (plain PyTorch, gradients accumulated in ``.grad``): the
  compute time of a micro-batch, hence of a round (micro-batches per round x that);
- ``sync`` and ``acco``: ``deepspeed.initialize`` with the ACCO optimizer in that mode (ZeRO-1, bf16), every
  stand-in duration on the same engine (warm-up steps after each change).

Per setting: T_compute (compute-only time of a round), T_side (the side job's device time per round, stand-in
included, measured with CUDA events on the side stream), T_round (device time per round: CUDA events on the
compute stream at step boundaries / rounds per step), overlap efficiency = max(T_compute, T_side) / T_round
(1 = perfect overlap; ``sync`` cannot overlap and shows T_compute + T_side), and the host's side: host
seconds per round (wall clock between step starts, no sync), the share of steps the host started while the
device still had the previous step queued (the host ahead), and the host syncs per step made inside the timed
steps (torch.cuda.synchronize, Event/Stream.synchronize, .item() on CUDA tensors; a diagnostic: acco's round end
waits for the previous round's summary by design). Whether the host ever left the device without work is measured
on the kernel timeline of ``--profile-steps`` more acco steps per setting (torch.profiler, recorded in steady state:
two unrecorded steps before them, no device sync in between): the host gaps of the compute stream
(``benchmarks.gpu_overlap.timeline``), kept when over 10 us; the model alone is profiled the same way, and
scripts/gpu/goals.py judges acco's gaps against the threshold or the model alone's longest gap.

    python -m benchmarks.gpu_overlap --out benchmarks/results/gpu_overlap    # ~1-2 min on an H100
    python -m benchmarks.gpu_overlap --out "$OUT" --quick
    python -m benchmarks.gpu_overlap --out DIR --from-json DIR/gpu_overlap.json   # re-render, no GPU needed

Writes gpu_overlap.md (table, machine, versions, command) and gpu_overlap.json to --out. Without a GPU it
exits with status 2 and says so (nothing is measured); ``--from-json`` re-renders the table of a raw JSON.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import List

from benchmarks.gpu_overlap import timeline
from benchmarks.harness.cli import parser

FACTORS = (0.0, 0.25, 0.5, 1.0, 1.5, 2.0)
GAPS_EXPLAINED = 3  # the longest host gaps per profile whose host activity is kept


@dataclass(frozen=True)
class ModelSize:
    hidden: int = 1024
    intermediate: int = 2816
    layers: int = 16
    heads: int = 16
    kv_heads: int = 16
    vocab: int = 32000


SIZES = {"default": ModelSize(), "quick": ModelSize(layers=8), "tiny": ModelSize(64, 176, 2, 4, 4, 128)}


def llama_config(size: ModelSize, seq: int):
    """The transformers LlamaConfig of ``size`` (SDPA attention, untied embeddings; the model is cast to bf16)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=size.vocab,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        max_position_embeddings=max(seq, 128),
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


def llama_param_count(size: ModelSize) -> int:
    """Parameters of LlamaForCausalLM of ``size`` (untied): embedding, lm_head, per layer q/k/v/o + gate/up/down
    + two RMSNorms, and the final norm."""
    head_dim = size.hidden // size.heads
    attn = 2 * size.hidden * size.hidden + 2 * size.hidden * size.kv_heads * head_dim
    layer = attn + 3 * size.hidden * size.intermediate + 2 * size.hidden
    return 2 * size.vocab * size.hidden + size.layers * layer + size.hidden


def ds_config(mode: str, micro_batch: int, gas: int) -> dict:
    """The DeepSpeed config of a ``sync`` / ``acco`` run (ZeRO-1, bf16, throughput timer unsynchronised)."""
    if mode not in ("sync", "dpu", "acco"):
        raise ValueError(f"mode must be sync, dpu or acco, got {mode!r}")
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "ACCO", "params": {"lr": 1e-5, "weight_decay": 0.0, "mode": mode}},
        "zero_optimization": {"stage": 1},
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "timers": {"throughput": {"synchronized": False}},
    }


def rounds_per_step(mode: str) -> int:
    return 2 if mode == "acco" else 1


def efficiency(t_compute: float, t_side: float, t_round: float) -> float:
    """max(T_compute, T_side) / T_round: 1 when the round takes only as long as the longer of the two."""
    return max(t_compute, t_side) / t_round if t_round > 0 else float("nan")


@dataclass
class Setting:
    mode: str
    factor: float  # stand-in / T_compute of a round (requested)
    standin_ms: float  # requested stand-in per round
    t_compute_ms: float
    t_side_ms: float = float("nan")  # measured side-job device time per round (stand-in + real job)
    t_round_ms: float = float("nan")
    host_round_ms: float = float("nan")
    host_ahead: float = float("nan")  # share of steps started while the device had the previous one queued
    host_syncs_per_step: float = float("nan")
    # the training thread inside a round end per round, its waits for jobs excluded (stats.round_end_host_s)
    round_end_host_us: float = float("nan")
    host_gaps_us: List[float] = field(
        default_factory=list
    )  # compute-stream idle the host caused, > 10 us each
    profiled_steps: int = 0
    gap_causes: List[dict] = field(
        default_factory=list
    )  # the longest host gaps and what the host did in them
    rounds: int = 0
    notes: List[str] = field(default_factory=list)

    @property
    def efficiency(self) -> float:
        return efficiency(self.t_compute_ms, self.t_side_ms, self.t_round_ms)


def _stalls_text(gaps: List[float], steps: int) -> str:
    """'<stalls> in <steps> steps (<largest gap in us>)' of host gaps recorded over ``steps`` profiled steps."""
    return f"{len(timeline.stalls(gaps))} in {steps} steps ({max(gaps, default=0.0):.0f})"


def _stall_cell(s: Setting) -> str:
    return _stalls_text(s.host_gaps_us, s.profiled_steps) if s.profiled_steps else "-"


def _profile_method(meta: dict) -> str:
    """How the host gaps were recorded, as the JSON says (runs before the steady-state profile say nothing: their
    profiled step started right after a device sync, and the model alone was not profiled)."""
    if "compute_profiled_steps" not in meta:
        return "."
    steps = meta["compute_profiled_steps"]
    gaps = meta.get("compute_host_gaps_us", [])
    alone = (
        f"{len(timeline.stalls(gaps))} stalls in {steps} steps (largest gap {max(gaps, default=0.0):.0f} us)"
        if steps
        else "not profiled"
    )
    return (
        "; steps recorded in steady state (two steps before them unrecorded, no device sync in between). The model "
        f"alone, profiled the same way: {alone}."
    )


def render(settings: List[Setting], meta: dict) -> str:
    """The Markdown report (a table per mode order as given)."""
    head = (
        "| mode | stand-in (x compute) | stand-in ms/round | T_compute ms/round | T_side ms/round | T_round ms | "
        "overlap efficiency | host ms/round | round end host us | host ahead | host syncs/step | "
        "host stalls (largest gap us) |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in settings:
        lines.append(
            f"| {s.mode} | {s.factor:g} | {s.standin_ms:.1f} | {s.t_compute_ms:.1f} | {s.t_side_ms:.1f} | "
            f"{s.t_round_ms:.1f} | {100 * s.efficiency:.0f}% | {s.host_round_ms:.1f} | {s.round_end_host_us:.0f} | "
            f"{100 * s.host_ahead:.0f}% | "
            f"{s.host_syncs_per_step:.1f} | {_stall_cell(s)} |"
        )
    notes = [f"- {s.mode} x{s.factor:g}: {n}" for s in settings for n in s.notes]
    causes = [("model alone", c) for c in meta.get("compute_gap_causes", [])]
    causes += [(f"{s.mode} x{s.factor:g}", c) for s in settings for c in s.gap_causes]
    md = [
        "# ACCO overlap on one GPU (communication stand-in on the side stream)",
        "",
        f"- Date: {meta['date']}; machine: {meta['machine']}",
        f"- Versions: {meta['versions']}",
        f"- Command: `{meta['command']}`",
        f"- Model: Llama architecture from a transformers LlamaConfig, {meta['params'] / 1e6:.0f}M parameters, "
        f"bf16, random weights; micro-batch {meta['micro_batch']} x {meta['seq']} tokens, "
        f"gradient accumulation {meta['gas']} (acco: 2 rounds of {meta['gas'] // 2} micro-batches per step; "
        f"sync: 1 round of {meta['gas']}); W = 1 on NCCL.",
        "- STAND-IN: at W = 1 the collectives are local copies, so each round's side job first runs a device "
        "sleep (torch.cuda._sleep) of the stated multiple of a round's compute time "
        f"({meta['cycles_per_ms']:.0f} cycles/ms, calibrated before the runs). T_side is measured (CUDA events "
        "on the side stream around the job), not assumed.",
        "- T_compute: forward + backward alone (plain PyTorch) x micro-batches per round. T_round: CUDA events on "
        f"the compute stream at step boundaries / rounds per step, median of {meta['steps']} timed steps after "
        f"{meta['warmup']} warm-up steps per setting. Overlap efficiency = max(T_compute, T_side) / T_round.",
        "- Host: wall clock between step starts (no sync) per round; 'round end host us': the training thread inside "
        "a round end per round, its waits for jobs excluded (the optimizer's stats.round_end_host_s; nan in runs "
        "before it was recorded); 'host ahead' = share of timed steps the host "
        "started while the previous step's end event was still pending on the device; 'host syncs/step' = calls "
        "of torch.cuda.synchronize, Event/Stream.synchronize and .item() on CUDA tensors inside the timed steps "
        f"(compute-only run of the same model: {meta['compute_syncs_per_step']:.1f} per step; a diagnostic: acco "
        "waits for the previous round's summary at each round end by design). 'host stalls': on the kernel "
        "timeline (torch.profiler) of extra acco steps, the times the compute stream ran out of queued work for "
        f"more than {timeline.STALL_THRESHOLD_US:.0f} us because the host had not launched the next op yet (beyond "
        f"the side stream it waited for), and the largest such gap{_profile_method(meta)}",
        "",
        "\n".join(lines),
    ]
    if notes:
        md += ["", "Notes:", *notes]
    if causes:
        md += [
            "",
            "The longest host gaps of each profile and what the launching host thread did in them (self time of "
            "its ATen ops, CUDA calls and Python functions inside the gap, us; profiled with Python tracing "
            "when the command says --profile-python, which slows the host):",
            "",
            "| profile | gap us | the host in it (us) |",
            "|---|---:|---|",
            *(
                f"| {label} | {c['gap_us']:.0f} | "
                + ", ".join(f"`{name.replace('|', '/')}` {us:.0f}" for name, us in c["host"])
                + " |"
                for label, c in causes
            ),
        ]
    if meta.get("host_cpu"):
        md += ["", f"Host CPU: {meta['host_cpu']}."]
    return "\n".join(md) + "\n"


# -- GPU part ----------------------------------------------------------------------------------------------
class HostSyncCounter:
    """Counts host syncs while active: torch.cuda.synchronize, Event/Stream.synchronize, CUDA Tensor.item."""

    def __init__(self):
        self.count = 0
        self._saved = []

    def __enter__(self):
        import torch

        def wrap(owner, name, only_cuda=False):
            original = getattr(owner, name)

            def counted(*a, **k):
                if not only_cuda or (a and getattr(a[0], "is_cuda", False)):
                    self.count += 1
                return original(*a, **k)

            self._saved.append((owner, name, original))
            setattr(owner, name, counted)

        wrap(torch.cuda, "synchronize")
        wrap(torch.cuda.Event, "synchronize")
        wrap(torch.cuda.Stream, "synchronize")
        wrap(torch.Tensor, "item", only_cuda=True)
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()


def calibrate_sleep() -> float:
    """torch.cuda._sleep cycles per millisecond: median of 5 timed sleeps of 20M cycles after a warm-up."""
    import torch

    torch.cuda._sleep(2_000_000)
    rates = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        end.synchronize()
        rates.append(20_000_000 / start.elapsed_time(end))
    return statistics.median(rates)


class SideStandIn:
    """Wraps acco_ds.core.pipeline.run_round_job (the pipeline calls it by that name; the executor's thread runs it
    with the side stream current): sleep ``cycles`` on the current stream, run the job, and record events around
    both to time it. Read ``events`` after ``pipeline.sync_in_flight()``: the thread appends to it."""

    def __init__(self):
        import acco_ds.core.pipeline as pipeline

        self.pipeline = pipeline
        self.original = pipeline.run_round_job
        self.cycles = 0
        self.events: list = []

    def __enter__(self):
        import torch

        def padded(*args, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            if self.cycles > 0:
                torch.cuda._sleep(self.cycles)
            result = self.original(*args, **kwargs)
            end.record()
            self.events.append((start, end))
            return result

        self.pipeline.run_round_job = padded
        return self

    def __exit__(self, *exc):
        self.pipeline.run_round_job = self.original


def init_single_rank() -> None:
    import deepspeed
    import torch

    from acco_ds.cli.launch import free_port

    torch.cuda.set_device(0)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.setdefault("DS_ACCELERATOR", "cuda")
    deepspeed.init_distributed(dist_backend="nccl", verbose=False)


def build_model(size: ModelSize, seq: int, seed: int = 0):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = LlamaForCausalLM(llama_config(size, seq)).to(torch.bfloat16)
    model.config.use_cache = False
    return model


def batches(n: int, micro_batch: int, seq: int, vocab: int):
    import torch

    g = torch.Generator(device="cuda").manual_seed(1234)
    return [torch.randint(0, vocab, (micro_batch, seq), device="cuda", generator=g) for _ in range(n)]


def compute_step(model, data, gas: int, i: int) -> None:
    """A step's micro-batches through the model alone (forward + backward, gradients accumulated in .grad)."""
    for j in range(gas):
        x = data[(i * gas + j) % len(data)]
        model(input_ids=x, labels=x).loss.backward()


def time_compute(model, data, warmup: int, reps: int):
    """Median ms of one micro-batch's forward + backward; host syncs per micro-batch in the model itself."""
    import torch

    for i in range(warmup):
        compute_step(model, data, 1, i)
    torch.cuda.synchronize()
    times = []
    with HostSyncCounter() as syncs:
        for i in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            compute_step(model, data, 1, i)
            end.record()
            times.append((start, end))
    torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    return statistics.median(s.elapsed_time(e) for s, e in times), syncs.count / reps


def train_step(engine, data, gas: int, i: int) -> None:
    """One optimizer step: ``gas`` micro-batches through the engine."""
    for j in range(gas):
        x = data[(i * gas + j) % len(data)]
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()


def run_mode(mode: str, args, size: ModelSize, data, t_mb_ms: float, per_ms: float) -> List[Setting]:
    """All stand-in settings of ``mode`` on one engine."""
    import deepspeed
    import torch

    model = build_model(size, args.seq)
    engine, _, _, _ = deepspeed.initialize(
        model=model, config=ds_config(mode, args.micro_batch, args.gas), model_parameters=model.parameters()
    )
    rps = rounds_per_step(mode)
    t_compute = t_mb_ms * args.gas / rps
    out = []
    with SideStandIn() as standin:
        for k, factor in enumerate(args.factors):
            s = Setting(mode, factor, factor * t_compute, t_compute)
            standin.cycles = int(s.standin_ms * per_ms)
            for i in range(args.warmup + (1 if k == 0 else 0)):  # the first round of a run has no job yet
                train_step(engine, data, args.gas, i)
            # the executor's thread enqueues each job: let it enqueue the last one before the device is drained
            engine.optimizer.pipeline.sync_in_flight()
            torch.cuda.synchronize()
            standin.events.clear()
            ends, host_starts, ahead = [], [], 0
            prev_end = None
            stats = engine.optimizer.pipeline.stats
            host0, rounds0 = stats.round_end_host_s, stats.rounds
            with HostSyncCounter() as syncs:
                for i in range(args.steps):
                    host_starts.append(time.perf_counter())
                    if prev_end is not None and not prev_end.query():
                        ahead += 1
                    if i == 0:
                        first = torch.cuda.Event(enable_timing=True)
                        first.record()
                    train_step(engine, data, args.gas, i)
                    prev_end = torch.cuda.Event(enable_timing=True)
                    prev_end.record()
                    ends.append(prev_end)
                host_starts.append(time.perf_counter())
            engine.optimizer.pipeline.sync_in_flight()
            torch.cuda.synchronize()
            marks = [first, *ends]
            step_ms = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
            s.t_round_ms = statistics.median(step_ms) / rps
            s.host_round_ms = (
                statistics.median(b - a for a, b in zip(host_starts, host_starts[1:])) * 1e3 / rps
            )
            s.host_ahead = ahead / max(1, args.steps - 1)
            s.host_syncs_per_step = syncs.count / args.steps
            if stats.rounds > rounds0:
                s.round_end_host_us = 1e6 * (stats.round_end_host_s - host0) / (stats.rounds - rounds0)
            s.rounds = len(standin.events)
            if s.rounds:
                s.t_side_ms = statistics.median(a.elapsed_time(b) for a, b in standin.events)
            if s.rounds != rps * args.steps:
                s.notes.append(f"{s.rounds} side jobs in {args.steps} steps (expected {rps * args.steps})")
            print(
                f"{mode} x{factor:g}: T_round {s.t_round_ms:.1f} ms, T_side {s.t_side_ms:.1f} ms, T_compute "
                f"{t_compute:.1f} ms, efficiency {100 * s.efficiency:.0f}%, host {s.host_round_ms:.1f} ms/round, "
                f"ahead {100 * s.host_ahead:.0f}%, syncs/step {s.host_syncs_per_step:.1f}",
                flush=True,
            )
            if mode == "acco" and args.profile_steps:
                s.host_gaps_us, s.gap_causes = profile_host_gaps(
                    partial(train_step, engine, data, args.gas), args.profile_steps, args.profile_python
                )
                s.profiled_steps = args.profile_steps
                print(f"{mode} x{factor:g}: host stalls {_stall_cell(s)}", flush=True)
                print_gap_causes(f"{mode} x{factor:g}", s.gap_causes)
            out.append(s)
    engine.optimizer.finish()
    engine.optimizer.pipeline.close()
    del engine, model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def print_gap_causes(label: str, causes: List[dict]) -> None:
    for c in causes:
        host = ", ".join(f"{name} {us:.0f}" for name, us in c["host"])
        print(f"{label}: gap {c['gap_us']:.0f} us, the host in it (us): {host}", flush=True)


def profile_host_gaps(step, steps: int, python: bool = False, explain: int = GAPS_EXPLAINED) -> tuple:
    """(gaps, causes): the compute stream's host gaps over 10 us (:func:`benchmarks.gpu_overlap.timeline.host_gaps`
    of the exported kernel timeline) in ``steps`` calls of ``step(i)`` recorded in steady state: two calls run
    first under the profiler's schedule unrecorded (wait, warm-up), with no device sync between them and the
    recorded ones, so the first recorded ops do not start from an empty queue the benchmark itself drained; and
    for the ``explain`` longest gaps, what the host was doing (:func:`timeline.host_activity`; Python functions
    too with ``python``, at the cost of a slower host while recording)."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    torch.cuda.synchronize()
    plan = schedule(wait=1, warmup=1, active=steps, repeat=1)
    with profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], schedule=plan, with_stack=python
    ) as prof:
        for i in range(steps + 2):
            step(i)
            if i == steps + 1:
                torch.cuda.synchronize()  # the last recorded ops end inside the recorded window
            prof.step()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    intervals = timeline.host_gap_intervals(timeline.ops_from_trace(trace))
    gaps = [round(end - start, 1) for start, end, _ in intervals if end - start > 10.0]
    longest = sorted(intervals, key=lambda iv: iv[0] - iv[1])[:explain]
    causes = [
        {
            "gap_us": round(end - start, 1),
            "host": [[n, round(us, 1)] for n, us in timeline.host_activity(trace, start, end, tid)],
        }
        for start, end, tid in longest
    ]
    return gaps, causes


def host_cpu() -> str:
    """The host's CPU model, cores this process may use, and load average (the host launches every kernel)."""
    model = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        load = "?"
    return f"{model}, {len(os.sched_getaffinity(0))} usable cores, load average {load}"


def versions() -> str:
    import torch

    vs = [f"python {platform.python_version()}", f"torch {torch.__version__} (CUDA {torch.version.cuda})"]
    for mod in ("deepspeed", "transformers", "triton"):
        try:
            vs.append(f"{mod} {__import__(mod).__version__}")
        except Exception:  # noqa: BLE001 - only reporting
            vs.append(f"{mod} (not importable)")
    return ", ".join(vs)


def parse_args(argv=None):
    ap = parser("gpu_overlap", __doc__)
    ap.add_argument("--out", required=True, help="folder for gpu_overlap.md and gpu_overlap.json")
    ap.add_argument("--quick", action="store_true", help="8 layers, fewer steps (for a time-bounded check)")
    ap.add_argument("--size", choices=sorted(SIZES), default=None)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--gas", type=int, default=4, help="gradient accumulation steps (even)")
    ap.add_argument("--modes", default="sync,acco")
    ap.add_argument("--factors", type=lambda s: [float(x) for x in s.split(",")], default=list(FACTORS))
    ap.add_argument("--steps", type=int, default=None, help="timed steps per setting")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--profile-steps",
        type=int,
        default=1,
        help="acco steps per setting on the profiler's kernel timeline (0: off)",
    )
    ap.add_argument(
        "--profile-python",
        action="store_true",
        help="record Python functions on the profiled steps too (names what the host did in its longest gaps; "
        "slows the host while recording)",
    )
    ap.add_argument(
        "--from-json", default=None, help="re-render gpu_overlap.md into --out from a saved gpu_overlap.json"
    )
    args = ap.parse_args(argv)
    if args.gas < 2 or args.gas % 2:
        ap.error(f"--gas must be even and >= 2 (acco runs two rounds of gas/2), got {args.gas}")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in args.modes:
        if m not in ("sync", "dpu", "acco"):
            ap.error(f"--modes: {m!r} is not one of sync, dpu, acco")
    if any(f < 0 for f in args.factors):
        ap.error(f"--factors must be >= 0, got {args.factors}")
    args.size = args.size or ("quick" if args.quick else "default")
    args.steps = args.steps or (4 if args.quick else 8)
    return args


def write(out: Path, settings: List[Setting], meta: dict) -> str:
    """Write ``gpu_overlap.md`` (``render``) and the raw ``gpu_overlap.json`` into ``out``; returns the table."""
    out.mkdir(parents=True, exist_ok=True)
    md = render(settings, meta)
    (out / "gpu_overlap.md").write_text(md)
    rows = [dict(asdict(s), efficiency=s.efficiency) for s in settings]
    (out / "gpu_overlap.json").write_text(json.dumps({"meta": meta, "settings": rows}, indent=2) + "\n")
    return md


def load(path: Path) -> tuple:
    """(settings, meta) of a ``gpu_overlap.json`` written by ``write``."""
    raw = json.loads(Path(path).read_text())
    names = {f.name for f in fields(Setting)}
    return [Setting(**{k: v for k, v in row.items() if k in names}) for row in raw["settings"]], raw["meta"]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        settings, meta = load(Path(args.from_json))
        print(write(Path(args.out), settings, meta))
        return 0
    import torch

    if not torch.cuda.is_available():
        print(
            "benchmarks.gpu_overlap: needs a CUDA GPU (torch.cuda.is_available() is False): nothing measured.",
            file=sys.stderr,
        )
        return 2
    import acco_ds  # noqa: F401  (registers "ACCO")

    init_single_rank()
    size = SIZES[args.size]
    per_ms = calibrate_sleep()
    data = batches(4, args.micro_batch, args.seq, size.vocab)
    model = build_model(size, args.seq)
    t_mb_ms, compute_syncs = time_compute(model, data, warmup=3, reps=8)
    compute_gaps, compute_causes = [], []
    # the model alone, profiled as the acco steps are: the host gaps ACCO is not part of
    if args.profile_steps:
        compute_gaps, compute_causes = profile_host_gaps(
            partial(compute_step, model, data, args.gas), args.profile_steps, args.profile_python
        )
        model.zero_grad(set_to_none=True)
        print(f"compute-only: host stalls {_stalls_text(compute_gaps, args.profile_steps)}", flush=True)
        print_gap_causes("compute-only", compute_causes)
    params = sum(p.numel() for p in model.parameters())
    del model
    gc.collect()
    torch.cuda.empty_cache()
    print(f"compute-only: {t_mb_ms:.1f} ms per micro-batch ({params / 1e6:.0f}M parameters)", flush=True)
    settings: List[Setting] = []
    for mode in args.modes:
        settings += run_mode(mode, args, size, data, t_mb_ms, per_ms)
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{torch.cuda.get_device_name()}, {os.cpu_count()} CPU cores",
        "versions": versions(),
        "command": " ".join(["python -m benchmarks.gpu_overlap", *(argv or sys.argv[1:])]),
        "params": params,
        "micro_batch": args.micro_batch,
        "seq": args.seq,
        "gas": args.gas,
        "steps": args.steps,
        "warmup": args.warmup,
        "cycles_per_ms": per_ms,
        "compute_ms_per_micro_batch": t_mb_ms,
        "compute_syncs_per_step": compute_syncs * args.gas,
        "compute_host_gaps_us": compute_gaps,
        "compute_profiled_steps": args.profile_steps,
        "compute_gap_causes": compute_causes,
        "host_cpu": host_cpu(),
    }
    out = Path(args.out)
    md = write(out, settings, meta)
    print()
    print(md)
    print(f"written to {out / 'gpu_overlap.md'} and gpu_overlap.json")
    return 0
