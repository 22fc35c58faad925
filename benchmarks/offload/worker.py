"""One contender of the offload benchmark in a process of its own (``benchmarks.offload.cli`` starts it).

    python -m benchmarks.offload.worker SPEC.json RESULT.json     # one contender (the spec says which)
    python -m benchmarks.offload.worker --prepare RESULT.json     # DeepSpeedCPUAdam's JIT build, timed

Why a process per contender: each allocates its own pinned host state (about 16 bytes per parameter for ZeRO-Offload,
twice that for ZenFlow's two moment copies) and GPU memory, and ZenFlow pins the process to half the cores and starts
an optimizer process; a fresh process gives each contender the whole machine, and its own peak-memory figure.

The run (W = 1: NCCL on a GPU, gloo on the CPU): the bf16 Llama of the spec's size, seeded alike in every contender,
trained on the project's corpus (acco_ds.data.corpus, the interpreter's standard library as bytes; micro-batch i is
the same windows in every contender) through ``deepspeed.initialize`` with the contender's config, each micro-batch
``loss = engine(...); engine.backward(loss); engine.step()``. Steps (optimizer steps of ``gas`` micro-batches;
adaptive ACCO runs the same micro-batches): ``warmup``, then ``timed`` ones between two device syncs (samples/s =
samples in the window / its wall time; steps/s = optimizer steps the window completed / its wall time: committed
steps for ACCO, DeepSpeed's global steps otherwise), then one unrecorded and ``profile`` recorded steps on the
profiler's kernel timeline (the compute stream's idle fraction). Then the GPU memory figures (the process's peak
allocation, and the fp32 CUDA tensors it holds), ACCO's ``finish()``, and the eval loss of the trained model on
held-out windows (every contender after the same samples).

The compute-only contender first calibrates: the model alone (plain forward + backward, no engine) per micro-batch,
and the host rows (the kernel benchmark's ACCO commit and peek and DeepSpeedCPUAdam on the same cores, at
``host_rows_n`` parameters); with ``gas: "auto"`` it picks the accumulation from them (``plan.choose_gas``).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks.offload import plan


def _device_sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def init_single_rank(device: str, port: int) -> None:
    import deepspeed
    import torch

    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    if device == "cuda":
        torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo", verbose=False)


class Data:
    """Micro-batch ``i`` of the training stream and ``i`` of the held-out one: ``micro_batch`` windows of ``seq``
    tokens at fixed offsets, the same in every contender (token ids are the corpus's bytes). ``preload(n)`` puts
    the first ``n`` training micro-batches on the device before a run: a blocking host-to-device copy inside the
    loop would sync the compute stream at every micro-batch."""

    def __init__(self, micro_batch: int, seq: int, device: str):
        from acco_ds.data.corpus import load_corpus

        corpus = load_corpus()
        self.train, self.val = corpus.train.long(), corpus.val.long()
        self.describe = {**corpus.describe(), "train_tokens": len(self.train), "val_tokens": len(self.val)}
        self.mb, self.seq, self.device = micro_batch, seq, device
        self.loaded: dict = {}

    def _batch(self, stream, i: int):
        import torch

        span = len(stream) - self.seq
        rows = [stream[((i * self.mb + j) * self.seq) % span :][: self.seq] for j in range(self.mb)]
        return torch.stack(rows).to(self.device)

    def preload(self, n: int) -> None:
        for i in range(n):
            if i not in self.loaded:
                self.loaded[i] = self._batch(self.train, i)
        _device_sync(self.device)

    def train_batch(self, i: int):
        return self.loaded[i] if i in self.loaded else self._batch(self.train, i)

    def val_batch(self, i: int):
        return self._batch(self.val, i)


def build_model(size, seq: int, seed: int, device: str):
    import torch
    from transformers import LlamaForCausalLM

    from benchmarks.gpu_overlap.cli import llama_config

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(llama_config(size, seq)).to(torch.bfloat16)
    model.config.use_cache = False
    return model


def _timer(device: str):
    """(start, stop) -> seconds of what ran between: CUDA events on the GPU (read after a sync), the wall clock on
    the CPU."""
    import torch

    if device == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        return lambda: (b.record(), b.synchronize(), a.elapsed_time(b) / 1e3)[-1]
    t0 = time.perf_counter()
    return lambda: time.perf_counter() - t0


def model_alone(model, data: Data, device: str, warmup: int = 2, reps: int = 5) -> float:
    """Median seconds of one micro-batch's forward + backward through the model alone (no engine, no optimizer)."""
    for i in range(warmup):
        x = data.train_batch(i)
        model(input_ids=x, labels=x).loss.backward()
    _device_sync(device)
    times = []
    for i in range(reps):
        x = data.train_batch(warmup + i)
        stop = _timer(device)
        model(input_ids=x, labels=x).loss.backward()
        times.append(stop())
    model.zero_grad(set_to_none=True)
    return statistics.median(times)


def host_rows(n: int, reps: int) -> dict:
    """The kernel benchmark's host rows on this process's cores: ACCO's C++ AdamW commit and peek (bf16 gradient
    in, bf16 parameters out) and DeepSpeedCPUAdam's step (fp32), ``n`` parameters each, interleaved, median
    seconds (benchmarks.kernels.cli.measure, wall clock)."""
    import torch

    from benchmarks.kernels import cli as kernels

    factories = {"acco_commit": kernels.acco_commit, "acco_peek": kernels.acco_peek,
                 "deepspeed_cpu_adam": kernels.deepspeed_adam}  # fmt: skip
    times = kernels.measure(factories, n, "cpu", reps, True)
    gc.collect()
    return {name: {"n": n, "median_s": statistics.median(ts), "times_s": ts, "threads": torch.get_num_threads()}
            for name, ts in times.items()}  # fmt: skip


def step_counter(engine):
    opt = engine.optimizer
    if hasattr(opt, "committed_steps"):
        return lambda: int(opt.committed_steps)
    return lambda: int(engine.global_steps)


def train_micro_batch(engine, x):
    """One micro-batch through the engine; returns the loss, detached and not read (a read would sync)."""
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    return loss.detach()


def idle_fraction(trace: dict) -> dict:
    """The compute stream's idle share of the recorded window: the compute stream is the stream with the most
    kernels; the window runs from its first device op to its last; busy is the union of its kernels and memsets
    (a copy on it is the offload's transfer, not compute: idle)."""
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    ops = [(e.get("cat"), float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), int(e.get("args", {}).get("stream", -1)))
           for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("ph", "X") == "X"]  # fmt: skip
    kernels: dict = {}
    for cat, *_, s in ops:
        if cat == "kernel":
            kernels[s] = kernels.get(s, 0) + 1
    if not kernels:
        return {"idle_fraction": None, "window_us": 0.0, "stream": None, "kernels": 0}
    stream = max(kernels, key=lambda s: (kernels[s], -s))
    mine = [(a, b, cat) for cat, a, b, s in ops if s == stream]
    start, end = min(a for a, _, _ in mine), max(b for _, b, _ in mine)
    busy, cur_a, cur_b = 0.0, None, None
    for a, b, _ in sorted((a, b, c) for a, b, c in mine if c != "gpu_memcpy"):
        if cur_b is None or a > cur_b:
            busy += 0.0 if cur_b is None else cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    busy += 0.0 if cur_b is None else cur_b - cur_a
    window = end - start
    copies = sum(b - a for a, b, c in mine if c == "gpu_memcpy")
    return {"idle_fraction": 1.0 - busy / window if window > 0 else None, "window_us": window, "stream": stream,
            "kernels": kernels[stream], "copies_on_compute_stream_us": copies}  # fmt: skip


def profile_micro_batches(engine, data: Data, first: int, gas: int, steps: int) -> dict:
    """One unrecorded step then ``steps`` recorded ones (``gas`` micro-batches each, from micro-batch ``first``) on
    the profiler's kernel timeline, in steady state (no device sync before them); the idle figures of the trace."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    n = gas * (steps + 1)
    plan_ = schedule(wait=0, warmup=gas, active=gas * steps, repeat=1)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], schedule=plan_) as prof:
        for k in range(n):
            train_micro_batch(engine, data.train_batch(first + k))
            if k == n - 1:
                torch.cuda.synchronize()
            prof.step()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return idle_fraction(trace)


def cuda_fp32_bytes() -> int:
    """Bytes of the distinct CUDA storages of the fp32 tensors this process's Python objects hold."""
    import torch

    seen, total = set(), 0
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.is_cuda and obj.dtype == torch.float32:
                storage = obj.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
        except Exception:  # noqa: BLE001 - a proxy object that fails isinstance or storage access
            continue
    return total


def versions() -> str:
    from benchmarks.gpu_overlap.cli import versions as overlap_versions

    return overlap_versions()


def machine(device: str) -> str:
    import torch

    from benchmarks.gpu_overlap.cli import host_cpu

    gpu = torch.cuda.get_device_name() if device == "cuda" else "no GPU"
    return f"{gpu}; host: {host_cpu()}"


def run(spec: dict) -> dict:
    import torch

    device = spec["device"]
    out: dict = {"label": spec["label"], "device": device}
    t_start = time.perf_counter()
    if device == "cuda":
        torch.cuda.set_device(0)
        torch.cuda.reset_peak_memory_stats()
    init_single_rank(device, spec["port"])
    import deepspeed

    import acco_ds  # noqa: F401  (registers "ACCO")

    size = plan.ModelSize(**spec["size"])
    data = Data(spec["micro_batch"], spec["seq"], device)
    model = build_model(size, spec["seq"], spec["seed"], device)
    params = sum(p.numel() for p in model.parameters())
    out.update(params=params, data=data.describe, versions=versions(), machine=machine(device))
    gas = spec["gas"]
    if spec.get("calibrate"):
        data.preload(7)
        t_mb = model_alone(model, data, device)
        rows = host_rows(spec["host_rows_n"], spec["host_rows_reps"])
        ds = rows["deepspeed_cpu_adam"]
        host_step = ds["median_s"] * params / ds["n"]
        cal = {"model_alone_mb_s": t_mb, "model_alone_samples_per_s": spec["micro_batch"] / t_mb,
               "host_rows": rows, "host_step_s": host_step, "threads": torch.get_num_threads(),
               "cpu_count": os.cpu_count()}  # fmt: skip
        if gas == "auto":
            gas = plan.choose_gas(host_step, t_mb, spec["ratio_target"])
            cal["gas_chosen"] = gas
        cal["host_over_model_alone_step"] = host_step / (gas * t_mb)
        out["calibration"] = cal
        print(f"[{spec['label']}] calibration: model alone {1e3 * t_mb:.1f} ms per micro-batch; host rows (ms): "
              + ", ".join(f"{k} {1e3 * v['median_s']:.1f}" for k, v in rows.items())
              + f" at {spec['host_rows_n'] / 1e6:g}M; DeepSpeedCPUAdam over {params / 1e6:.0f}M: {host_step:.3f} s; "
              f"gas {gas}: host / model-alone step {cal['host_over_model_alone_step']:.2f}", flush=True)  # fmt: skip
    if not isinstance(gas, int):
        raise ValueError(
            f"gas must be an integer here (the compute-only contender picks 'auto'), got {gas!r}"
        )
    out["gas"] = gas
    cfg = plan.ds_config(spec["label"], spec["micro_batch"], gas, spec.get("zenflow_update_interval", "gas"))
    out["config"] = cfg
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    out["init_s"] = time.perf_counter() - t_start
    count = step_counter(engine)
    steps = plan.Steps(**spec["steps"])
    data.preload(steps.micro_batches(gas))
    warm_mb, timed_mb = steps.warmup * gas, steps.timed * gas
    mb = 0
    for _ in range(warm_mb):
        train_micro_batch(engine, data.train_batch(mb))
        mb += 1
    _device_sync(device)
    t0, s0 = time.perf_counter(), count()
    host_mb, losses = [], []
    for _ in range(timed_mb):
        h = time.perf_counter()
        losses.append(train_micro_batch(engine, data.train_batch(mb)))
        host_mb.append(time.perf_counter() - h)
        mb += 1
    _device_sync(device)
    window = time.perf_counter() - t0
    done = count() - s0
    out["train_loss_timed"] = [float(v) for v in torch.stack(losses).float().cpu()]
    out.update(window_s=window, micro_batches_timed=timed_mb, steps_timed=done,
               samples_per_s=timed_mb * spec["micro_batch"] / window,
               steps_per_s=done / window if done else None, step_time_s=window / done if done else None,
               host_micro_batch_median_s=statistics.median(host_mb))  # fmt: skip
    print(
        f"[{spec['label']}] {out['samples_per_s']:.2f} samples/s, {done} steps in {window:.2f} s", flush=True
    )
    if steps.profile and device == "cuda":
        out["profile"] = profile_micro_batches(engine, data, mb, gas, steps.profile)
        out["idle_fraction"] = out["profile"]["idle_fraction"]
        mb += gas * (steps.profile + 1)
    else:
        out["idle_fraction"] = None
    _device_sync(device)
    if device == "cuda":
        out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
        out["fp32_gpu_bytes"] = cuda_fp32_bytes()
    else:
        out["peak_gpu_bytes"] = out["fp32_gpu_bytes"] = None
    acco = hasattr(engine.optimizer, "committed_steps")
    if acco:
        engine.optimizer.finish()
        out["acco_stats"] = engine.optimizer.stats()
        out["samples_committed"] = out["acco_stats"].get("micro_batches_committed", 0) * spec["micro_batch"]
    out["micro_batches_trained"] = mb
    out["samples_trained"] = mb * spec["micro_batch"]
    out["steps_trained"] = count()
    with torch.no_grad():
        losses = [engine.module(input_ids=x, labels=x).loss.float().item()
                  for x in (data.val_batch(i) for i in range(spec["eval_micro_batches"]))]  # fmt: skip
    out["eval_loss"] = sum(losses) / len(losses)
    print(
        f"[{spec['label']}] eval loss {out['eval_loss']:.4f} after {out['samples_trained']} samples",
        flush=True,
    )
    if acco:
        engine.optimizer.pipeline.close()
    out["wall_s"] = time.perf_counter() - t_start
    return out


def prepare() -> dict:
    """DeepSpeedCPUAdam's op (ZenFlow's too) built just in time, or loaded from the torch extensions cache."""
    t0 = time.perf_counter()
    from deepspeed.ops.op_builder import CPUAdamBuilder

    CPUAdamBuilder().load()
    return {"cpu_adam_load_s": time.perf_counter() - t0}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    result: dict = {"status": "failed"}
    out_path = Path(argv[-1])
    try:
        if argv[0] == "--prepare":
            result.update(prepare())
        else:
            spec = json.loads(Path(argv[0]).read_text())
            result["label"] = spec["label"]
            result.update(run(spec))
        result["status"] = "ok"
    except BaseException:  # noqa: BLE001 - every failure is a result
        result["error"] = traceback.format_exc()
        print(result["error"], file=sys.stderr, flush=True)
    out_path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    import multiprocessing

    for child in multiprocessing.active_children():  # ZenFlow's optimizer process
        child.terminate()
    sys.stdout.flush()
    sys.stderr.flush()
    # ACCO's executor thread, ZenFlow's optimizer process, NCCL's threads: leave at once, the result is written
    os._exit(0)


if __name__ == "__main__":
    main()
