"""The runs of bench_e2e: one contender at one link rate, the compute-only bound, the comm-only probe.

Contract: every run is launched with the DeepSpeed launcher exactly as ``acco-train`` launches
its ranks (``acco_ds.cli.launch``), inside the throttled namespace of ``e2e_env.wrap(rate)``, with
the same model, data, seed, micro-batch, accumulation, dtype and threads per rank for every
contender (``Setup``). Each run's files go to ``<work>/<rate>[-hetero]/r<repeat>/<label>/``
(the compute-only bound's to ``<work>/compute<tag>/rank<r>/``); the functions return the merged figures (``acco_ds.cli.metrics``) plus the load average of the
machine before and after the run (these machines are shared: a high load flags a noisy figure).
A run that finished is saved as ``bench_run.json`` (``comm.json`` for the probe) and reused when
the same work folder is given again, so an interrupted sweep resumes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import e2e_env

from acco_ds.cli import dsconfig
from acco_ds.cli.launch import free_port, launch_command, run_ranks
from acco_ds.cli.metrics import merge_ranks, read_ranks, summarize
from acco_ds.cli.spec import RunSpec

HERE = Path(__file__).resolve().parent


def _port() -> int:
    """A port free on the host: every run has its own network namespace, so any port would do
    there, but DeepSpeed names its /dev/shm buffers (shared by all namespaces) after the port,
    and two jobs running at once must not share them."""
    return free_port()


# contender label -> (mode, accumulation)
CONTENDERS = {
    "zero1": ("zero1", "fixed"),
    "zero2": ("zero2", "fixed"),
    "sync": ("sync", "fixed"),
    "dpu": ("dpu", "fixed"),
    "acco": ("acco", "fixed"),
    "acco-adaptive": ("acco", "adaptive"),
}


@dataclass
class Setup:
    """What every contender shares."""

    work: Path
    model: dict
    n_params: int
    steps: int
    warmup: int
    micro_batch: int
    grad_accum: int
    world: int
    threads: int
    seed: int
    bf16: bool
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_lr_steps: int = 10
    timeout_s: float = 1200.0
    nice: int = 0  # scheduling priority of every run's ranks (same for every contender)

    def knobs(self, accumulation: str) -> dsconfig.Knobs:
        return dsconfig.Knobs(
            micro_batch=self.micro_batch,
            grad_accum=self.grad_accum,
            world_size=self.world,
            lr=self.lr,
            min_lr=self.min_lr,
            warmup_steps=self.warmup_lr_steps,
            total_steps=self.steps,
            bf16=self.bf16,
            accumulation=accumulation,
            num_params=self.n_params,
        )


def _spec(setup: Setup, run_dir: Path, label: str, mode: str, acc: str, cfg: dict, slow: dict) -> RunSpec:
    return RunSpec(
        name=label,
        mode=mode,
        accumulation=acc,
        run_dir=str(run_dir),
        model=setup.model,
        ds_config=cfg,
        steps=setup.steps,
        micro_batch=setup.micro_batch,
        grad_accum=setup.grad_accum,
        seed=setup.seed,
        threads=setup.threads,
        eval_windows=128,
        progress=False,
        slow_rank=slow.get("rank", -1),
        slow_extra_s=slow.get("extra_s"),
    )


def _run_spec(setup: Setup, spec: RunSpec, rate: str, world: int | None = None) -> None:
    """Launch the ranks of ``spec`` inside the link of ``rate`` and wait for them (LaunchError
    when they fail)."""
    run_dir = Path(spec.run_dir)
    path = spec.save()
    (run_dir / "ds_config.json").write_text(json.dumps(spec.ds_config, indent=2))
    run_ranks(
        launch_command(str(path), world or setup.world, _port()),
        setup.threads,
        log_path=run_dir / "launch.log",
        wrap=e2e_env.wrap(rate, setup.nice),
        timeout=setup.timeout_s,
        env_extra=e2e_env.link_env(),
    )


def _launch(setup: Setup, spec: RunSpec, rate: str) -> dict:
    """Run one spec (or reuse ``bench_run.json`` of a run that finished in this work folder: an
    interrupted sweep resumes where it stopped when given the same ``--work``)."""
    run_dir = Path(spec.run_dir)
    cached = run_dir / "bench_run.json"
    if cached.exists():
        return json.loads(cached.read_text())
    load0 = os.getloadavg()[0]
    t = time.perf_counter()
    _run_spec(setup, spec, rate)
    wall = time.perf_counter() - t
    logs, ranks = read_ranks(run_dir, setup.world)
    records = merge_ranks(logs, setup.micro_batch)
    s = summarize(records, ranks, warmup=setup.warmup, micro_batch=setup.micro_batch)
    s.update(
        label=spec.name,
        rate=rate,
        launch_wall_s=wall,
        load_before=load0,
        load_after=os.getloadavg()[0],
        slow_extra_s=[r.get("slow_extra_s", 0.0) for r in ranks],
        records=records,
    )
    cached.write_text(json.dumps(s))
    return s


def run_contender(setup: Setup, label: str, rate: str, slow: dict | None = None, tag: str = "") -> dict:
    """One training run of ``label`` (a key of CONTENDERS) on a link of ``rate``."""
    mode, acc = CONTENDERS[label]
    cfg = dsconfig.build_config(mode, setup.knobs(acc))
    run_dir = setup.work / f"{rate}{tag}" / label
    return _launch(setup, _spec(setup, run_dir, label, mode, acc, cfg, slow or {}), rate)


# The loop of the compute-only bound: acco_ds in dpu mode (one round per optimizer step, the round's
# job on the communication thread), each rank alone in its own job (see run_compute_only).
BOUND_LOOP = ("dpu", "fixed")


def run_compute_only(setup: Setup, tag: str) -> dict:
    """The compute-only bound: the training loop of the contenders with the communication removed.

    Every rank r runs as its own one-rank acco_ds job (``BOUND_LOOP``): the same worker, DeepSpeed
    engine, model, micro-batches of rank r, accumulation, dtype, threads and LR schedule, the same
    ``loss = engine(x, y); engine.backward(loss); engine.step()`` loop with the gradients
    accumulated into ACCO's flat buffer, and at each round end ACCO's round job on its
    communication thread (the sharded AdamW over the whole model - a shard of W ranks is 1/W of
    it - and the reduce-scatter / all-gather of a one-rank group, which move no byte between
    ranks). The W jobs run concurrently (all ranks share the machine as in a contender run) and
    start training together through a start gate. Bound = the sum over ranks of each rank's
    samples/s over the window where every rank is past its warm-up and none has finished: each
    rank at its own pace, so a rank the machine slows does not cap the others (a merged figure
    "global samples / slowest rank's time" would be W x the slowest rank, which adaptive
    accumulation legitimately beats). Returns the summary with ``samples_per_s`` (the bound),
    ``rank_samples_per_s``, ``t_mb`` (median seconds of one micro-batch per rank) and the ranks'
    records."""
    run_dir = setup.work / f"compute{tag}"
    cached = run_dir / "bench_run.json"
    if cached.exists():
        return json.loads(cached.read_text())
    mode, acc = BOUND_LOOP
    knobs = dataclasses.replace(setup.knobs(acc), world_size=1)
    cfg = dsconfig.build_config(mode, knobs)
    gate = run_dir / "gate"
    shutil.rmtree(gate, ignore_errors=True)
    specs = []
    for r in range(setup.world):
        spec = _spec(setup, run_dir / f"rank{r}", f"compute-only-rank{r}", mode, acc, cfg, {})
        spec.data_offset, spec.start_gate, spec.gate_count, spec.eval_windows = r, str(gate), setup.world, 16
        specs.append(spec)
    load0 = os.getloadavg()[0]
    t = time.perf_counter()

    def one(spec: RunSpec) -> None:
        try:
            _run_spec(setup, spec, "none", world=1)
        except BaseException:
            gate.mkdir(parents=True, exist_ok=True)
            (gate / "abort").touch()  # the other jobs stop waiting at the gate
            raise

    with ThreadPoolExecutor(setup.world) as pool:
        for f in [pool.submit(one, spec) for spec in specs]:
            f.result()
    s = bound_figures([read_ranks(spec.run_dir, 1)[0][0] for spec in specs], setup.warmup, setup.micro_batch)
    s.update(
        label="compute-only",
        rate="none",
        loop=f"{mode} {acc}, one-rank jobs",
        launch_wall_s=time.perf_counter() - t,
        load_before=load0,
        load_after=os.getloadavg()[0],
    )
    cached.write_text(json.dumps(s))
    return s


def bound_figures(rank_logs: list, warmup: int, micro_batch: int) -> dict:
    """The compute-only figures from each rank's own step records (``rank_logs[r]``: the
    cumulative ``{"step", "t", "mb"}`` records of rank r's one-rank job, all timed from the same
    gate). Window: from the latest end of a rank's warm-up (``warmup`` steps) to the earliest last
    step; each rank's samples/s over its records inside it, summed."""
    logs = []
    for log in rank_logs:  # records that add micro-batches (the end-of-run drain adds none)
        kept = [rec for i, rec in enumerate(log) if i == 0 or rec["mb"] > log[i - 1]["mb"]]
        logs.append(kept)
    if any(len(log) < warmup + 3 for log in logs):
        raise ValueError(f"a compute-only rank logged fewer than warm-up {warmup} + 3 steps")
    t0 = max(log[warmup - 1]["t"] if warmup else 0.0 for log in logs)
    t1 = min(log[-1]["t"] for log in logs)
    rates, t_mb = [], []
    for log in logs:
        inside = [rec for rec in log if t0 <= rec["t"] <= t1]
        if len(inside) < 2:
            raise ValueError(f"the compute-only ranks overlap too little (window {t0:.3f}-{t1:.3f} s)")
        a, b = inside[0], inside[-1]
        rates.append((b["mb"] - a["mb"]) * micro_batch / (b["t"] - a["t"]))
        steady = log[max(warmup - 1, 0) :]
        dts = sorted((y["t"] - x["t"]) / (y["mb"] - x["mb"]) for x, y in zip(steady, steady[1:]))
        t_mb.append(dts[len(dts) // 2])
    return {
        "samples_per_s": sum(rates),
        "rank_samples_per_s": rates,
        "t_mb": t_mb,
        "window_s": [t0, t1],
        "warmup_steps": warmup,
        "rank_records": logs,
    }


def run_comm_probe(setup: Setup, rate: str, reps: int = 5) -> dict:
    """T_comm of one round at ``rate``: gradient reduction + parameter all-gather of the model's
    size in the communication dtype (benchmarks/e2e_comm.py)."""
    run_dir = setup.work / rate / "comm-only"
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "comm.json"
    if out.exists():  # resumed sweep
        return _comm_figures(json.loads(out.read_text()))
    extra = ["--numel", str(setup.n_params), "--dtype", "bf16" if setup.bf16 else "fp32", "--reps", str(reps)]
    cmd = launch_command(
        None, setup.world, _port(), target=str(HERE / "e2e_comm.py"), extra=extra + ["--out", str(out)]
    )
    run_ranks(
        cmd,
        1,
        log_path=run_dir / "launch.log",
        wrap=e2e_env.wrap(rate, setup.nice),
        timeout=setup.timeout_s,
        env_extra=e2e_env.link_env(),
    )
    return _comm_figures(json.loads(out.read_text()))


def _comm_figures(res: dict) -> dict:
    res["t_comm_s"] = min(res[k] for k in ("rs_ag_s", "ar_ag_s", "p2p_ag_s") if k in res)
    res["t_reduce_s"] = min(res[k] for k in ("rs_s", "ar_s", "p2p_s") if k in res)
    return res
