"""Kernel microbenchmarks (BENCHMARKS.md section 1): fused AdamW commit / peek and gradient accumulation.

Per size: median time, GB/s from the bytes a kernel must move (commit 28 B/param, peek 16 B/param,
accumulate grad + buffer read + buffer write), the fraction of the streaming bandwidth measured in the same run
(best of a large copy and a triad, same thread count), and the speed ratio to anchors measured in the same
run: CPU: torch.optim.AdamW(fused=True), AdamW(foreach=True), DeepSpeedCPUAdam; GPU: torch AdamW fused (+ the
bf16 copy it needs), DeepSpeed FusedAdam, and the clone/step/restore way of computing ACCO's estimate.

    python benchmarks/bench_kernels.py                      # CPU, 1 thread, 1M/10M/100M/10_000_019
    python benchmarks/bench_kernels.py --threads 2 --quick
    python benchmarks/bench_kernels.py --device cuda --out-dir "$OUT"

Prints the table last and writes it (machine, versions, date) to benchmarks/results/kernels_<device>.md
(kernels_cpu_<N>threads.md for --threads N > 1).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SIZES = [1_000_000, 10_000_000, 100_000_000, 10_000_019]
QUICK_SIZES = [1_000_000, 10_000_019]
HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--sizes", type=lambda s: [int(float(x)) for x in s.split(",")], default=None,
                    help="comma-separated parameter counts (default 1e6,1e7,1e8,10000019)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="sizes 1M and 10_000_019, fewer repetitions")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads for every contender (default 1)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per measurement")
    ap.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed anchors")
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    return ap.parse_args(argv)


CLOCK = {"name": "wall clock"}
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
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(factories: dict, n: int, device: str, reps: int, interleave: bool) -> dict:
    """Median seconds per contender. Interleaved: all contenders alive, one call each per round (in a
    rotating order), so load from other processes on a shared machine falls on all of them alike. Otherwise
    (large sizes, to bound memory) one contender at a time."""
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
    return {name: statistics.median(t) for name, t in times.items()}


def stream_bandwidth(device: str, reps: int) -> dict:
    """Copy (read + write) and triad (2 reads + write) on 64M fp32 elements: bytes moved / median time."""
    import torch

    n = 64 * 2**20
    a, b, c = (torch.rand(n, device=device) for _ in range(3))
    t = measure({"copy": lambda *_: lambda: a.copy_(b),
                 "triad": lambda *_: lambda: torch.add(b, c, alpha=0.5, out=a)}, n, device, reps, True)  # fmt: skip
    copy, triad = 8 * n / t["copy"] / 1e9, 12 * n / t["triad"] / 1e9
    return {"copy": copy, "triad": triad, "best": max(copy, triad)}


# -- contenders: factory(n, device) -> a callable doing one step -------------------------------------------
def _state(n, device):
    import torch

    master = torch.randn(n, device=device)
    m = torch.randn(n, device=device) * 0.1
    v = torch.rand(n, device=device) * 0.01
    grad = torch.randn(n, device=device).to(torch.bfloat16)
    out = torch.empty(n, dtype=torch.bfloat16, device=device)
    return master, m, v, grad, out


def acco_commit(n, device):
    from acco_ds.ops.adamw import adamw_step

    master, m, v, grad, out = _state(n, device)
    return lambda: adamw_step(master, m, v, grad, out, step=10, **HP)


def acco_peek(n, device):
    from acco_ds.ops.adamw import adamw_step

    master, m, v, grad, out = _state(n, device)
    return lambda: adamw_step(master, m, v, grad, out, step=11, commit=False, **HP)


def read_floor(n, device):
    """Only the reads a peek must do (p, m, v fp32 + g bf16, 14 B/param), as four reductions: what a peek
    would take if its computation and its 2 B/param of writes were free."""
    master, m, v, grad, _ = _state(n, device)
    return lambda: (master.sum(), m.sum(), v.sum(), grad.sum())


def acco_accumulate(buf_dtype):
    def factory(n, device):
        import torch

        from acco_ds.ops.accumulate import accumulate_grads

        grad = torch.randn(n, device=device).to(torch.bfloat16)
        buf = torch.randn(n, device=device).to(buf_dtype)
        return lambda: accumulate_grads(buf, [grad], [0], 0.5)

    return factory


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


BYTES = {
    "commit": 28,
    "peek": 16,
    "acc_bf16_fp32": 2 + 4 + 4,
    "acc_bf16_bf16": 2 + 2 + 2,
    "read_floor": 14,
    "anchor": 28,
}
LABEL = {
    "commit": "acco commit (bf16 g in, bf16 p out)",
    "peek": "acco peek (bf16 g in, bf16 p out)",
    "acc_bf16_fp32": "acco accumulate bf16 -> fp32 buf",
    "acc_bf16_bf16": "acco accumulate bf16 -> bf16 buf",
    "read_floor": "limit: the reads of a peek alone (torch sums)",
    "torch_fused": "torch AdamW fused (fp32)",
    "torch_fused_cast": "torch AdamW fused + bf16 copy",
    "torch_foreach": "torch AdamW foreach (fp32)",
    "deepspeed": "DeepSpeedCPUAdam (fp32)",
    "deepspeed_gpu": "DeepSpeed FusedAdam (fp32)",
    "clone_step_restore": "peek by clone/step/restore",
}


def run(args) -> str:
    import torch

    from acco_ds.ops import _build

    if args.device == "cpu":
        torch.set_num_threads(args.threads)
        CLOCK["name"] = "thread CPU time" if args.threads == 1 else "wall clock"
    else:
        CLOCK["name"] = "CUDA events"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_kernels: --device cuda but torch.cuda.is_available() is False")
    if _build.load(args.device) is None:
        raise SystemExit(
            f"bench_kernels: the {args.device} extension is not built: {_build.why_missing(args.device)}"
        )
    LOAD["start"] = os.getloadavg()[0]
    sizes = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    reps = args.reps or (5 if args.quick else 21)
    bw = stream_bandwidth(args.device, reps)
    print(f"stream bandwidth: copy {bw['copy']:.1f} GB/s, triad {bw['triad']:.1f} GB/s", flush=True)
    contenders = {"commit": acco_commit, "peek": acco_peek, "acc_bf16_fp32": acco_accumulate(torch.float32),
                  "acc_bf16_bf16": acco_accumulate(torch.bfloat16), "torch_fused": torch_fused,
                  "torch_fused_cast": torch_fused_cast, "read_floor": read_floor}  # fmt: skip
    contenders["torch_foreach"] = torch_foreach
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
    rows = []
    for n in sizes:
        big = n >= 50_000_000 and args.device == "cpu"
        t = measure(contenders, n, args.device, max(5, reps // 3) if big else reps, interleave=not big)
        anchors = {k: v for k, v in t.items() if k not in BYTES or k == "anchor"}
        for key in ("commit", "peek", "acc_bf16_fp32", "acc_bf16_bf16", "read_floor"):
            sec, vs = t[key], {}
            if key in ("commit", "peek"):
                vs = {a: anchors[a] / sec for a in anchors if a != "clone_step_restore" or key == "peek"}
                if key == "peek":
                    vs["commit"] = t["commit"] / sec
            rows.append((n, LABEL[key], sec, BYTES[key] * n / sec / 1e9, vs))
        for key, sec in anchors.items():
            rows.append((n, LABEL[key], sec, BYTES["anchor"] * n / sec / 1e9, {}))
        print(f"n={n:,}: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in t.items()), flush=True)
    return render(args, bw, rows, notes, reps)


def render(args, bw, rows, notes, reps) -> str:
    head = (
        "| params | kernel | median ms | GB/s | % of stream BW | speed vs anchors (anchor time / this time) |"
    )
    lines = [head, "|---:|---|---:|---:|---:|---|"]
    for n, label, sec, gbs, vs in rows:
        ratio = ", ".join(f"{LABEL.get(k, k).split(' (')[0]} {r:.2f}x" for k, r in vs.items())
        lines.append(
            f"| {n:,} | {label} | {sec * 1e3:.3f} | {gbs:.1f} | {100 * gbs / bw['best']:.0f}% | {ratio} |"
        )
    table = "\n".join(lines)
    dev = args.device
    threads = f"{args.threads} thread(s)" if dev == "cpu" else "GPU"
    md = [
        f"# Kernel microbenchmarks ({dev})",
        "",
        f"- Date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- Machine: {machine(dev)}; load average (1 min) at start / end: {LOAD['start']:.1f} / "
        f"{os.getloadavg()[0]:.1f} (a shared machine: other processes compete for the memory bandwidth)",
        f"- Versions: {versions()}" + (f"; CPU kernel variant: {_cpu_isa()}" if dev == "cpu" else ""),
        f"- Command: `python {' '.join([Path(sys.argv[0]).name, *sys.argv[1:]])}` ({threads} for every contender)",
        f"- Streaming bandwidth in this run (64M fp32): copy {bw['copy']:.1f} GB/s, triad {bw['triad']:.1f} GB/s; "
        f"the % column divides by the best, {bw['best']:.1f} GB/s.",
        "- Bytes per parameter: commit 28 (read p, m, v fp32 + bf16 g; write p, m, v + bf16 out), peek 16 "
        "(read the same, write bf16 out), accumulate grad + buffer read + buffer write; anchors are credited with the 28 B of an fp32 AdamW step "
        "(what the work needs, not what they move: the bf16 copy and clone/restore traffic is not counted).",
        f"- Clock: {CLOCK['name']}. Median of {reps} timed calls after 2 warm-up calls; below 50M parameters (and on the GPU) the "
        "contenders are interleaved call by call (so load from other processes falls on all alike, and no "
        "contender keeps its data in the caches from one call to the next); at 50M and above, one contender at a "
        "time with a third of the calls (memory). The streaming bandwidth is measured on 64M fp32 elements.",
        "",
        table,
    ]
    if notes:
        md += ["", "Notes:", *[f"- {x}" for x in notes]]
    return "\n".join(md) + "\n"


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.device == "cpu":
        # before torch (and DeepSpeed's OpenMP kernels) start their thread pools
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    sys.path.insert(0, str(ROOT))
    md = run(args)
    suffix = f"_{args.threads}threads" if args.device == "cpu" and args.threads != 1 else ""
    out = Path(args.out_dir) / f"kernels_{args.device}{suffix}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(md)
    print()
    print(md)
    print(f"written to {out}")


if __name__ == "__main__":
    main()
