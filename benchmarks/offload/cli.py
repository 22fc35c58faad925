"""ACCO + optimizer offload against DeepSpeed ZeRO-Offload and ZenFlow on one GPU (W = 1). docs/GPU.md, docs/OFFLOAD.md.

DeepSpeed users with small GPUs keep the fp32 master and Adam's moments in host memory (``offload_optimizer``): each
step the GPU waits while the gradients go down, DeepSpeedCPUAdam steps and the parameters come back. ACCO + offload
runs that host work in the round's job, off the compute stream. Contenders (``benchmarks.offload.plan``):
compute-only (acco_ds dpu without offload: the bound), ZeRO-1 + offload (ZeRO-Offload), ACCO + offload fixed and
adaptive, ZenFlow (overlap_step), ZeRO-2 + offload; one process each (``benchmarks.offload.worker``), one after
another, the same model, seed, data, micro-batch, accumulation and AdamW settings.

Figures per contender: samples/s, steps/s and step time over the timed window, the compute stream's idle fraction
(kernel timeline of the profiled steps), the eval loss after the same samples, the peak GPU memory and the fp32
bytes held on the GPU; the host rows (ACCO's C++ AdamW and DeepSpeedCPUAdam on the same cores). The goals
(``benchmarks.offload.goals``) are judged from the results JSON alone.

    python -m benchmarks.offload --out DIR                       # GPU: the 0.95B model, --gas auto (~4 min)
    python -m benchmarks.offload --out DIR --deadline-s 280      # skip contenders that would not fit
    python -m benchmarks.offload --tiny --out DIR                # CPU: the whole flow, a tiny model (~2 min here)
    python -m benchmarks.offload --from-json DIR/offload.json --out DIR2   # re-render and re-judge, no GPU

Writes offload.json (rewritten after each contender, so a run stopped from outside keeps what finished) and
offload.md (rendered from it) into --out. Exit status 0 when every contender was attempted (a contender that failed
is a NOT MET goal, not an exit status), 2 when the device asked for is missing, 3 when the deadline left contenders
out. Without --tiny and without a GPU it exits with status 2 and says so.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks.harness.cli import parser
from benchmarks.offload import plan, report

ROOT = Path(__file__).resolve().parents[2]
JSON_NAME, MD_NAME = "offload.json", "offload.md"
TINY = {"size": "tiny", "seq": 64, "micro_batch": 2, "gas": "4", "host_rows_n": 1_000_000, "host_rows_reps": 3,
        "eval_micro_batches": 1}  # fmt: skip
GPU = {"size": "1b", "seq": 2048, "micro_batch": 2, "gas": "auto", "host_rows_n": 100_000_000, "host_rows_reps": 5,
       "eval_micro_batches": 2}  # fmt: skip
FIRST_ESTIMATE_S = 60.0
"""Before any contender has run, the deadline assumes this many seconds for one (process start included)."""


def parse_args(argv=None):
    ap = parser("offload", __doc__)
    ap.add_argument("--out", required=True, help="folder for offload.json and offload.md")
    ap.add_argument("--tiny", action="store_true", help="CPU (gloo), a tiny model, 1+2 steps: the whole flow")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--size", choices=sorted(plan.SIZES), default=None)
    ap.add_argument("--layers", type=int, default=None, help="override the size's layer count")
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument(
        "--gas", default=None, help="gradient accumulation: an even integer, or 'auto' (GPU default)"
    )
    ap.add_argument("--ratio-target", type=float, default=plan.RATIO_TARGET,
                    help="--gas auto: the host step / a step's compute to aim at")  # fmt: skip
    ap.add_argument(
        "--steps", default=None, help="warm-up,timed,profiled optimizer steps (GPU 2,5,1; tiny 1,2,0)"
    )
    ap.add_argument("--contenders", default=",".join(plan.CONTENDERS))
    ap.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="seconds for the whole run: a contender that would not fit in what is left is not started",
    )
    ap.add_argument("--host-rows-n", type=lambda s: int(float(s)), default=None)
    ap.add_argument("--host-rows-reps", type=int, default=None)
    ap.add_argument("--eval-micro-batches", type=int, default=None)
    ap.add_argument("--zenflow-update-interval", default="gas",
                    help="ZenFlow's update_interval: 'gas' (the accumulation, default), 'auto' (its own default, NaN "
                    "here: benchmarks/offload/plan.py) or an integer")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--from-json", default=None, help="re-render offload.md into --out from a saved offload.json"
    )
    a = ap.parse_args(argv)
    base = TINY if a.tiny else GPU
    for key, value in base.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.tiny and a.device == "auto":
        a.device = "cpu"
    if a.gas != "auto":
        try:
            a.gas = int(a.gas)
        except ValueError:
            ap.error(f"--gas must be an even integer or 'auto', got {a.gas!r}")
        if a.gas < 2 or a.gas % 2:
            ap.error(f"--gas must be even and >= 2 (fixed ACCO runs two rounds of gas/2), got {a.gas}")
    steps = a.steps or ("1,2,0" if a.tiny else "2,5,1")
    try:
        parts = [int(x) for x in steps.split(",")]
        if len(parts) != 3:
            raise ValueError(steps)
        a.steps = plan.Steps(*parts)
    except ValueError:
        ap.error(f"--steps must be three integers warmup,timed,profile, got {steps!r}")
    if a.steps.timed < 1 or a.steps.warmup < 1:
        ap.error("--steps: at least one warm-up and one timed step")
    if a.zenflow_update_interval not in ("gas", "auto"):
        try:
            a.zenflow_update_interval = int(a.zenflow_update_interval)
        except ValueError:
            ap.error(
                f"--zenflow-update-interval: 'gas', 'auto' or an integer, got {a.zenflow_update_interval!r}"
            )
    a.contenders = [c.strip() for c in a.contenders.split(",") if c.strip()]
    unknown = [c for c in a.contenders if c not in plan.CONTENDERS]
    if unknown:
        ap.error(f"--contenders: {unknown} not among {', '.join(plan.CONTENDERS)}")
    if a.gas == "auto" and "compute-only" not in a.contenders:
        ap.error("--gas auto needs the compute-only contender (it calibrates); give an integer --gas")
    a.contenders = [c for c in plan.CONTENDERS if c in a.contenders]  # the run order: compute-only first
    return a


def worker_env(device: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    )
    env["PYTHONUNBUFFERED"] = "1"
    if device == "cpu":
        env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    else:
        env.setdefault("DS_ACCELERATOR", "cuda")
    return env


def kill_tree(pid: int) -> None:
    """Kill a worker and everything it started (ZenFlow's optimizer process, a compiler)."""
    import psutil

    try:
        root = psutil.Process(pid)
        for p in [*root.children(recursive=True), root]:
            p.kill()
    except psutil.NoSuchProcess:
        pass


def run_worker(args: list, label: str, env: dict, timeout: float | None) -> tuple:
    """(result dict, exit note): the worker's output echoed line by line with the label in front (a reader thread);
    a worker that died, or that was stopped at ``timeout`` with what it started, leaves a result saying so with its
    last lines. The worker stays in this process's group: a step stopped from outside (scripts/gpu/checks.sh's
    timeout signals the group) stops it too."""
    import threading

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "benchmarks.offload.worker", *args, str(out)]
        tail: list = []
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

        def echo() -> None:
            for line in proc.stdout:
                line = line.rstrip()
                print(line if line.startswith(f"[{label}]") else f"[{label}] {line}", flush=True)
                tail.append(line)
                del tail[:-40]

        reader = threading.Thread(target=echo, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_tree(proc.pid)
            proc.wait()
        reader.join(timeout=10)
        if out.is_file():
            return json.loads(out.read_text()), None
        status = "timeout" if timed_out else "failed"
        why = (
            f"stopped after {timeout:.0f} s (the deadline)" if timed_out else f"exit status {proc.returncode}"
        )
        return {"status": status, "error": why + "\n" + "\n".join(tail)}, why


def cleanup_shm(port: int) -> None:
    from acco_ds.cli.launch import cleanup_shm as cleanup

    cleanup(port, 1)


def meta_of(args, device: str) -> dict:
    from benchmarks.gpu_overlap.cli import host_cpu

    size = plan.SIZES[args.size]
    if args.layers:
        size = plan.ModelSize(**{**asdict(size), "layers": args.layers})
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": device,
        "command": " ".join(["python -m benchmarks.offload", *sys.argv[1:]]),
        "size_name": args.size,
        "size": asdict(size),
        "params": plan.llama_param_count(size),
        "seq": args.seq,
        "micro_batch": args.micro_batch,
        "gas": args.gas,
        "gas_how": "given" if args.gas != "auto" else "auto: not chosen yet",
        "ratio_target": args.ratio_target,
        "steps": asdict(args.steps),
        "seed": args.seed,
        "hp": {**plan.HP, "gradient_clipping": plan.CLIP},
        "contenders": args.contenders,
        "zenflow_update_interval": args.zenflow_update_interval,
        "host_cpu": host_cpu(),
        "deadline_s": args.deadline_s,
    }


def write(out: Path, data: dict) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / JSON_NAME).write_text(json.dumps(data, indent=1, default=str) + "\n")
    md = report.render(data)
    (out / MD_NAME).write_text(md)
    return md


def _device(args) -> str | None:
    if args.device == "cpu":
        return "cpu"
    import torch

    has = torch.cuda.is_available()
    if args.device == "cuda" and not has:
        return None
    return "cuda" if has else None


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        print(write(out, data))
        return 0
    device = _device(args)
    if device is None:
        print("benchmarks.offload: needs a CUDA GPU (torch.cuda.is_available() is False): nothing measured. "
              "--tiny runs the flow on the CPU.", file=sys.stderr)  # fmt: skip
        return 2
    t_start = time.monotonic()
    env = worker_env(device)
    meta = meta_of(args, device)
    size = plan.ModelSize(**meta["size"])
    first = plan.predict(size, args.seq, args.micro_batch, 2)
    predicted_gas = (
        args.gas
        if args.gas != "auto"
        else plan.choose_gas(first["host_step_s"], first["compute_mb_s"], args.ratio_target)
    )
    meta["predicted"] = plan.predict(size, args.seq, args.micro_batch, predicted_gas)
    data = {"meta": meta, "contenders": {}}

    def left() -> float | None:
        return None if args.deadline_s is None else args.deadline_s - (time.monotonic() - t_start)

    remaining = left()
    if remaining is not None and remaining < 1.1 * FIRST_ESTIMATE_S:
        meta["cpu_adam_load_s"] = None  # nothing can run: no build either
    else:  # never stopped at the deadline: a JIT build killed half-way leaves a lock later builds wait on
        prep, _ = run_worker(["--prepare"], "prepare", env, None)
        meta["cpu_adam_load_s"] = prep.get("cpu_adam_load_s")
        if prep.get("status") != "ok":
            meta["cpu_adam_error"] = prep.get("error")
    write(out, data)
    gas = args.gas
    durations: list = []
    skipped = False
    for label in args.contenders:
        remaining = left()
        estimate = max(durations) if durations else FIRST_ESTIMATE_S
        if remaining is not None and remaining < 1.1 * estimate:
            data["contenders"][label] = {"status": "not run",
                                         "error": f"deadline: {remaining:.0f} s left, one contender took up to "
                                                  f"{estimate:.0f} s"}  # fmt: skip
            skipped = True
            print(f"[{label}] not run: {data['contenders'][label]['error']}", flush=True)
            write(out, data)
            continue
        if gas == "auto" and label != "compute-only":
            gas = predicted_gas  # the calibration failed: the prediction's accumulation
            meta["gas_how"] = "auto, but the calibration failed: the prediction's"
        from acco_ds.cli.launch import free_port

        port = free_port()
        spec = {"label": label, "device": device, "size": meta["size"], "seq": args.seq,
                "micro_batch": args.micro_batch, "gas": gas, "ratio_target": args.ratio_target,
                "steps": asdict(args.steps), "seed": args.seed, "port": port,
                "eval_micro_batches": args.eval_micro_batches, "calibrate": label == "compute-only",
                "host_rows_n": args.host_rows_n, "host_rows_reps": args.host_rows_reps,
                "zenflow_update_interval": args.zenflow_update_interval}  # fmt: skip
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "spec.json"
            path.write_text(json.dumps(spec))
            result, _ = run_worker([str(path)], label, env, None if remaining is None else remaining - 5)
        if device == "cpu":
            cleanup_shm(port)
        durations.append(time.monotonic() - t0)
        result["process_s"] = durations[-1]
        if label == "compute-only" and result.get("status") == "ok":
            cal = result.pop("calibration", None)
            if cal:
                meta["calibration"] = cal
            for key in ("machine", "versions"):
                if key in result:
                    meta[key] = result.pop(key)
            if gas == "auto":
                gas = result["gas"]
                meta["gas_how"] = (
                    f"auto: host step nearest {args.ratio_target:g} x a step's compute (calibrated)"
                )
            meta["predicted"] = plan.predict(size, args.seq, args.micro_batch, gas)
        meta["gas"] = gas
        data["contenders"][label] = result
        write(out, data)
    meta["wall_s"] = time.monotonic() - t_start
    md = write(out, data)
    print()
    print(md)
    print(f"written to {out / MD_NAME} and {JSON_NAME}")
    return 3 if skipped else 0
