"""The runs of bench_e2e: one contender at one link rate, the compute-only run, the comm-only probe.

Contract: every run is launched with the DeepSpeed launcher exactly as ``acco-train`` launches
its ranks (``acco_ds.cli.launch``), inside the throttled namespace of ``e2e_env.wrap(rate)``, with
the same model, data, seed, micro-batch, accumulation, dtype and threads per rank for every
contender (``Setup``). Each run's files go to ``<work>/<rate>[-hetero]/r<repeat>/<label>/``; the
functions return the merged figures (``acco_ds.cli.metrics``) plus the load average of the
machine before and after the run (these machines are shared: a high load flags a noisy figure).
A run that finished is saved as ``bench_run.json`` (``comm.json`` for the probe) and reused when
the same work folder is given again, so an interrupted sweep resumes.
"""

from __future__ import annotations

import json
import os
import time
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


def _launch(setup: Setup, spec: RunSpec, rate: str) -> dict:
    """Run one spec (or reuse ``bench_run.json`` of a run that finished in this work folder: an
    interrupted sweep resumes where it stopped when given the same ``--work``)."""
    run_dir = Path(spec.run_dir)
    cached = run_dir / "bench_run.json"
    if cached.exists():
        return json.loads(cached.read_text())
    path = spec.save()
    (run_dir / "ds_config.json").write_text(json.dumps(spec.ds_config, indent=2))
    load0 = os.getloadavg()[0]
    t = time.perf_counter()
    cmd = launch_command(str(path), setup.world, _port())
    run_ranks(
        cmd,
        setup.threads,
        log_path=run_dir / "launch.log",
        wrap=e2e_env.wrap(rate, setup.nice),
        timeout=setup.timeout_s,
        env_extra=e2e_env.link_env(),
    )
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


def run_compute_only(setup: Setup, tag: str, slow: dict | None = None) -> dict:
    """Every rank runs the same micro-batches (forward + backward, accumulation) concurrently with
    no communication and no optimizer: T_compute. Returns the summary plus ``t_mb`` (median
    seconds of one micro-batch, per rank)."""
    run_dir = setup.work / f"compute{tag}"
    s = _launch(setup, _spec(setup, run_dir, "compute-only", "compute", "fixed", {}, slow or {}), "none")
    recs = s["records"][s["warmup_steps"] :]
    t_mb = []
    for r in range(setup.world):
        dts = sorted(b["rank_t"][r] - a["rank_t"][r] for a, b in zip(recs, recs[1:]))
        t_mb.append(dts[len(dts) // 2] / setup.grad_accum)
    s["t_mb"] = t_mb
    return s


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
