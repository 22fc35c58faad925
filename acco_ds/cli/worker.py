"""The rank process: ``python -m acco_ds.cli.worker --spec RUN_DIR/spec.json`` (started by the
DeepSpeed launcher, one per rank; see ``acco_ds.cli.launch``), or ``acco-train`` itself under torchrun
(``acco_ds.cli.in_launcher``).

Contract: reads the RunSpec, builds the same model on every rank (seeded), trains it with the
DeepSpeed engine of ``spec.ds_config``, then - for ACCO - calls ``engine.optimizer.finish()`` on
every rank so the model holds the committed parameters, evaluates the validation loss on them (with
``spec.eval_every`` also at the start and every that many steps, ``acco_ds.cli.val_curve``: the rank summary's
``val_curve``, the evaluations' time left out of the training clock), and writes ``rank<r>.jsonl`` and
``rank<r>.json`` into the run folder. With ``"fp16": {"enabled": true}`` in
``spec.ds_config`` a CPU rank first lifts DeepSpeed's CPU-accelerator refusal of fp16
(``acco_ds.deepspeed.cpu_fp16``; rank 0 says so on stderr), each step record holds the loss scale and the engine's
skipped steps so far, and the rank summary the final ones. Rank r reads the micro-batches
of rank ``r + spec.data_offset``. With ``spec.checkpoint_dir`` the run first resumes from its last
complete save and saves every ``spec.save_every`` steps (``acco_ds.cli.checkpoints``); a start that
fails while training (a lost peer) appends a line to ``failures.jsonl`` (how far it got, why) and
re-raises. All timing starts after a barrier and, when ``spec.start_gate`` is set, after
``spec.gate_count`` ranks (of every run sharing that folder) have reached it: runs launched together
then start training within a millisecond of each other.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import resource
import sys
import time
from pathlib import Path

import torch

GATE_TIMEOUT_S = 600.0


def _peak_mem_mib(device) -> float:
    if device is not None and getattr(device, "type", "cpu") == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def _evaluate(model, spec, corpus, rank: int, world: int, device) -> float:
    """Mean validation loss over all ranks' windows, on the parameters the model holds now."""
    import torch.distributed as dist

    from acco_ds.data import val_windows

    x, y = val_windows(corpus.val, spec.model["context"], spec.eval_windows, rank, world)  # data-parallel
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for i in range(0, x.size(0), spec.micro_batch):
            xb, yb = x[i : i + spec.micro_batch].to(device), y[i : i + spec.micro_batch].to(device)
            total[0] += float(model(xb, yb).float()) * xb.size(0)
            total[1] += xb.size(0)
    model.train()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)  # tensor-parallel peers add the same sums: the mean is unchanged
    return float(total[0] / total[1])


def _wait_at_gate(spec, rank: int) -> None:
    """Mark this rank ready in ``spec.start_gate`` and wait until ``spec.gate_count`` ranks are,
    polling every millisecond. RuntimeError when a file named ``abort`` appears there (the parent
    saw one of the runs fail) or after GATE_TIMEOUT_S."""
    if not spec.start_gate:
        return
    gate = Path(spec.start_gate)
    gate.mkdir(parents=True, exist_ok=True)
    (gate / f"{spec.name}.rank{rank}.{os.getpid()}").touch()
    deadline = time.monotonic() + GATE_TIMEOUT_S
    while True:
        names = [p.name for p in gate.iterdir()]
        if "abort" in names:
            raise RuntimeError(f"start gate {gate}: aborted (another run launched with this one failed)")
        if len(names) >= spec.gate_count:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"start gate {gate}: {len(names)} of {spec.gate_count} ranks ready after {GATE_TIMEOUT_S:g} s"
            )
        time.sleep(0.001)


def run(spec) -> dict:
    """Train one rank of ``spec``; returns this rank's summary (also written to disk)."""
    marks = {"start": time.perf_counter()}
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    import acco_ds  # noqa: F401  (registers the ACCO optimizer type)
    from acco_ds.cli import checkpoints, loop, thread_cpu
    from acco_ds.cli.dsconfig import fp16_enabled
    from acco_ds.cli.progress import Progress
    from acco_ds.cli.slowdown import Spinner, calibrate
    from acco_ds.cli.steplog import StepLog
    from acco_ds.cli.val_curve import ValCurve
    from acco_ds.cli.wire_bytes import WireCounter
    from acco_ds.data import load_corpus, stream
    from acco_ds.deepspeed.bound_collectives import bound_collectives
    from acco_ds.models import build_model

    torch.set_num_threads(spec.threads)
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)  # its per-run INFO/WARNING chatter
    deepspeed.init_distributed(verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    # data follow the data-parallel rank: the ranks of a tensor-parallel group see the same micro-batches
    dp_rank, dp_world = rank // spec.tp, world // spec.tp
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    acc = get_accelerator()
    device = torch.device(acc.device_name(local_rank)) if acc.device_name() != "cpu" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)

    marks["dist"] = time.perf_counter()
    corpus = load_corpus(spec.corpus)
    ctx = spec.model["context"]
    torch.manual_seed(spec.seed)
    model = build_model(spec.model)

    extra = 0.0
    if rank == spec.slow_rank:
        if spec.slow_extra_s is not None:
            extra = spec.slow_extra_s
        elif spec.slow_factor > 1.0:
            probe = stream(corpus.train, ctx, spec.micro_batch, spec.seed + 999, dp_rank + spec.data_offset)
            t_mb = calibrate(model.to(device), probe, lambda m, b: m(*(t.to(device) for t in b)).backward())
            extra = (spec.slow_factor - 1.0) * t_mb
    spinner = Spinner(extra)

    stats = {}
    fp16 = fp16_enabled(spec.ds_config)
    fp16_on_cpu = fp16 and device.type == "cpu" and _allow_fp16_on_cpu(rank)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=spec.ds_config
    )
    marks["engine"] = time.perf_counter()
    resumed_at = checkpoints.resume(engine, spec)
    marks["resume"] = time.perf_counter()
    log = StepLog(start=resumed_at, probe=_fp16_probe(engine) if fp16 else None)
    seed = checkpoints.data_seed(spec.seed, resumed_at)
    batches = stream(corpus.train, ctx, spec.micro_batch, seed, dp_rank + spec.data_offset)
    saver = checkpoints.Saver(engine, spec, start=resumed_at)
    curve = ValCurve(
        engine,
        lambda: _evaluate(engine.module, spec, corpus, dp_rank, dp_world, device),
        spec.eval_every,
        start=resumed_at,
    )
    if spec.eval_every:
        curve.at(resumed_at, 0.0)  # the start: before the clock runs
    dist.barrier()
    _wait_at_gate(spec, rank)
    marks["barrier"] = time.perf_counter()
    # the bytes this rank sends while it trains (not set-up, not evaluation), DeepSpeed's bound collectives too
    wire = WireCounter(ranks_per_node=spec.tp if spec.tp > 1 else None).install(bound_collectives())
    curve.wire = wire
    bar = Progress(spec.steps, enabled=spec.progress and rank == 0, desc=spec.name)
    first_step_unix: list = []  # wall clock of this start's first optimizer step (a restart's recovery)

    def on_step(step: int) -> float:
        if not first_step_unix:
            first_step_unix.append(time.time())
        saver(step)
        # the evaluations every spec.eval_every steps; the loop leaves their seconds out of its clock
        return curve.on_step(step, lambda: time.perf_counter() - common["start"] - curve.seconds)

    common = dict(
        steps=spec.steps,
        grad_accum=spec.grad_accum,
        micro_batch=spec.micro_batch,
        world=dp_world,
        log=log,
        bar=bar,
        spinner=spinner,
        start=time.perf_counter(),
        done=resumed_at,
        on_step=on_step,
    )
    threads0, cpu0 = thread_cpu.sample(), time.process_time()
    try:
        if spec.accumulation == "adaptive" and hasattr(engine.optimizer, "committed_steps"):
            train_s = loop.train_adaptive(engine, batches, **common)
        else:
            train_s = loop.train_fixed(engine, batches, **common)
    except Exception as err:  # a lost peer, say: record how far this start got, then fail as before
        wire.uninstall()
        _write_failure(spec, rank, log.last_step, resumed_at, first_step_unix, err)
        raise
    t = time.perf_counter()
    if hasattr(engine.optimizer, "finish"):
        engine.optimizer.finish()  # collective: drains the round in flight, model <- theta
    finish_s = time.perf_counter() - t
    wire.uninstall()
    train_s = t + finish_s - common["start"] - curve.seconds
    train_cpu_s = time.process_time() - cpu0  # all of this process's threads, the evaluations included
    threads_cpu_s = thread_cpu.by_name(threads0, thread_cpu.sample(), train_cpu_s)
    log.step(loop.step_counter(engine)(), train_s)  # the commits the drain completed
    saver(loop.step_counter(engine)(), final=True)
    bar.update(log.last_step, log.recent_loss(), log.mb * spec.micro_batch * dp_world, train_s)
    if hasattr(engine.optimizer, "stats"):
        stats = engine.optimizer.stats()
    val_loss = curve.at(log.last_step, train_s)  # the end: on the committed parameters
    bar.close()
    marks["end"] = time.perf_counter()
    names = list(marks)
    phases = {f"{a}->{b}": round(marks[b] - marks[a], 3) for a, b in zip(names, names[1:])}
    summary = {
        "rank": rank,
        "world": world,
        "tp": spec.tp,
        "train_s": train_s,
        "finish_s": finish_s,
        "train_cpu_s": train_cpu_s,
        "thread_cpu_s": threads_cpu_s,
        "eval_cpu_s": curve.cpu_seconds,  # the training thread's, in the evaluations while training
        "steps": log.last_step,
        "micro_batches_local": log.mb,
        "val_loss": val_loss,
        "val_curve": curve.curve(),
        "eval_s": curve.seconds,
        "peak_mem_mib": _peak_mem_mib(device),
        "slow_extra_s": extra,
        "spin_s": spinner.total_s,
        "threads": torch.get_num_threads(),
        "device": str(device),
        "phases_s": phases,
        "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float, str, list, bool))},
        "wire_bytes_sent": wire.sent,
        "wire_bytes_internode_sent": wire.sent_internode if wire.ranks_per_node else None,
        "wire_calls": wire.calls,
        "resumed_at_step": resumed_at,
        "saves": saver.saves,
        "save_s": [round(x, 3) for x in saver.seconds],
        "checkpoint_bytes": saver.bytes_on_disk() if rank == 0 else None,
        "first_step_unix": first_step_unix[0] if first_step_unix else None,
        "fp16": fp16,
        "fp16_allowed_on_cpu": fp16_on_cpu,
        # after finish(): the scale the last commit left, and the steps the engine counted as skipped
        "loss_scale": float(engine.optimizer.cur_scale) if fp16 else None,
        "skipped_steps": int(engine.skipped_steps),
    }
    log.write(spec.rank_log(rank))
    spec.rank_summary(rank).write_text(json.dumps(summary, indent=2))
    dist.barrier()
    return summary


def _allow_fp16_on_cpu(rank: int) -> bool:
    """Lift DeepSpeed's CPU accelerator refusal of fp16 (``acco_ds.deepspeed.cpu_fp16``), saying so on rank 0's
    stderr; True when the CPU lacked native fp16 kernels (fp16 then runs on torch's generic CPU code)."""
    from acco_ds.deepspeed.cpu_fp16 import allow_fp16_on_cpu

    lifted = allow_fp16_on_cpu()
    if lifted and rank == 0:
        print(
            "acco-train: fp16 on CPU ranks: this CPU has no mkldnn fp16 kernels, so DeepSpeed's CPU accelerator "
            "refuses fp16; allowed (acco_ds.deepspeed.cpu_fp16.allow_fp16_on_cpu): torch computes fp16 without "
            "them, slower than fp32",
            file=sys.stderr,
            flush=True,
        )
    return lifted


def _fp16_probe(engine):
    """What each step record adds with fp16: the loss scale in force (ZeRO-1's ``cur_scale``; ACCO's after the
    commits swapped in so far) and the engine's skipped steps so far."""
    return lambda: {
        "loss_scale": float(engine.optimizer.cur_scale),
        "skipped_steps": int(engine.skipped_steps),
    }


def _write_failure(spec, rank: int, step: int, resumed_at: int, first_step: list, err: BaseException) -> None:
    """One line appended to ``failures.jsonl`` in the run folder: this rank, torchrun's restart count (0
    otherwise), the last optimizer step this start completed, the step it had resumed at, when its first step
    completed, when and why it failed."""
    record = {
        "rank": rank,
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "step": step,
        "resumed_at_step": resumed_at,
        "first_step_unix": first_step[0] if first_step else None,
        "unix": time.time(),
        "error": f"{type(err).__name__}: {err}"[:4000],
    }
    with contextlib.suppress(OSError), open(Path(spec.run_dir) / "failures.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def main(argv=None) -> int:
    from acco_ds.cli.spec import RunSpec

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--spec", required=True, help="RUN_DIR/spec.json written by acco-train or bench_e2e")
    ap.add_argument("--local_rank", type=int, default=None, help="set by the DeepSpeed launcher (unused)")
    args = ap.parse_args(argv)
    run(RunSpec.load(args.spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
