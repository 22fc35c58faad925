"""The runs of the e2e and topology benchmarks: one contender at one link rate, the compute-only bound,
the comm-only probe.

Contract: every run is launched with the DeepSpeed launcher exactly as ``acco-train`` launches
its ranks (``acco_ds.cli.launch``), inside the throttled namespace of ``link.wrap(rate)`` (or
by the ``run`` given to ``launch_and_summarize``: the topology benchmark's two nodes), with the same
model, data, micro-batch, accumulation, dtype and threads per rank for every contender
(``Setup``), and the seed given (it fixes the initialisation and the data order: the same seed
gives every contender the same micro-batches in the same order). Each run's files go to
``<work>/<rate>[-hetero]/s<seed>/<label>/`` (runs at the token budget: ``.../<label>-budget/``;
the compute-only bound's to ``<work>/compute<tag>/rank<r>/`` or ``replica<r>/``); the functions
return the merged figures (``acco_ds.cli.metrics``) plus the load average of the machine before
and after the run (these machines are shared: a high load flags a noisy figure). With tensor
parallelism (``Setup.tp`` > 1) the records are those of one rank per data-parallel replica (its
tensor-parallel peers repeat them) and ``peak_mem_mib`` lists every rank.
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

from acco_ds.cli import dsconfig
from acco_ds.cli.launch import free_port, launch_command, run_ranks
from acco_ds.cli.metrics import merge_ranks, read_ranks, summarize
from acco_ds.cli.spec import RunSpec
from acco_ds.plan.model import COMPRESSION_CONFIG
from benchmarks.harness import link

COMM_PROBE = "benchmarks.ranks.comm_probe"  # the per-rank module of the comm-only probe


def _port() -> int:
    """A port free on the host: every run has its own network namespace, so any port would do
    there, but DeepSpeed names its /dev/shm buffers (shared by all namespaces) after the port,
    and two jobs running at once must not share them."""
    return free_port()


# contender label -> (mode, accumulation)
CONTENDERS = {
    "zero1": ("zero1", "fixed"),
    "zero1-overlap": ("zero1-overlap", "fixed"),
    "zero2": ("zero2", "fixed"),
    "sync": ("sync", "fixed"),
    "dpu": ("dpu", "fixed"),
    "acco": ("acco", "fixed"),
    "acco-adaptive": ("acco", "adaptive"),
    # compressed communication (docs/ALGORITHM.md, "Compressed rounds"; CONFIG_CHANGES below)
    "zero1-bf16comm": ("zero1", "fixed"),
    "sync-int8": ("sync", "fixed"),
    "sync-int4": ("sync", "fixed"),
    "acco-int8": ("acco", "fixed"),
    "acco-adaptive-int8": ("acco", "adaptive"),
    "acco-int8-noef": ("acco", "fixed"),
    "acco-int8-exact-peek": ("acco", "fixed"),
    "acco-int8-peek-int4": ("acco", "fixed"),
    "acco-adaptive-int8-peek-int4": ("acco", "adaptive"),
    "acco-int4": ("acco", "fixed"),
    "acco-adaptive-int4": ("acco", "adaptive"),
    "dpu-int8": ("dpu", "fixed"),  # the peek ablation's "none at all": no estimate, int8 commits
    # the rounds quantized by their jobs, not in their last backward's gradient hooks (core.fused_round_end)
    "acco-int8-unfused": ("acco", "fixed"),
    "acco-int4-unfused": ("acco", "fixed"),
}
# what acco-plan recommends: int8 gradients (commit and peek) and parameter differences
INT8 = dict(COMPRESSION_CONFIG)
INT4 = {"commit": "int8", "peek": "int4", "all_gather": "int4"}  # four bits where the error is fed back
INT8_NO_PEEK = {"commit": "int8", "all_gather": "int8"}  # the modes without a peek (sync, dpu)
INT4_NO_PEEK = {"commit": "int8", "all_gather": "int4"}
CONFIG_CHANGES = {
    # DeepSpeed's own lower-precision communication: its gradients all-reduced in bf16
    "zero1-bf16comm": {"communication_data_type": "bf16"},
    # "ZeRO-1 with the same quantizer": acco_ds sync, int8 gradients and parameter differences
    "sync-int8": {"optimizer.params.compression": INT8_NO_PEEK},
    # acco-int4's commit round alone (int8 gradients, int4 parameter differences): its "same compression" sync
    "sync-int4": {"optimizer.params.compression": INT4_NO_PEEK},
    "acco-int8": {"optimizer.params.compression": INT8},
    "acco-adaptive-int8": {"optimizer.params.compression": INT8},
    # ablations: without error feedback; the peek (the estimate's gradients) exact
    "acco-int8-noef": {"optimizer.params.compression": {**INT8, "error_feedback": False}},
    "acco-int8-exact-peek": {"optimizer.params.compression": {**INT8, "peek": "none"}},
    "acco-int8-peek-int4": {"optimizer.params.compression": {**INT8, "peek": "int4"}},
    "acco-adaptive-int8-peek-int4": {"optimizer.params.compression": {**INT8, "peek": "int4"}},
    "acco-int4": {"optimizer.params.compression": INT4},
    "acco-adaptive-int4": {"optimizer.params.compression": INT4},
    # the peek's exchange left out altogether: dpu (each round commits, with the delay, and no estimate) with
    # acco-int8's commits and parameter differences
    "dpu-int8": {"optimizer.params.compression": INT8_NO_PEEK},
    "acco-int8-unfused": {"optimizer.params.compression": {**INT8, "fuse_round_end": False}},
    "acco-int4-unfused": {"optimizer.params.compression": {**INT4, "fuse_round_end": False}},
}
"""What a contender changes in its mode's DeepSpeed config: a top-level key, or ``optimizer.params.<key>``."""


def contender_config(label: str, knobs: dsconfig.Knobs) -> dict:
    """The DeepSpeed config of contender ``label``: its mode's (``dsconfig.build_config``) with its
    ``CONFIG_CHANGES``."""
    mode, _ = CONTENDERS[label]
    cfg = dsconfig.build_config(mode, knobs)
    for key, value in CONFIG_CHANGES.get(label, {}).items():
        if key.startswith("optimizer.params."):
            cfg["optimizer"]["params"][key.removeprefix("optimizer.params.")] = value
        else:
            cfg[key] = value
    return cfg


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
    tp: int = 1  # tensor-parallel size (AutoTP; world / tp data-parallel replicas)
    eval_windows: int = 128
    eval_every: int = 0  # validation also at the start and every this many steps (0: at the end only)

    @property
    def dp_world(self) -> int:
        return self.world // self.tp

    def knobs(
        self, accumulation: str, steps: int | None = None, warmup_lr: int | None = None
    ) -> dsconfig.Knobs:
        """The DeepSpeed knobs; ``steps``/``warmup_lr`` set another LR schedule (budget runs)."""
        return dsconfig.Knobs(
            micro_batch=self.micro_batch,
            grad_accum=self.grad_accum,
            world_size=self.world,
            lr=self.lr,
            min_lr=self.min_lr,
            warmup_steps=self.warmup_lr_steps if warmup_lr is None else warmup_lr,
            total_steps=self.steps if steps is None else steps,
            bf16=self.bf16,
            accumulation=accumulation,
            num_params=self.n_params,
            tp=self.tp,
        )

    @property
    def budget_samples(self) -> int:
        """The token budget of framing (b): the samples a fixed-accumulation contender computes in
        ``steps`` optimizer steps (steps x GAS x micro-batch x data-parallel replicas)."""
        return self.steps * self.grad_accum * self.micro_batch * self.dp_world


def budget_schedule(setup: Setup, samples_per_step: float) -> dict:
    """Adaptive ACCO's run at the token budget: ``steps`` = the budget over the global samples per
    optimizer step it made at that link in its ``setup.steps``-step run of the same seed (at least
    3), with the LR schedule (linear warm-up, cosine decay) compressed to those steps: warm-up
    ``round(warmup_lr_steps x steps / setup.steps)`` (at least 1, below ``steps``), decay to the
    last step. So its schedule ends inside the budget instead of being cut off in warm-up."""
    budget = setup.budget_samples
    steps = max(3, round(budget / samples_per_step)) if samples_per_step > 0 else setup.steps
    warm = min(steps - 1, max(1, round(setup.warmup_lr_steps * steps / setup.steps)))
    return {
        "budget_samples": budget,
        "samples_per_step": samples_per_step,
        "steps": steps,
        "warmup_lr_steps": warm,
    }


def _spec(
    setup: Setup,
    run_dir: Path,
    label: str,
    mode: str,
    acc: str,
    cfg: dict,
    slow: dict,
    seed: int | None = None,
    steps: int | None = None,
) -> RunSpec:
    return RunSpec(
        name=label,
        mode=mode,
        accumulation=acc,
        run_dir=str(run_dir),
        model=setup.model,
        ds_config=cfg,
        steps=setup.steps if steps is None else steps,
        micro_batch=setup.micro_batch,
        grad_accum=setup.grad_accum,
        seed=setup.seed if seed is None else seed,
        threads=setup.threads,
        eval_windows=setup.eval_windows,
        eval_every=setup.eval_every,
        progress=False,
        slow_rank=slow.get("rank", -1),
        slow_extra_s=slow.get("extra_s"),
        tp=setup.tp,
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
        wrap=link.wrap(rate, setup.nice),
        timeout=setup.timeout_s,
        env_extra=link.link_env(),
    )


def launch_and_summarize(setup: Setup, spec: RunSpec, rate: str, run=None) -> dict:
    """Run one spec with ``run(setup, spec, rate)`` (default: all ranks in the throttled namespace
    of ``rate``) and return its figures; or reuse ``bench_run.json`` of a run that finished in this
    work folder (an interrupted sweep resumes where it stopped when given the same ``--work``)."""
    run_dir = Path(spec.run_dir)
    cached = run_dir / "bench_run.json"
    if cached.exists():
        return json.loads(cached.read_text())
    load0 = os.getloadavg()[0]
    t = time.perf_counter()
    (run or _run_spec)(setup, spec, rate)
    wall = time.perf_counter() - t
    logs, ranks = read_ranks(run_dir, setup.world)
    records = merge_ranks(logs[:: setup.tp], setup.micro_batch)
    s = summarize(records, ranks[:: setup.tp], warmup=setup.warmup, micro_batch=setup.micro_batch)
    s["peak_mem_mib"] = [r["peak_mem_mib"] for r in ranks]
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


def contender_spec(
    setup: Setup,
    label: str,
    rate: str,
    slow: dict | None = None,
    tag: str = "",
    seed: int | None = None,
    schedule: dict | None = None,
) -> RunSpec:
    """The spec of one run of ``label`` (a key of CONTENDERS); ``schedule`` (``budget_schedule``):
    a run at the token budget, its steps and LR schedule set by it (folder ``<label>-budget``)."""
    mode, acc = CONTENDERS[label]
    steps = warm = None
    if schedule:
        steps, warm = schedule["steps"], schedule["warmup_lr_steps"]
    cfg = contender_config(label, setup.knobs(acc, steps, warm))
    run_dir = setup.work / f"{rate}{tag}" / (f"{label}-budget" if schedule else label)
    return _spec(setup, run_dir, label, mode, acc, cfg, slow or {}, seed, steps)


def run_contender(setup: Setup, label: str, rate: str, *spec_args, schedule: dict | None = None) -> dict:
    """One training run of ``label`` on a link of ``rate`` (all ranks in one throttled namespace);
    ``spec_args`` and ``schedule``: ``contender_spec``'s (slow, tag, seed), the schedule kept in the summary."""
    spec = contender_spec(setup, label, rate, *spec_args, schedule=schedule)
    s = launch_and_summarize(setup, spec, rate)
    if schedule:
        s["schedule"] = schedule
    return s


# The loop of the compute-only bound: acco_ds in dpu mode (one round per optimizer step, the round's
# job on the communication thread), each rank alone in its own job (see run_compute_only).
BOUND_LOOP = ("dpu", "fixed")


def bound_steps(setup: Setup) -> int:
    """Optimizer steps of a compute-only run: the contenders' steps, but at least 3 x warm-up + 6,
    so that on a loaded machine, where one replica can run 1.5x slower than the other, the window
    in which every replica is past its warm-up and none has finished still holds several steps
    (the bound is a rate: a longer run only sharpens it)."""
    return max(setup.steps, 3 * setup.warmup + 6)


def run_compute_only(setup: Setup, tag: str) -> dict:
    """The compute-only bound: the training loop of the contenders with the communication removed.

    Every data-parallel replica r runs as its own acco_ds job (``BOUND_LOOP``) of ``setup.tp``
    ranks (one rank without tensor parallelism; with it, the replica's tensor-parallel group keeps
    its collectives, on the loopback of a private namespace, as on one node): the same worker,
    DeepSpeed engine, model, micro-batches of replica r, accumulation, dtype, threads and LR
    schedule (over ``bound_steps`` steps), the same
    ``loss = engine(x, y); engine.backward(loss); engine.step()`` loop with the gradients
    accumulated into ACCO's flat buffer, and at each round end ACCO's round job on its
    communication thread (the sharded AdamW over the whole model - a shard of W ranks is 1/W of
    it - and the reduce-scatter / all-gather of a one-replica group, which move no byte between
    replicas). The jobs run concurrently (all ranks share the machine as in a contender run) and
    start training together through a start gate. Bound = the sum over replicas of each one's
    samples/s over the window where every replica is past its warm-up and none has finished: each
    at its own pace, so a replica the machine slows does not cap the others (a merged figure
    "global samples / slowest replica's time" would be W x the slowest one, which adaptive
    accumulation legitimately beats). Returns the summary with ``samples_per_s`` (the bound),
    ``rank_samples_per_s`` (per replica), ``t_mb`` (median seconds of one micro-batch per replica)
    and the replicas' records."""
    run_dir = setup.work / f"compute{tag}"
    cached = run_dir / "bench_run.json"
    if cached.exists():
        return json.loads(cached.read_text())
    mode, acc = BOUND_LOOP
    steps = bound_steps(setup)
    knobs = dataclasses.replace(setup.knobs(acc, steps), world_size=setup.tp)
    cfg = dsconfig.build_config(mode, knobs)
    gate = run_dir / "gate"
    shutil.rmtree(gate, ignore_errors=True)
    specs = []
    for r in range(setup.dp_world):
        name = f"replica{r}" if setup.tp > 1 else f"rank{r}"
        spec = _spec(setup, run_dir / name, f"compute-only-{name}", mode, acc, cfg, {}, steps=steps)
        spec.data_offset, spec.start_gate, spec.gate_count, spec.eval_windows = r, str(gate), setup.world, 16
        specs.append(spec)
    load0 = os.getloadavg()[0]
    t = time.perf_counter()

    def one(spec: RunSpec) -> None:
        try:
            _run_spec(setup, spec, "none", world=setup.tp)
        except BaseException:
            gate.mkdir(parents=True, exist_ok=True)
            (gate / "abort").touch()  # the other jobs stop waiting at the gate
            raise

    with ThreadPoolExecutor(len(specs)) as pool:
        for f in [pool.submit(one, spec) for spec in specs]:
            f.result()
    logs = [read_ranks(spec.run_dir, setup.tp)[0][0] for spec in specs]  # each replica's first rank
    s = bound_figures(logs, setup.warmup, setup.micro_batch)
    jobs = f"one-replica jobs of {setup.tp} ranks" if setup.tp > 1 else "one-rank jobs"
    s.update(
        label="compute-only",
        rate="none",
        loop=f"{mode} {acc}, {jobs}",
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
    size in the communication dtype (``benchmarks.ranks.comm_probe``)."""
    run_dir = setup.work / rate / "comm-only"
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "comm.json"
    if out.exists():  # resumed sweep
        return comm_figures(json.loads(out.read_text()))
    extra = ["--numel", str(setup.n_params), "--dtype", "bf16" if setup.bf16 else "fp32", "--reps", str(reps)]
    cmd = launch_command(None, setup.world, _port(), target=COMM_PROBE, extra=extra + ["--out", str(out)])
    run_ranks(
        cmd,
        1,
        log_path=run_dir / "launch.log",
        wrap=link.wrap(rate, setup.nice),
        timeout=setup.timeout_s,
        env_extra=link.link_env(),
    )
    return comm_figures(json.loads(out.read_text()))


def comm_figures(res: dict) -> dict:
    """The probe's timings ``res`` with T_comm of a round (the cheapest reduction + all-gather) and
    T_reduce (the cheapest reduction alone) added."""
    res["t_comm_s"] = min(res[k] for k in ("rs_ag_s", "ar_ag_s", "p2p_ag_s") if k in res)
    res["t_reduce_s"] = min(res[k] for k in ("rs_s", "ar_s", "p2p_s") if k in res)
    return res
