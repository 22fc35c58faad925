"""Per-rank worker for the multi-rank tests, started by the ``deepspeed`` launcher.

Runs each scenario of a JSON list (a DeepSpeed config + steps) on the toy model and, on rank 0,
saves per step: the lr the step used, the committed fp32 parameters and Adam moments read back
(``readback.full_state``: one collective per key; at the end, DeepSpeed's public
``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` are checked to give the same bits) and
``engine.get_global_grad_norm()``, plus ACCO's state sizes/stats. ``final_norm``: the norm of the last
commit, which acco/dpu report only once ``finish()`` has applied it.

Scenario switches of the CPU test modes: ``cuda_paths`` runs the scenario with the CUDA executor on emulated
streams (``core.emulated_stream``) and the host summaries read one job late (``defer_host_reads``, which a
scenario may also ask for alone); the results then say which executor ran (``executor``) and how often its
emulated events were found not yet complete (``emulated_incomplete_looks``).
"""

from __future__ import annotations

import contextlib
import os

import deepspeed  # noqa: E402
import torch

import acco_ds  # noqa: E402,F401
from acco_ds.core import compressed_comm, emulated_stream, round_job, snapshot
from acco_ds.deepspeed.cpu_fp16 import allow_fp16_on_cpu
from tests.ranks import rank_start, readback, toy  # noqa: E402

P2P = compressed_comm.point_to_point
COLLECTIVES = round_job.collectives
UNSTORED_SUM_MAX_WORLD = round_job.UNSTORED_SUM_MAX_WORLD


def optimizer_states(engine, params, key: str) -> torch.Tensor:
    """Every parameter's moment ``key``, flat (``readback.full_state``); zeros while DeepSpeed's ZeRO-1 has no Adam
    state (every step so far skipped for an fp16 overflow: its accessor then fails on the missing state). The same
    decision on every rank (the skips are), so the collectives stay matched."""
    if not hasattr(engine.optimizer, "pipeline") and not engine.optimizer.optimizer.state:
        return torch.zeros(sum(p.numel() for p in params))
    return readback.full_state(engine, params, key)


@contextlib.contextmanager
def emulated_stream_executor(on: bool):
    """``ACCO_DS_EMULATED_STREAM_EXECUTOR=1`` for the block when ``on`` (the executor is made in
    ``deepspeed.initialize``), unset after."""
    if not on:
        yield
        return
    os.environ[emulated_stream.EXECUTOR_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(emulated_stream.EXECUTOR_ENV, None)


def initialize(model, cfg: dict, cuda_paths: bool):
    """``deepspeed.initialize`` of ``model`` with ``cfg``; with ``cuda_paths``, on the CPU test modes of the paths
    only a GPU rank takes: the CUDA executor on emulated streams (core.emulated_stream: its switch set while the
    engine builds the executor) and each job's host summary read one job late (defer_host_reads)."""
    with emulated_stream_executor(cuda_paths):
        engine, _, _, _ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    if cuda_paths:
        engine.optimizer.pipeline.defer_host_reads = True
    return engine


def run_scenario(sc: dict, rank: int) -> dict:
    cfg = sc["config"]
    gas = cfg["gradient_accumulation_steps"]
    if cfg.get("fp16", {}).get("enabled"):
        allow_fp16_on_cpu()
    # "poison": [rank, micro-batch index] pairs whose loss is multiplied by inf (a planted fp16 overflow), or
    # [rank, micro-batch index, parameter name]: only that parameter's gradient is (an overflow in one shard)
    poison = {tuple(p) for p in sc.get("poison", []) if len(p) == 2}
    poison_param = {(p[0], p[1]): p[2] for p in sc.get("poison", []) if len(p) == 3}
    linear = sc.get("model") == "linear"  # toy.Linear: a micro-batch's gradient is toy.linear_input
    model = toy.Linear() if linear else toy.build()
    engine = initialize(model, cfg, bool(sc.get("cuda_paths")))
    if sc.get("defer_host_reads"):  # read each job's host summary one job later, as the pipeline does on CUDA
        engine.optimizer.pipeline.defer_host_reads = True
    params = toy.trainable(engine.module)
    lrs, traj, norms, at_boundary, residuals, committed = [], [], [], [], [], []
    scales, skipped = [], []
    moments = {"exp_avg": [], "exp_avg_sq": []}
    for step in range(sc["steps"]):
        lrs.append(float(engine.get_lr()[0]))
        for j in range(gas):
            if linear:
                loss = engine(toy.linear_input(rank, step * gas + j).to(engine.device))
            else:
                x, y = toy.micro_batch(rank, step * gas + j)
                loss = engine(x.to(engine.device), y.to(engine.device))
            if (rank, step * gas + j) in poison:
                loss = loss * float("inf")
            hook = None
            if (rank, step * gas + j) in poison_param:
                target = dict(engine.module.named_parameters())[poison_param[(rank, step * gas + j)]]
                hook = target.register_hook(lambda g: g * float("inf"))
            engine.backward(loss)
            if hook is not None:
                hook.remove()
            engine.step()
        traj.append(readback.full_state(engine, params))
        for key, per_step in moments.items():
            per_step.append(optimizer_states(engine, params, key))
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
        scales.append(float(engine.optimizer.cur_scale))
        skipped.append(int(engine.skipped_steps))
        # compressed rounds: what the model holds (acco: the estimate) and this rank's error-feedback residual,
        # after the reads above waited for the job in flight (tests/core/test_trajectories.py replays each step)
        pipe = getattr(engine.optimizer, "pipeline", None)
        if pipe is not None and pipe.cfg.compression.enabled:
            at_boundary.append(toy.flat(params).cpu())
            snapshot.drain(pipe)
            theta = snapshot.committed_flats(pipe)[0][: pipe.groups[0].layout.numel]
            committed.append(theta.detach().float().cpu().clone())  # theta as the replicas hold it
            residual = pipe.residuals[0]
            residuals.append(None if residual is None else residual.detach().cpu().clone())
    out = {"lrs": lrs, "traj": traj, "norms": norms, "moments": moments, "scales": scales, "skipped": skipped}
    if at_boundary:
        out["model_at_boundary"], out["residuals"] = at_boundary, residuals
        out["committed_replica"] = committed
    for key, per_step in moments.items():
        out[key] = per_step[-1]
    opt = engine.optimizer
    if hasattr(opt, "pipeline"):
        readback.check_public_accessors(engine, params)
        out["state_numel"] = opt.state_numel_per_rank()
        out["state_shapes"] = [
            [tuple(b.master.shape), tuple(b.exp_avg.shape), tuple(b.exp_avg_sq.shape)]
            for b in opt.pipeline.groups
        ]
        out["model_holds_at_boundary"] = opt.pipeline.model_holds
        opt.finish()
        out["final_norm"] = float(opt.pipeline.last_grad_norm)
        out["final_scale"] = float(opt.cur_scale)
        out["final_model"] = toy.flat(params).cpu()
        out["stats"] = opt.stats()
        # which executor ran the jobs, and how often a look at an emulated event found it not yet complete
        out["executor"] = type(opt.pipeline.executor).__name__
        out["emulated_incomplete_looks"] = getattr(
            getattr(opt.pipeline.executor, "cuda", None), "incomplete_looks", None
        )
        out["defer_host_reads"] = opt.pipeline.defer_host_reads
        opt.pipeline.close()
    return out


def main() -> None:
    ap = rank_start.scenario_parser()
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    args = ap.parse_args()
    rank = rank_start.init_rank(args.backend)
    results = {}
    for sc in rank_start.load_scenarios(args.scenarios):
        # "collective_exchange": the compressed exchanges take their collective (NCCL) form on gloo as well
        compressed_comm.point_to_point = (lambda group: False) if sc.get("collective_exchange") else P2P
        # and so do the uncompressed rounds' reduce-scatter and all-gather
        round_job.collectives = (lambda group: True) if sc.get("collective_exchange") else COLLECTIVES
        # "stored_sum": the owner stores the sum of the quantized chunks, as from W = 4 on
        round_job.UNSTORED_SUM_MAX_WORLD = 0 if sc.get("stored_sum") else UNSTORED_SUM_MAX_WORLD
        results[sc["name"]] = run_scenario(sc, rank)
        results[sc["name"]]["world_size"] = torch.distributed.get_world_size()
    rank_start.attach_per_rank(results, "stats_per_rank", lambda r: r.get("stats"))
    rank_start.attach_per_rank(results, "final_model_per_rank", lambda r: r.get("final_model"))
    rank_start.attach_per_rank(results, "residuals_per_rank", lambda r: r.get("residuals"))
    if rank == 0:
        torch.save(results, os.path.join(args.out, "results.pt"))


if __name__ == "__main__":
    main()
