"""Kernel microbenchmarks (BENCHMARKS.md section 1): fused AdamW commit / peek, gradient accumulation and the
blockwise int8 quantizer.

Per size: median time, GB/s from the bytes a kernel must read + write (commit 28 B/param, peek 16 B/param,
accumulate grad + buffer read + buffer write, quantize: benchmarks.kernels.table.QUANT_BYTES), the fraction
of the streaming bandwidth measured in the same run (the best of four large-buffer probes on the same thread
count, bytes counted the same way: in-place update, in-place axpy, copy, triad; see
benchmarks.kernels.table.STREAM), and the speed ratio to anchors measured in the same run:
CPU: torch.optim.AdamW(fused=True), AdamW(foreach=True), DeepSpeedCPUAdam; GPU: torch AdamW fused (+ the bf16
copy it needs), DeepSpeed FusedAdam, and the clone/step/restore way of computing ACCO's estimate. The CPU
quantize kernels (quantize_with_residual with fp32, bf16 and fp16 x and residual, dequantize_add into fp32; blocks
of 256; the C++ kernels on the CPU, the Triton ones on a GPU) are measured against their torch reference. The fp16
rows (commit, peek, accumulate, quantize_with_residual, fold_quantize with fp16 where the bf16 rows have bf16) are
compared with their bf16 twins.

    python -m benchmarks.kernels                      # CPU, 1 thread, 1M/10M/100M/10_000_019
    python -m benchmarks.kernels --threads 2 --quick
    python -m benchmarks.kernels --device cuda --out-dir "$OUT"
    python -m benchmarks.kernels --from-json benchmarks/results/kernels/kernels_cpu.json   # re-render only
    python -m benchmarks.kernels --threads 2 --sizes 1e7,1e8 --host-only   # the host rows alone

The host rows (CPU): ACCO's commit and peek and DeepSpeedCPUAdam's step, on the same cores, are timed apart from
the other contenders and interleaved at every size, one call each per round in a rotating order, over more rounds
(--host-reps): the table's host section gives, per size, the median of the per-round ratios (DeepSpeedCPUAdam's
time over ACCO's in the same round) with their spread, so that load from other processes on a shared machine falls
on both sides of each ratio alike.

Prints the table last and writes it (machine, versions, date) to benchmarks/results/kernels/kernels_<device>.md
(kernels_cpu_<N>threads.md for --threads N > 1), and the raw results (every timed call) beside it as .json.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from benchmarks.harness.cli import parser
from benchmarks.harness.records import results_dir
from benchmarks.kernels.table import HOST, LABEL, QUANT_BLOCK, STREAM, SUM_RANKS, render

DEFAULT_SIZES = [1_000_000, 10_000_000, 100_000_000, 10_000_019]
QUICK_SIZES = [1_000_000, 10_000_019]
STREAM_ELEMS = 64 * 2**20
HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
HOST_REPS = 61
"""Rounds of the host rows (each contender once per round): their per-round ratios are what the host section
reports, so more of them than the other rows' calls (a round at 100M parameters takes about 0.2 s on 2 cores)."""


def parse_args(argv=None):
    ap = parser("kernels", __doc__)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--sizes", type=lambda s: [int(float(x)) for x in s.split(",")], default=None,
                    help="comma-separated parameter counts (default 1e6,1e7,1e8,10000019)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="sizes 1M and 10_000_019, fewer repetitions")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads for every contender (default 1)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per measurement")
    ap.add_argument("--host-reps", type=int, default=None,
                    help=f"rounds of the interleaved host rows (CPU: commit, peek, DeepSpeedCPUAdam; default "
                    f"--reps where given, else {HOST_REPS}, --quick 11)")  # fmt: skip
    ap.add_argument("--host-only", action="store_true",
                    help="CPU: only the host rows (and the bandwidth probes); the table and JSON are written as "
                    "kernels_cpu[_<N>threads]_host.*")  # fmt: skip
    ap.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed anchors")
    ap.add_argument("--stream-elems", type=lambda s: int(float(s)), default=STREAM_ELEMS,
                    help="fp32 elements per buffer of the bandwidth probes (default 64Mi = 256 MiB: larger "
                    "than the caches)")  # fmt: skip
    ap.add_argument("--out-dir", default=str(results_dir("kernels")))
    ap.add_argument("--from-json", default=None,
                    help="re-render the table of a raw JSON written by an earlier run into --out-dir")  # fmt: skip
    return ap.parse_args(argv)


CLOCK = {"name": "wall clock"}
QUEUE_AHEAD_CYCLES = 2_000_000  # about 1 ms of device sleep at an H100's 1.98 GHz
LOAD = {"start": 0.0}


def timed(fn, device: str) -> float:
    """Seconds of one call: CUDA events on the GPU (no host sync inside fn); on the CPU the calling thread's CPU
    time when every contender runs on that one thread (--threads 1: time-slicing with other processes on a shared
    machine is not counted, memory stalls are), else the wall clock."""
    import torch

    if device == "cpu" and CLOCK["name"] == "thread CPU time":
        t0 = time.thread_time()
        fn()
        return time.thread_time() - t0
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # The start event fires when the device reaches it: behind a device sleep, the host has queued fn's
        # kernels by then, so its launch work (Python, argument parsing) is not timed as device time. On an idle
        # device the first H100 run timed that work at 50-80 us per call.
        torch.cuda._sleep(QUEUE_AHEAD_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(factories: dict, n: int, device: str, reps: int, interleave: bool) -> dict:
    """Seconds of every timed call per contender. Interleaved: all contenders alive, one call each per round
    (in a rotating order), so load from other processes on a shared machine falls on all of them alike.
    Otherwise (large sizes, to bound memory) one contender at a time."""
    import gc

    def build(name):
        fn = factories[name](n, device)
        for _ in range(2):  # warm-up (Triton compiles, DeepSpeed builds, caches)
            fn()
        return fn

    times = {name: [] for name in factories}
    if interleave:
        fns = {name: build(name) for name in factories}
        names = list(fns)
        for r in range(reps):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                times[name].append(timed(fns[name], device))
        del fns
    else:
        for name in factories:
            fn = build(name)
            times[name] = [timed(fn, device) for _ in range(reps)]
            del fn
            gc.collect()
    return times


def stream_bandwidth(device: str, reps: int, n: int) -> dict:
    """The probes of ``benchmarks.kernels.table.STREAM`` on fp32 buffers of ``n`` elements, interleaved, same threads and
    clock as the kernels: {"elems", "reps", "probes": {name: {"bytes_per_elem", "times_s", "median_s",
    "gbs"}}}, GB/s = bytes read + written / median time, the way the kernels' bytes are counted."""
    import torch

    a, b, c = (torch.rand(n, device=device) for _ in range(3))
    calls = {
        "update": lambda: a.add_(1.0),
        "axpy": lambda: a.add_(b, alpha=0.5),
        "copy": lambda: a.copy_(b),
        "triad": lambda: torch.add(b, c, alpha=0.5, out=a),
    }
    times = measure({k: (lambda f: lambda *_: f)(fn) for k, fn in calls.items()}, n, device, reps, True)
    probes = {}
    for name, ts in times.items():
        med, nbytes = statistics.median(ts), STREAM[name][1]
        probes[name] = {
            "bytes_per_elem": nbytes,
            "times_s": ts,
            "median_s": med,
            "gbs": nbytes * n / med / 1e9,
        }
    return {"elems": n, "reps": reps, "probes": probes}


# -- contenders: factory(n, device) -> a callable doing one step -------------------------------------------
def _state(n, device, half=None):
    """fp32 master and moments, a gradient and an output of ``half`` (default bf16)."""
    import torch

    half = half or torch.bfloat16
    master = torch.randn(n, device=device)
    m = torch.randn(n, device=device) * 0.1
    v = torch.rand(n, device=device) * 0.01
    grad = torch.randn(n, device=device).to(half)
    out = torch.empty(n, dtype=half, device=device)
    return master, m, v, grad, out


def acco_commit(n, device, half=None):
    from acco_ds.ops.adamw import adamw_step

    master, m, v, grad, out = _state(n, device, half)
    return lambda: adamw_step(master, m, v, grad, out, step=10, **HP)


def acco_peek(n, device, half=None):
    from acco_ds.ops.adamw import adamw_step

    master, m, v, grad, out = _state(n, device, half)
    return lambda: adamw_step(master, m, v, grad, out, step=11, commit=False, **HP)


def read_floor(n, device):
    """Only the reads a peek must do (p, m, v fp32 + g bf16, 14 B/param), as four reductions: what a peek
    would take if its computation and its 2 B/param of writes were free."""
    master, m, v, grad, _ = _state(n, device)
    return lambda: (master.sum(), m.sum(), v.sum(), grad.sum())


def acco_accumulate(buf_dtype, grad_dtype=None):
    """accumulate_grads of one ``grad_dtype`` (default bf16) gradient into a ``buf_dtype`` buffer."""

    def factory(n, device):
        import torch

        from acco_ds.ops.accumulate import accumulate_grads

        grad = torch.randn(n, device=device).to(grad_dtype or torch.bfloat16)
        buf = torch.randn(n, device=device).to(buf_dtype)
        return lambda: accumulate_grads(buf, [grad], [0], 0.5)

    return factory


def quant_residual(dtype, backend: str):
    """quantize_with_residual of ``dtype`` x into a residual of ``dtype`` (the communication buffer's dtype),
    blocks of QUANT_BLOCK; the residual evolves from call to call, as over rounds."""

    def factory(n, device):
        import torch

        from acco_ds.ops.quantize import quantize_with_residual

        x = torch.randn(n, device=device).to(dtype)
        residual = (torch.randn(n, device=device) * 1e-3).to(dtype)
        return lambda: quantize_with_residual(x, residual, QUANT_BLOCK, backend=backend)

    return factory


def fold_quantize_row(buffer_dtype, fused: bool, grad_dtype=None):
    """The round end of a compressed round for one parameter of ``n`` elements (one chunk, W = 1): its last
    ``grad_dtype`` (default bf16) gradient folded into the ``buffer_dtype`` gradient buffer and quantized with the residual (``buffer_dtype``), in
    one pass (``acco_ds.ops.fold_quantize``: the buffer read, not written), or as two passes (the accumulation into
    the buffer, then ``quantize_with_residual`` of it). Compiled backends: C++ on the CPU, Triton on the GPU."""

    def factory(n, device):
        import torch

        from acco_ds.ops.accumulate import accumulate_grads
        from acco_ds.ops.fold_quantize import fold_quantize
        from acco_ds.ops.quantize import num_blocks, quantize_with_residual

        backend = "cpp" if device == "cpu" else "triton"
        buffer = torch.randn(n, device=device).to(buffer_dtype)
        grad = (torch.randn(n, device=device) * 1e-3).to(grad_dtype or torch.bfloat16)
        residual = (torch.randn(n, device=device) * 1e-4).to(buffer_dtype)
        q = torch.empty(n, dtype=torch.int8, device=device)
        scales = torch.empty(num_blocks(n, QUANT_BLOCK), dtype=torch.float32, device=device)
        if fused:
            return lambda: fold_quantize(
                buffer, grad, 0, n, residual, q, scales, QUANT_BLOCK, backend=backend
            )

        def two_passes():
            accumulate_grads(buffer, [grad], [0], backend=backend)
            quantize_with_residual(buffer, residual, QUANT_BLOCK, backend=backend, out=(q, scales))

        return two_passes

    return factory


def quant_dequantize_add(backend: str):
    """dequantize_add of one rank's int8 chunk into the owner's fp32 sum, blocks of QUANT_BLOCK."""

    def factory(n, device):
        import torch

        from acco_ds.ops.quantize import dequantize_add, quantize

        q, scales = quantize(torch.randn(n, device=device), QUANT_BLOCK)
        total = torch.zeros(n, device=device)
        return lambda: dequantize_add(total, q, scales, QUANT_BLOCK, backend=backend)

    return factory


def quant_dequantize_sum(backend: str, fused: bool = True):
    """The owner's sum of SUM_RANKS ranks' int8 chunks into the bf16 gradient slice, blocks of QUANT_BLOCK: in one
    pass (dequantize_sum), or unfused (dequantize, then dequantize_add per further rank, then a bf16 copy)."""

    def factory(n, device):
        import torch

        from acco_ds.ops.quantize import dequantize, dequantize_add, dequantize_sum, quantize

        parts = [quantize(torch.randn(n, device=device), QUANT_BLOCK) for _ in range(SUM_RANKS)]
        q, scales = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
        out = torch.empty(n, dtype=torch.bfloat16, device=device)
        if fused:
            return lambda: dequantize_sum(out, q, scales, QUANT_BLOCK, backend=backend)

        def unfused():
            total = dequantize(q[0], scales[0], QUANT_BLOCK, backend=backend)
            for r in range(1, SUM_RANKS):
                dequantize_add(total, q[r], scales[r], QUANT_BLOCK, backend=backend)
            out.copy_(total)

        return unfused

    return factory


def quant_difference(backend: str, fused: bool = True):
    """The parameter difference of bf16 parameters quantized: in one pass (quantize_difference), or unfused (the
    fp32 difference materialised, then quantize)."""

    def factory(n, device):
        import torch

        from acco_ds.ops.quantize import quantize, quantize_difference

        base = torch.randn(n, device=device).to(torch.bfloat16)
        new = (base.float() + torch.randn(n, device=device) * 1e-3).to(torch.bfloat16)
        if fused:
            return lambda: quantize_difference(new, base, QUANT_BLOCK, backend=backend)
        return lambda: quantize(new.float() - base.float(), QUANT_BLOCK, backend=backend)

    return factory


def quant_add_dequantized(backend: str, fused: bool = True):
    """The quantized difference applied onto bf16 parameters in place: in one pass (add_dequantized), or unfused
    (an fp32 copy of the base, dequantize_add into it, a bf16 copy back)."""

    def factory(n, device):
        import torch

        from acco_ds.ops.quantize import add_dequantized, dequantize_add, quantize

        q, scales = quantize(torch.randn(n, device=device) * 1e-3, QUANT_BLOCK)
        params = torch.randn(n, device=device).to(torch.bfloat16)
        if fused:
            return lambda: add_dequantized(params, params, q, scales, QUANT_BLOCK, backend=backend)

        def unfused():
            total = params.to(torch.float32, copy=True)
            dequantize_add(total, q, scales, QUANT_BLOCK, backend=backend)
            params.copy_(total)

        return unfused

    return factory


def commit_difference(fused: bool):
    """A compressed all-gather's local work on bf16 parameters, in place (the base is the output buffer, as the
    round's model buffer): the AdamW commit and its quantized difference in one pass (adamw_step_difference's
    fused kernel: C++ on the CPU, Triton on the GPU), or composed (the base copied, the commit,
    quantize_difference, add_dequantized)."""

    def factory(n, device):
        from acco_ds.ops.adamw_difference import adamw_step_difference

        master, m, v, grad, out = _state(n, device)
        out.copy_(master)
        backend = ("fused" if device == "cpu" else "triton") if fused else "composed"
        return lambda: adamw_step_difference(
            master, m, v, grad, out, out, QUANT_BLOCK, backend=backend, step=10, **HP
        )

    return factory


def sum_commit(fused: bool, ranks: int = SUM_RANKS):
    """The owner's half of a compressed commit from ``ranks`` ranks' int8 chunks (bf16 gradients and parameters):
    the norm's pass and the commit's pass each reading the chunks (acco_ds.ops.quantized_sum_step: C++ on the CPU,
    Triton on the GPU), or composed as the round ran before (dequantize_sum into the bf16 gradient slice, its sum of
    squares, the commit on it)."""

    def factory(n, device):
        import torch

        from acco_ds.ops.adamw import adamw_step
        from acco_ds.ops.norm import sum_of_squares
        from acco_ds.ops.quantize import dequantize_sum, quantize
        from acco_ds.ops.quantized_sum_step import adamw_step_quantized_sum, quantized_sum_of_squares

        master, m, v, grad, out = _state(n, device)
        parts = [quantize(torch.randn(n, device=device) * 1e-3, QUANT_BLOCK) for _ in range(ranks)]
        q, scales = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
        order, bf16 = list(range(ranks)), torch.bfloat16
        if fused:
            backend = "fused" if device == "cpu" else "triton"

            def one_pass_each():
                quantized_sum_of_squares(q, scales, QUANT_BLOCK, order, bf16, backend=backend)
                adamw_step_quantized_sum(
                    master, m, v, q, scales, QUANT_BLOCK, order, bf16, out, backend=backend, step=10, **HP
                )

            return one_pass_each

        def composed():
            dequantize_sum(grad, q, scales, QUANT_BLOCK, order)
            sum_of_squares(grad)
            adamw_step(master, m, v, grad, out, step=10, **HP)

        return composed

    return factory


def quant_contenders(device: str, notes: list) -> dict:
    """The quantize rows (compiled and torch reference), or none with a note saying why."""
    import torch

    from acco_ds.ops import _build

    if device == "cpu" and not _build.available("quantize_cpu"):
        notes.append(f"quantize rows skipped: {_build.why_missing('quantize_cpu')}")
        return {}
    if device != "cpu":
        try:
            import triton  # noqa: F401
        except ImportError:
            notes.append(
                "quantize rows skipped: triton is not installed (the GPU quantize kernels are Triton)"
            )
            return {}
    compiled = "cpp" if device == "cpu" else "triton"
    out = {}
    for backend, suffix in ((compiled, ""), ("ref", "_ref")):
        out[f"qres_fp32{suffix}"] = quant_residual(torch.float32, backend)
        out[f"qres_bf16{suffix}"] = quant_residual(torch.bfloat16, backend)
        out[f"qres_fp16{suffix}"] = quant_residual(torch.float16, backend)
        out[f"deq_add{suffix}"] = quant_dequantize_add(backend)
        out[f"deq_sum{suffix}"] = quant_dequantize_sum(backend)
        out[f"qdiff{suffix}"] = quant_difference(backend)
        out[f"add_deq{suffix}"] = quant_add_dequantized(backend)
    out["deq_sum_unfused"] = quant_dequantize_sum(compiled, fused=False)
    out["qdiff_unfused"] = quant_difference(compiled, fused=False)
    out["add_deq_unfused"] = quant_add_dequantized(compiled, fused=False)
    for key, dtype in (("fold_qres_bf16", torch.bfloat16), ("fold_qres_fp32", torch.float32)):
        out[key] = fold_quantize_row(dtype, fused=True)
        out[f"{key}_unfused"] = fold_quantize_row(dtype, fused=False)
    out["fold_qres_fp16"] = fold_quantize_row(torch.float16, fused=True, grad_dtype=torch.float16)
    out["fold_qres_fp16_unfused"] = fold_quantize_row(torch.float16, fused=False, grad_dtype=torch.float16)
    if _build.available("adamw_cpu" if device == "cpu" else "adamw_cuda"):
        out["commit_diff"] = commit_difference(fused=True)
        out["commit_diff_composed"] = commit_difference(fused=False)
        for ranks in (2, 3, SUM_RANKS):
            key = "sum_commit" if ranks == SUM_RANKS else f"sum_commit_w{ranks}"
            out[key] = sum_commit(fused=True, ranks=ranks)
            out[f"{key}_composed"] = sum_commit(fused=False, ranks=ranks)
    return out


def _torch_opt(n, device, **kw):
    import torch

    p = torch.nn.Parameter(torch.randn(n, device=device))
    p.grad = torch.randn(n, device=device)
    opt = torch.optim.AdamW([p], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                            weight_decay=HP["weight_decay"], **kw)  # fmt: skip
    return p, opt


def torch_fused(n, device):
    return _torch_opt(n, device, fused=True)[1].step


def torch_foreach(n, device):
    return _torch_opt(n, device, foreach=True)[1].step


def torch_fused_cast(n, device):
    """torch fused AdamW, then the bf16 copy of the parameters it does not write itself."""
    import torch

    p, opt = _torch_opt(n, device, fused=True)
    out = torch.empty(n, dtype=torch.bfloat16, device=device)

    def step():
        opt.step()
        out.copy_(p.detach())

    return step


def clone_step_restore(n, device):
    """The estimate as ACCO's reference code gets it: save params and state, step, copy out, restore."""
    import torch

    p, opt = _torch_opt(n, device, fused=True)
    out = torch.empty(n, dtype=torch.bfloat16, device=device)
    opt.step()
    st = opt.state[p]

    def peek():
        saved = (p.detach().clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone(), st["step"].clone())
        opt.step()
        out.copy_(p.detach())
        p.data.copy_(saved[0])
        st["exp_avg"].copy_(saved[1])
        st["exp_avg_sq"].copy_(saved[2])
        st["step"].copy_(saved[3])

    return peek


def deepspeed_adam(n, device):
    import torch

    p = torch.nn.Parameter(torch.randn(n, device=device))
    p.grad = torch.randn(n, device=device)
    kw = dict(lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"], weight_decay=HP["weight_decay"])
    if device == "cpu":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam([p], adamw_mode=True, **kw).step
    from deepspeed.ops.adam import FusedAdam

    return FusedAdam([p], adam_w_mode=True, **kw).step


def machine(device: str) -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    desc = f"CPU: {cpu}, {os.cpu_count()} logical cores"
    if device == "cuda":
        desc += f"; GPU: {torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    return desc


def _cpu_isa() -> str:
    from acco_ds.ops import _build

    ext = _build.load("cpu")
    return getattr(ext, "ISA", "?") if ext is not None else "not built"


def versions() -> str:
    import torch

    vs = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    for mod in ("deepspeed", "triton"):
        try:
            vs.append(f"{mod} {__import__(mod).__version__}")
        except Exception:  # noqa: BLE001 - only reporting
            vs.append(f"{mod} (not importable)")
    return ", ".join(vs)


def _l3_bytes() -> int:
    """Size of the CPU's last-level (L3) cache in bytes (0 when unknown)."""
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        return 0
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * mult


def run(args) -> dict:
    """Measure; returns the raw results (``benchmarks.kernels.table.render``'s input, written as JSON)."""
    import torch

    from acco_ds.ops import _build

    if args.device == "cpu":
        torch.set_num_threads(args.threads)
        CLOCK["name"] = "thread CPU time" if args.threads == 1 else "wall clock"
    else:
        CLOCK["name"] = (
            "CUDA events, each call queued behind a 1 ms device sleep (the host's launch work is not timed)"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks.kernels: --device cuda but torch.cuda.is_available() is False")
    if _build.load(args.device) is None:
        raise SystemExit(
            f"benchmarks.kernels: the {args.device} extension is not built: {_build.why_missing(args.device)}"
        )
    LOAD["start"] = os.getloadavg()[0]
    sizes = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    reps = args.reps or (5 if args.quick else 21)
    stream = stream_bandwidth(args.device, max(reps, 9), args.stream_elems)
    print(
        "stream bandwidth: " + ", ".join(f"{k} {p['gbs']:.1f} GB/s" for k, p in stream["probes"].items()),
        flush=True,
    )
    contenders = {"commit": acco_commit, "peek": acco_peek, "acc_bf16_fp32": acco_accumulate(torch.float32),
                  "acc_bf16_bf16": acco_accumulate(torch.bfloat16), "torch_fused": torch_fused,
                  "torch_fused_cast": torch_fused_cast, "read_floor": read_floor}  # fmt: skip
    contenders["torch_foreach"] = torch_foreach
    half = torch.float16
    contenders.update({"commit_fp16": functools.partial(acco_commit, half=half),
                       "peek_fp16": functools.partial(acco_peek, half=half),
                       "acc_fp16_fp32": acco_accumulate(torch.float32, half),
                       "acc_fp16_fp16": acco_accumulate(half, half)})  # fmt: skip
    if args.device == "cuda":
        contenders["clone_step_restore"] = clone_step_restore
    notes = []
    if not args.no_deepspeed:
        key = "deepspeed" if args.device == "cpu" else "deepspeed_gpu"
        try:
            deepspeed_adam(16, args.device)()  # builds DeepSpeed's op once (JIT, ~1 min the first time)
            contenders[key] = deepspeed_adam
        except Exception as e:  # noqa: BLE001 - an anchor that cannot run is reported, not fatal
            notes.append(f"{LABEL[key]} unavailable: {type(e).__name__}: {str(e)[:300]}")
    if args.host_only and args.device != "cpu":
        raise SystemExit("benchmarks.kernels: --host-only times the host rows, on the CPU (--device cpu)")
    host = [k for k in HOST if k in contenders] if args.device == "cpu" else []
    if args.host_only:
        contenders = {k: contenders[k] for k in host}
    else:
        contenders.update(quant_contenders(args.device, notes))
    host_reps = args.host_reps or args.reps or (11 if args.quick else HOST_REPS)
    results = []
    for n in sizes:
        big = n >= 50_000_000 and args.device == "cpu"
        times, interleaved = {}, []
        if host:  # the host rows: interleaved at every size, over their own rounds
            times.update(
                measure({k: contenders[k] for k in host}, n, args.device, host_reps, interleave=True)
            )
            interleaved.append(list(host))
        rest = {k: f for k, f in contenders.items() if k not in host}
        if rest:
            times.update(
                measure(rest, n, args.device, max(5, reps // 3) if big else reps, interleave=not big)
            )
            if not big:
                interleaved.append(list(rest))
        med = {k: statistics.median(v) for k, v in times.items()}
        results.append({"params": n, "median_s": med, "times_s": times, "interleaved": interleaved})
        print(f"n={n:,}: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in med.items()), flush=True)
    return {
        "device": args.device,
        "threads": args.threads,
        "clock": CLOCK["name"],
        "reps": reps,
        "host_reps": host_reps if host else 0,
        "host_only": bool(args.host_only),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine(args.device),
        "l3_bytes": _l3_bytes() if args.device == "cpu" else 0,
        "load": [LOAD["start"], os.getloadavg()[0]],
        "versions": versions(),
        "cpu_isa": _cpu_isa() if args.device == "cpu" else "",
        "command": " ".join(["python -m benchmarks.kernels", *sys.argv[1:]]),
        "stream": stream,
        "results": results,
        "notes": notes,
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.from_json:
        res = json.loads(Path(args.from_json).read_text())
    else:
        if args.device == "cpu":
            # before torch (and DeepSpeed's OpenMP kernels) start their thread pools
            os.environ["OMP_NUM_THREADS"] = str(args.threads)
        res = run(args)
    md = render(res)
    suffix = f"_{res['threads']}threads" if res["device"] == "cpu" and res["threads"] != 1 else ""
    suffix += "_host" if res.get("host_only") else ""
    out = Path(args.out_dir) / f"kernels_{res['device']}{suffix}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    raw = out.with_suffix(".json")
    if not args.from_json or raw.resolve() != Path(args.from_json).resolve():
        raw.write_text(json.dumps(res, indent=1) + "\n")
    out.write_text(md)
    print()
    print(md)
    print(f"written to {out} and {raw}")
