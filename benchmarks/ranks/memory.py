"""One rank of a memory benchmark run (started by the DeepSpeed launcher, one process per rank):

    python -m deepspeed.launcher.launch --world_info=<W ranks> ... --module benchmarks.ranks.memory --spec RUN/spec.json

Contract: reads the run's spec (model dict, DeepSpeed config, steps, micro-batch, accumulation,
dtype: bf16, fp16 or fp32, seed, device), then, in this order: imports torch, DeepSpeed, acco_ds and the model's code
(the model class is imported by counting its parameters on the meta device), initialises the
process group and waits at a barrier: the **baseline** (this rank's RSS now, on GPU the allocated
bytes). Then builds the model (seeded, in the run's dtype), ``deepspeed.initialize``, trains
``steps x grad_accum`` micro-batches of random bytes with the unchanged DeepSpeed loop
(``engine(x, y)``, ``engine.backward``, ``engine.step``) and, for ACCO, ``engine.optimizer.finish()``.

Memory is read from the kernel: the peak is ``VmHWM`` of ``/proc/self/status`` (the highest
resident set size the process ever had, exact, no sampling), on GPU
``torch.cuda.max_memory_allocated`` (both monotonic, so reading them at the end of each phase -
model, initialize, each optimizer step, finish - gives the peak and the first phase that reached
it). Writes ``RUN/rank<r>.json``: baseline, peak, peak phase, the phase marks (current and peak
memory, and on CPU the RSS split into anonymous / file / shared pages), the parameter count, the
bytes of the tensors still reachable at the end (a gc walk), and for ACCO ``held``
(``GroupBuffers.held_bytes()`` summed over the groups, with the padded element counts) - what the
analytic columns predict; with fp16 (dynamic loss scaling; on a CPU rank fp16 is first allowed by
``acco_ds.deepspeed.cpu_fp16.allow_fp16_on_cpu``) also ``skipped_steps`` (the engine's) and ``loss_scale`` (the
optimizer's ``cur_scale`` at the end), None otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

STATUS_KEYS = ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem")


def proc_status() -> dict:
    """The memory lines of /proc/self/status in bytes (Linux)."""
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in STATUS_KEYS:
                out[key] = int(rest.split()[0]) * 1024
    return out


class PeakWatch:
    """Phase marks: at each phase end, the current and peak memory (see the module docstring)."""

    def __init__(self, cuda_device=None):
        self.cuda = cuda_device
        self.phase = "start"
        self.marks: list = []
        self._t0 = time.perf_counter()

    def read_peak(self) -> int:
        if self.cuda is not None:
            import torch

            return int(torch.cuda.max_memory_allocated(self.cuda))
        return proc_status()["VmHWM"]

    def current(self) -> int:
        if self.cuda is not None:
            import torch

            return int(torch.cuda.memory_allocated(self.cuda))
        return proc_status()["VmRSS"]

    def mark(self, name: str) -> dict:
        """End the current phase (recording its end state), start ``name``."""
        rec = {"phase": self.phase, "t": round(time.perf_counter() - self._t0, 3), "current": self.current()}
        rec["peak"] = self.read_peak()
        if self.cuda is None:
            rec.update(proc_status())
        else:
            import torch

            free, total = torch.cuda.mem_get_info(self.cuda)
            rec.update(reserved=int(torch.cuda.memory_reserved(self.cuda)), device_used=int(total - free))
        self.marks.append(rec)
        self.phase = name
        return rec

    @property
    def peak(self) -> int:
        return max(m["peak"] for m in self.marks)

    def peak_phase(self, tolerance: float = 0.01) -> str:
        """The first phase at whose end the peak was within ``tolerance`` of the final peak."""
        top = self.peak
        return next(m["phase"] for m in self.marks if m["peak"] >= top * (1 - tolerance))


def live_tensor_bytes(device_type: str) -> int:
    """Bytes of the distinct tensor storages Python can reach on ``device_type`` (a gc walk)."""
    import gc

    import torch

    seen = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == device_type:
                st = obj.untyped_storage()
                if st.data_ptr():
                    seen[st.data_ptr()] = st.nbytes()
        except Exception:  # noqa: S112 - tensor subclasses without storage (meta, fake)
            continue
    return sum(seen.values())


def held_by_acco(engine) -> dict | None:
    """Sum of ``GroupBuffers.held_bytes()`` over the ACCO pipeline's groups (and, with compression, the bytes of
    its error-feedback residuals: ``residuals``), with the element counts
    the analytic formula needs; None for a DeepSpeed optimizer (and for an acco_ds older than
    ``held_bytes``: the code before the rotating in-place buffers, which a comparison sweep ran)."""
    pipe = getattr(engine.optimizer, "pipeline", None)
    if pipe is None or not all(hasattr(g, "held_bytes") for g in pipe.groups):
        return None
    out = {"full": 0, "shards": 0, "host_shards": 0, "padded_numel": 0, "numel": 0, "groups": []}
    residuals = [r for r in getattr(pipe, "residuals", []) if r is not None]
    if residuals:  # compression's error-feedback residuals (one full buffer per group, comm dtype)
        out["residuals"] = sum(r.numel() * r.element_size() for r in residuals)
    for g in pipe.groups:
        held = g.held_bytes()
        out["full"] += held["full"]
        out["shards"] += held["shards"]
        out["host_shards"] += held.get("host_shards", 0)  # optimizer offload: the state in host memory
        out["padded_numel"] += g.layout.padded_numel
        out["numel"] += g.layout.numel
        out["groups"].append(
            dict(
                held,
                padded_numel=g.layout.padded_numel,
                numel=g.layout.numel,
                param_dtype=str(g.param_dtype).replace("torch.", ""),
                comm_dtype=str(g.comm_dtype).replace("torch.", ""),
            )
        )
    return out


def run(spec: dict) -> dict:
    device_kind = spec.get("device", "cpu")
    import deepspeed
    import torch
    import torch.distributed as dist

    import acco_ds  # noqa: F401  (registers the ACCO optimizer type)
    from acco_ds.models.hf import build_model, model_num_params

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[spec["dtype"]]
    fp16 = spec["dtype"] == "fp16"
    if fp16 and device_kind == "cpu":
        from acco_ds.deepspeed.cpu_fp16 import allow_fp16_on_cpu

        allow_fp16_on_cpu()
    n_params = model_num_params(spec["model"])  # imports the model's modules before the baseline
    torch.set_num_threads(spec["threads"])
    deepspeed.init_distributed(verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if device_kind == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
    watch = PeakWatch(device if device.type == "cuda" else None)
    dist.barrier()
    base = watch.mark("model")
    torch.manual_seed(spec["seed"])
    with torch.device(device):
        model = build_model(spec["model"], dtype)
    watch.mark("initialize")
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=spec["ds_config"]
    )
    del model
    gen = torch.Generator().manual_seed(spec["seed"] * 1000 + rank)
    ctx, mb = spec["model"]["context"], spec["micro_batch"]
    for step in range(spec["steps"]):
        watch.mark(f"step{step + 1}")
        for _ in range(spec["grad_accum"]):
            seq = torch.randint(0, 256, (mb, ctx + 1), generator=gen)
            x, y = seq[:, :-1].to(device), seq[:, 1:].to(device)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
    if hasattr(engine.optimizer, "finish"):
        watch.mark("finish")
        engine.optimizer.finish()
    watch.mark("end")
    live = live_tensor_bytes(device.type)
    dist.barrier()
    summary = {
        "rank": rank,
        "world": world,
        "device": str(device),
        "params": n_params,
        "engine_params": sum(p.numel() for p in engine.module.parameters()),
        "baseline": base["current"],
        "baseline_peak": base["peak"],
        "peak": watch.peak,
        "peak_phase": watch.peak_phase(),
        "live_tensor_bytes_end": live,
        "marks": watch.marks,
        "held": held_by_acco(engine),
        "loss": float(loss.detach().float()),
        "threads": torch.get_num_threads(),
        "param_dtype": str(next(engine.module.parameters()).dtype).replace("torch.", ""),
        "skipped_steps": int(engine.skipped_steps) if fp16 else None,
        "loss_scale": float(engine.optimizer.cur_scale) if fp16 else None,
    }
    if device.type == "cuda":
        summary["max_reserved"] = int(torch.cuda.max_memory_reserved(device))
    Path(spec["run_dir"], f"rank{rank}.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--spec", required=True)
    ap.add_argument("--local_rank", type=int, default=None, help="set by the DeepSpeed launcher (unused)")
    a = ap.parse_args(argv)
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    run(json.loads(Path(a.spec).read_text()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
