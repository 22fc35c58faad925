"""Per-rank worker of tests/gpu/test_stress_gpu.py (CUDA, NCCL), started by the ``deepspeed`` launcher.

Runs the toy scenarios of tests/core/test_trajectories.py with device sleeps that shift the two streams against
each other: ``--side-ms`` on the communication (side) stream at the start of every round's job (a wrapper
around ``acco_ds.core.pipeline.run_round_job``, which the pipeline calls on the side stream) and
``--compute-ms`` on the compute stream before every forward (a forward pre-hook). A missing event wait then
lets a stream read a buffer the other has not finished writing, and the trajectory leaves the reference.

Unlike tests/ranks/worker.py nothing is read between steps (a read drains the pipeline and would close the
windows the sleeps open): all steps run back to back, then ``finish()`` and one read of the final parameters
and moments. Per scenario it records the lrs, the final parameters/moments, the device-wide syncs
(``torch.cuda.synchronize``) and the other host waits (Event/Stream ``synchronize``, CUDA ``.item()``) made
during the steps, the throughput timer's ``synchronized`` flag, and how many round jobs were padded. ``--break-waits`` (the control) turns every stream/event wait into a no-op.
"""

from __future__ import annotations

import os

import deepspeed  # noqa: E402
import torch
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402

import acco_ds  # noqa: E402,F401
import acco_ds.core.pipeline as acco_pipeline  # noqa: E402
from tests.ranks import rank_start, toy  # noqa: E402

PADDED = {"side_jobs": 0}


def cycles_per_ms() -> float:
    """``torch.cuda._sleep`` cycles per millisecond on this GPU (timed with events, after a warm-up)."""
    torch.cuda._sleep(1_000_000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 20_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


def pad_side_jobs(cycles: int) -> None:
    """Every round job first sleeps ``cycles`` on the current stream (the side stream it is enqueued on)."""
    original = acco_pipeline.run_round_job

    def padded(*args, **kwargs):
        PADDED["side_jobs"] += 1
        torch.cuda._sleep(cycles)
        return original(*args, **kwargs)

    acco_pipeline.run_round_job = padded


def break_waits() -> None:
    """The control: no stream ever waits for another (what a missing wait does, everywhere at once)."""
    torch.cuda.Stream.wait_event = lambda self, event: None
    torch.cuda.Stream.wait_stream = lambda self, stream: None
    torch.cuda.Event.wait = lambda self, stream=None: None


def count_host_waits(calls: list):
    """Count the host's waits on the device other than a device-wide sync (Event/Stream.synchronize, .item()
    of a CUDA tensor) into ``calls``; returns the function that undoes it."""
    saved = []

    def wrap(owner, name, only_cuda=False):
        original = getattr(owner, name)

        def counted(*a, **k):
            if not only_cuda or (a and getattr(a[0], "is_cuda", False)):
                calls.append(name)
            return original(*a, **k)

        saved.append((owner, name, original))
        setattr(owner, name, counted)

    wrap(torch.cuda.Event, "synchronize")
    wrap(torch.cuda.Stream, "synchronize")
    wrap(torch.Tensor, "item", only_cuda=True)
    return lambda: [setattr(owner, name, original) for owner, name, original in reversed(saved)]


def run_scenario(sc: dict, rank: int, compute_cycles: int) -> dict:
    cfg = sc["config"]
    gas = cfg["gradient_accumulation_steps"]
    model = toy.build()
    model.register_forward_pre_hook(lambda module, inputs: torch.cuda._sleep(compute_cycles))
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    params = toy.trainable(engine.module)
    batches = [
        [tuple(t.to(engine.device) for t in toy.micro_batch(rank, step * gas + j)) for j in range(gas)]
        for step in range(sc["steps"])
    ]  # on the device before the steps: no host-to-device copy inside the timed loop
    syncs, waits = [], []
    original_sync = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *a, **k: (syncs.append(1), original_sync(*a, **k))[1]
    restore = count_host_waits(waits)
    padded_before = PADDED["side_jobs"]
    lrs = []
    try:
        for step in range(sc["steps"]):
            lrs.append(float(engine.get_lr()[0]))
            for x, y in batches[step]:
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
    finally:
        torch.cuda.synchronize = original_sync
        restore()
    opt = engine.optimizer
    opt.finish()
    out = {
        "lrs": lrs,
        "final_model": toy.flat(safe_get_full_fp32_param(p) for p in params).cpu(),
        "exp_avg": toy.flat(safe_get_full_optimizer_state(p, "exp_avg") for p in params).cpu(),
        "device_syncs": len(syncs),
        "host_waits": len(waits),
        "timer_synchronized": bool(engine.tput_timer.config.synchronized),
        "padded_side_jobs": PADDED["side_jobs"] - padded_before,
        "stats": opt.stats(),
    }
    opt.pipeline.close()
    return out


def main() -> None:
    ap = rank_start.scenario_parser()
    ap.add_argument("--side-ms", type=float, required=True)
    ap.add_argument("--compute-ms", type=float, required=True)
    ap.add_argument("--break-waits", action="store_true")
    args = ap.parse_args()
    rank = rank_start.init_rank("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    per_ms = cycles_per_ms()
    pad_side_jobs(int(args.side_ms * per_ms))
    if args.break_waits:
        break_waits()
    results = {"cycles_per_ms": per_ms}
    for sc in rank_start.load_scenarios(args.scenarios):
        results[sc["name"]] = run_scenario(sc, rank, int(args.compute_ms * per_ms))
    if rank == 0:
        torch.save(results, os.path.join(args.out, "results.pt"))


if __name__ == "__main__":
    main()
