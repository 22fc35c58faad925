"""Kernel microbenchmarks (BENCHMARKS.md section 1): fused AdamW commit / peek and gradient accumulation.

Per size: median time, GB/s from the bytes a kernel must move (commit 28 B/param, peek 16 B/param,
accumulate grad + buffer read + buffer write), the fraction of the streaming bandwidth measured in the same run
(best of a large copy and a triad, same thread count), and the speed ratio to anchors measured in the same
run: CPU: torch.optim.AdamW(fused=True), AdamW(foreach=True), DeepSpeedCPUAdam; GPU: torch AdamW fused (+ the
bf16 copy it needs), DeepSpeed FusedAdam, and the clone/step/restore way of computing ACCO's estimate.

    python benchmarks/bench_kernels.py                      # CPU, 1 thread, 1M/10M/100M/10_000_019
    python benchmarks/bench_kernels.py --threads 2 --quick
    python benchmarks/bench_kernels.py --device cuda --out-dir "$OUT"

Prints the table last and writes it (machine, versions, date) to benchmarks/results/kernels_<device>.md.
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


class Timer:
    """Median of timed calls after warm-up; CUDA events on the GPU, perf_counter on the CPU."""

    def __init__(self, device: str, reps: int):
        self.device, self.reps = device, reps

    def __call__(self, fn, reps=None) -> float:
        import torch

        reps = reps or self.reps
        for _ in range(2):
            fn()
        times = []
        for _ in range(reps):
            if self.device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def stream_bandwidth(timer: Timer, device: str) -> dict:
    """Copy (read + write) and triad (2 reads + write) on 64M fp32 elements: bytes moved / median time."""
    import torch

    n = 64 * 2**20
    a, b, c = (torch.rand(n, device=device) for _ in range(3))
    copy = 8 * n / timer(lambda: a.copy_(b))
    triad = 12 * n / timer(lambda: torch.add(b, c, alpha=0.5, out=a))
    return {"copy": copy / 1e9, "triad": triad / 1e9, "best": max(copy, triad) / 1e9}


def ours(n: int, device: str, timer: Timer) -> dict:
    """Our kernels: commit / peek with bf16 grad in and bf16 param out; accumulation bf16 -> fp32 and bf16."""
    import torch

    from acco_ds.ops import _build
    from acco_ds.ops.accumulate import accumulate_grads

    if _build.load(device) is None:
        raise SystemExit(f"bench_kernels: the {device} extension is not built: {_build.why_missing(device)}")
    grad = torch.randn(n, device=device).to(torch.bfloat16)
    res = _adamw_times(n, device, timer, grad)
    buf32 = torch.randn(n, device=device)
    res["acc_bf16_fp32"] = timer(lambda: accumulate_grads(buf32, [grad], [0], 0.5))
    buf16 = torch.randn(n, device=device).to(torch.bfloat16)
    res["acc_bf16_bf16"] = timer(lambda: accumulate_grads(buf16, [grad], [0], 0.5))
    return res


def _adamw_times(n: int, device: str, timer: Timer, grad) -> dict:
    import torch

    from acco_ds.ops.adamw import adamw_step

    master = torch.randn(n, device=device)
    m = torch.randn(n, device=device) * 0.1
    v = torch.rand(n, device=device) * 0.01
    out = torch.empty(n, dtype=torch.bfloat16, device=device)
    commit = timer(lambda: adamw_step(master, m, v, grad, out, step=10, **HP))
    peek = timer(lambda: adamw_step(master, m, v, grad, out, step=11, commit=False, **HP))
    return {"commit": commit, "peek": peek}


def torch_adamw(n: int, device: str, timer: Timer, **opt_kw) -> float:
    import torch

    p = torch.nn.Parameter(torch.randn(n, device=device))
    p.grad = torch.randn(n, device=device)
    opt = torch.optim.AdamW([p], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                            weight_decay=HP["weight_decay"], **opt_kw)  # fmt: skip
    return timer(opt.step)


def torch_fused_plus_cast(n: int, device: str, timer: Timer) -> float:
    """torch fused AdamW, then the bf16 copy of the parameters it does not write itself."""
    import torch

    p = torch.nn.Parameter(torch.randn(n, device=device))
    p.grad = torch.randn(n, device=device)
    out = torch.empty(n, dtype=torch.bfloat16, device=device)
    opt = torch.optim.AdamW([p], lr=HP["lr"], fused=True)

    def step():
        opt.step()
        out.copy_(p.detach())

    return timer(step)


def clone_step_restore(n: int, device: str, timer: Timer) -> float:
    """The estimate as ACCO's reference code gets it: save params and state, step, copy out, restore."""
    import torch

    p = torch.nn.Parameter(torch.randn(n, device=device))
    p.grad = torch.randn(n, device=device)
    out = torch.empty(n, dtype=torch.bfloat16, device=device)
    opt = torch.optim.AdamW([p], lr=HP["lr"], fused=device == "cuda")
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

    return timer(peek)


def deepspeed_anchor(n: int, device: str, timer: Timer) -> float:
    import torch

    p = torch.nn.Parameter(torch.randn(n, device=device))
    p.grad = torch.randn(n, device=device)
    kw = dict(lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"], weight_decay=HP["weight_decay"])
    if device == "cpu":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam([p], adamw_mode=True, **kw)
    else:
        from deepspeed.ops.adam import FusedAdam

        opt = FusedAdam([p], adam_w_mode=True, **kw)
    return timer(opt.step)


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


def versions() -> str:
    import torch

    vs = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    for mod in ("deepspeed", "triton"):
        try:
            vs.append(f"{mod} {__import__(mod).__version__}")
        except Exception:  # noqa: BLE001 - only reporting
            vs.append(f"{mod} (not importable)")
    return ", ".join(vs)


BYTES = {"commit": 28, "peek": 16, "acc_bf16_fp32": 2 + 4 + 4, "acc_bf16_bf16": 2 + 2 + 2, "anchor": 28}
LABEL = {
    "commit": "acco commit (bf16 g in, bf16 p out)",
    "peek": "acco peek (bf16 g in, bf16 p out)",
    "acc_bf16_fp32": "acco accumulate bf16 -> fp32 buf",
    "acc_bf16_bf16": "acco accumulate bf16 -> bf16 buf",
    "torch_fused": "torch AdamW fused (fp32)",
    "torch_fused_cast": "torch AdamW fused + bf16 copy",
    "torch_foreach": "torch AdamW foreach (fp32)",
    "deepspeed": "DeepSpeedCPUAdam (fp32)",
    "deepspeed_gpu": "DeepSpeed FusedAdam (fp32)",
    "clone_step_restore": "peek by clone/step/restore",
}


def run(args) -> str:
    import torch

    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    elif not torch.cuda.is_available():
        raise SystemExit("bench_kernels: --device cuda but torch.cuda.is_available() is False")
    sizes = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    reps = args.reps or (5 if args.quick else 15)
    timer = Timer(args.device, reps)
    bw = stream_bandwidth(timer, args.device)
    print(f"stream bandwidth: copy {bw['copy']:.1f} GB/s, triad {bw['triad']:.1f} GB/s", flush=True)
    rows, notes = [], []
    for n in sizes:
        big = n >= 50_000_000
        t = Timer(args.device, max(3, reps // 3) if big else reps)
        res = ours(n, args.device, t)
        anchors = {}
        anchors["torch_fused"] = torch_adamw(n, args.device, t, fused=True)
        anchors["torch_fused_cast"] = torch_fused_plus_cast(n, args.device, t)
        anchors["torch_foreach"] = torch_adamw(
            n, args.device, Timer(args.device, 3) if big else t, foreach=True
        )
        if args.device == "cuda":
            anchors["clone_step_restore"] = clone_step_restore(n, args.device, t)
        if not args.no_deepspeed:
            key = "deepspeed" if args.device == "cpu" else "deepspeed_gpu"
            try:
                anchors[key] = deepspeed_anchor(n, args.device, t)
            except Exception as e:  # noqa: BLE001 - an anchor that cannot run is reported, not fatal
                notes.append(f"{LABEL[key]} unavailable at n={n}: {type(e).__name__}: {str(e)[:200]}")
        for key, sec in res.items():
            vs = {}
            if key in ("commit", "peek"):
                vs = {a: anchors[a] / sec for a in anchors if a != "clone_step_restore" or key == "peek"}
                if key == "peek":
                    vs["commit"] = res["commit"] / sec
            rows.append((n, LABEL[key], sec, BYTES[key] * n / sec / 1e9, vs))
        for key, sec in anchors.items():
            rows.append((n, LABEL[key], sec, BYTES["anchor"] * n / sec / 1e9, {}))
        print(
            f"n={n:,}: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in {**res, **anchors}.items()),
            flush=True,
        )
    return render(args, bw, rows, notes)


def render(args, bw, rows, notes) -> str:
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
        f"- Machine: {machine(dev)}",
        f"- Versions: {versions()}",
        f"- Command: `python {' '.join([Path(sys.argv[0]).name, *sys.argv[1:]])}` ({threads} for every contender)",
        f"- Streaming bandwidth in this run (64M fp32): copy {bw['copy']:.1f} GB/s, triad {bw['triad']:.1f} GB/s; "
        f"the % column divides by the best, {bw['best']:.1f} GB/s.",
        "- Bytes per parameter: commit 28 (read p, m, v fp32 + bf16 g; write p, m, v + bf16 out), peek 16 "
        "(read the same, write bf16 out), accumulate grad + buffer read + buffer write; fp32 AdamW anchors 28.",
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
    out = Path(args.out_dir) / f"kernels_{args.device}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(md)
    print()
    print(md)
    print(f"written to {out}")


if __name__ == "__main__":
    main()
