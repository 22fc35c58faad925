"""Capture and restore the whole state of an ``ACCOPipeline`` as plain tensors and dicts.

This is what exact resume needs (docs/ALGORITHM.md, properties 5 and 6). No DeepSpeed here: the
DeepSpeed layer (``acco_ds.deepspeed.checkpoint``) stores the fp32 master and the Adam moments
under DeepSpeed's ZeRO-1 keys and the rest under its own "acco" key.

Contract of :func:`capture` (per rank, collective over the data-parallel group):

1. :func:`drain` first. In adaptive accumulation the ranks may be one round apart (a fast rank
   has launched round R, a slow one is still accumulating it); the ranks behind end their round
   with the micro-batches they have, until all have launched the same number of rounds (the rule
   of ``ACCOPipeline._agree_on_round_count``; adaptive rounds end at variable points anyway, so
   no gradient is lost or counted twice). Then every rank waits for its job in flight
   (``sync_in_flight``), which does NOT swap the job's result in: the schedule is unchanged.
2. The job in flight, finished, is recorded as its ``RoundResult`` (job kind, commit index,
   grad norm, host summary: skip flag, counts). :func:`restore` rebuilds it as an already finished
   ticket, so the resumed run swaps the gathered parameters in at the same round end as the run
   that was never interrupted, and applies its bookkeeping (committed steps, stats) once.
3. Parameter buffers: the MODEL buffer and the parameter target of the finished job in flight are,
   on every rank, the all-gather of the ranks' shards, so only this rank's shard of each is saved;
   :func:`restore` all-gathers them back, bit for bit, into buffers in a canonical role assignment
   (``GroupBuffers.restore_roles``: which physical buffer holds which role does not change any value).
4. The gradients of the round being accumulated (the ACC buffer, rank-local, full size) are saved
   only when that round holds micro-batches (``counter.count > 0``): at an engine boundary in fixed
   accumulation it is empty.
5. The g~ kept by the last peek (``tilde``, acco) and its global count, the LR/AdamW settings
   recorded per engine step (``_hyper_history``), every counter and ``PipelineStats``.
6. fp16's loss scaler (``core.loss_scale``): its whole state and the scale of the round in progress, under
   ``"loss_scale"`` (None without fp16); the finished job in flight keeps the scale it was computed under, so its
   outcome updates the scaler at the same round end as in the run that was never interrupted.
7. Compressed rounds with error feedback: this rank's residual per group (``pipeline.residuals``, full
   size, rank-local, what quantization withheld from the rounds sent so far), under ``"residual"``
   (None without one). :func:`restore` puts it back; a snapshot without one (saved with error feedback
   off) restores zeros; a snapshot's residual that this pipeline has no use for (error feedback off now)
   is dropped with a logged warning. :func:`resume_from_committed` (another world size, mode, ...) drops
   every residual (the rounds they belong to are gone) and logs a warning when one was not zero.

RNG state, the data order and the engine's own counters are the caller's business.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, fields
from typing import Any, Dict, List, Sequence

import torch
import torch.distributed as dist

from acco_ds.core.comm import Ticket
from acco_ds.core.compressed_comm import Traffic
from acco_ds.core.round_job import RoundResult, all_gather_inplace
from acco_ds.core.schedule import Job, RoundEnd
from acco_ds.ops.adamw_settings import AdamWSettings

logger = logging.getLogger("acco_ds")

FORMAT_VERSION = 2  # 2: role-based buffers (acco_ds 0.2); 1 held two slots per buffer kind

_SCALARS = (
    "round_index",
    "phase_round",
    "commits_launched",
    "model_holds",
    "committed_steps",
    "state_step",
    "engine_steps",
)


class SnapshotMismatchError(ValueError):
    """A snapshot taken with another layout, world size or ACCO setting than the pipeline's."""


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def drain(pipeline) -> None:
    """Make the pipeline's state final and readable without changing what the next round computes
    at: adaptive ranks agree on the round count, then every rank waits for its job in flight.
    Collective over the data-parallel group; idempotent."""
    if pipeline.adaptive:
        pipeline._agree_on_round_count()
    pipeline.sync_in_flight()


def committed_flats(pipeline) -> List[torch.Tensor]:
    """Per group, the full parameter buffer that holds the committed parameters theta after
    :func:`drain`: the target of a COMMIT in flight (finished, not yet swapped in), else the MODEL
    buffer (in acco the model holds theta while a peek is in flight; in sync nothing is in flight)."""
    if pipeline.in_flight is not None:
        result = pipeline.in_flight[0].result
        if result is not None and result.job is Job.COMMIT:
            return [b.job_param_flat() for b in pipeline.groups]
    return [b.model_flat for b in pipeline.groups]


def pending_applied_commits(pipeline) -> int:
    """1 when a finished COMMIT in flight changed the state but is not yet counted in
    ``state_step`` (it is counted when swapped in), else 0. Call after :func:`drain`."""
    if pipeline.in_flight is None:
        return 0
    result = pipeline.in_flight[0].result
    if result is None or result.job is not Job.COMMIT:
        return 0
    return 0 if (result.skipped or result.empty) else 1


def _layout_of(pipeline) -> List[Dict[str, int]]:
    return [
        {
            "numel": b.layout.numel,
            "padded_numel": b.layout.padded_numel,
            "world_size": b.layout.world_size,
            "num_params": len(b.layout.numels),
        }
        for b in pipeline.groups
    ]


def capture(pipeline) -> Dict[str, Any]:
    """This rank's state as CPU tensors and plain values (see the module docstring). Calls
    :func:`drain` (collective). The returned tensors are copies: training may go on."""
    drain(pipeline)
    snap = counters(pipeline)
    snap["in_flight"] = None
    if pipeline.in_flight is not None:
        ticket, plan = pipeline.in_flight
        res: RoundResult = ticket.result
        snap["in_flight"] = {
            "name": ticket.name,
            "plan": {
                "job": plan.job.value,
                **{k: getattr(plan, k) for k in ("wait_previous", "wait_now", "commit_index")},
            },
            "result": _result_to_plain(res),
        }
    groups = []
    for b, residual, rscale in zip(pipeline.groups, pipeline.residuals, pipeline.residual_scales):
        job_flat = b.job_param_flat()
        groups.append(
            {
                "master": _cpu(b.master),
                "exp_avg": _cpu(b.exp_avg),
                "exp_avg_sq": _cpu(b.exp_avg_sq),
                "model_shard": _cpu(b.shard_of(b.model_flat)),
                "job_shard": None if job_flat is None else _cpu(b.shard_of(job_flat)),
                "tilde": None if b.tilde is None else _cpu(b.tilde),
                "acc_grads": _cpu(b.acc_flat) if pipeline.counter.count > 0 else None,
                "residual": None if residual is None else _cpu(residual),
                "residual_scale": None if rscale is None else _cpu(rscale),
            }
        )
    snap["groups"] = groups
    return snap


def counters(pipeline) -> Dict[str, Any]:
    """The part of :func:`capture` that is neither a tensor of the parameters' size nor the job in flight: the
    layout, the counters, the recorded AdamW settings, the stats and the loss scaler's state, as plain values and
    small CPU tensors. Not collective and no drain: what the pipeline's training thread holds now."""
    snap: Dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "mode": pipeline.mode,
        "adaptive": pipeline.adaptive,
        "gas": pipeline.gas,
        "world_size": pipeline.world_size,
        "rank": pipeline.rank,
        "layout": _layout_of(pipeline),
        "counter_count": pipeline.counter.count,
        "tilde_count": _cpu(pipeline.tilde_count[0]),
        "last_grad_norm": None if pipeline.last_grad_norm is None else _cpu(pipeline.last_grad_norm),
        "hyper_history": {int(k): [asdict(h) for h in v] for k, v in pipeline._hyper_history.items()},
        "stats": {k: (list(v) if isinstance(v, list) else v) for k, v in pipeline.stats.as_dict().items()},
        "loss_scale": None if pipeline.scaler is None else pipeline.scaler.state_dict(),
    }
    for name in _SCALARS:
        snap[name] = getattr(pipeline, name)
    return snap


def check_compatible(pipeline, snap: Dict[str, Any]) -> None:
    """Raise SnapshotMismatchError naming the difference when ``snap`` cannot be restored here."""
    version = snap.get("format_version")
    if version != FORMAT_VERSION:
        raise SnapshotMismatchError(
            f"ACCO checkpoint state has format_version={version}; this acco_ds reads version {FORMAT_VERSION}."
        )
    if snap["world_size"] != pipeline.world_size:
        raise SnapshotMismatchError(
            f"the checkpoint was saved with a data-parallel world size of {snap['world_size']}, this run has "
            f"{pipeline.world_size}. ACCO shards its optimizer state (and keeps in-flight state) per rank, so it "
            f"resumes only on {snap['world_size']} ranks. To change the world size, load the model weights only "
            "(engine.load_checkpoint(..., load_optimizer_states=False), or the fp32 weights from zero_to_fp32.py) "
            "and start a new optimizer state."
        )
    for key, label in (("mode", "optimizer.params.mode"), ("adaptive", "optimizer.params.accumulation")):
        if snap[key] != getattr(pipeline, key):
            saved, now = snap[key], getattr(pipeline, key)
            if key == "adaptive":
                saved, now = ("adaptive" if saved else "fixed"), ("adaptive" if now else "fixed")
            raise SnapshotMismatchError(
                f"the checkpoint was saved with {label}={saved!r}, this run has {now!r}: the in-flight state of "
                f"one schedule cannot continue in another. Resume with {label}={saved!r}, or load with "
                "load_optimizer_states=False to start a new optimizer state from the saved weights."
            )
    if (snap.get("loss_scale") is None) != (pipeline.scaler is None):
        saved, now = snap.get("loss_scale") is not None, pipeline.scaler is not None
        raise SnapshotMismatchError(
            f"the checkpoint was saved with fp16.enabled={str(saved).lower()}, this run has "
            f"fp16.enabled={str(now).lower()}: the in-flight gradients of one precision cannot continue in the other. "
            "engine.load_checkpoint resumes it from the committed state instead."
        )
    if snap["gas"] != pipeline.gas:
        raise SnapshotMismatchError(
            f"the checkpoint was saved with gradient_accumulation_steps={snap['gas']}, this run has {pipeline.gas}; "
            f"ACCO's rounds are cut from it. Resume with gradient_accumulation_steps={snap['gas']}."
        )
    if snap["layout"] != _layout_of(pipeline):
        raise SnapshotMismatchError(
            f"the checkpoint's parameter groups {snap['layout']} differ from this model's {_layout_of(pipeline)} "
            "(numel, padded numel, world size, parameter count per group): a different model or different "
            "param groups (e.g. frozen parameters) than the run that saved it."
        )


@torch.no_grad()
def restore(pipeline, snap: Dict[str, Any]) -> None:
    """Put ``snap`` (from :func:`capture` on this rank, any process) into ``pipeline``.
    Collective (every rank restores its own snapshot at the same point): :func:`drain`, then the
    job in flight, if any, is dropped, and the parameter buffers are all-gathered from the saved
    shards. The model's parameters end pointing at the restored model slot."""
    check_compatible(pipeline, snap)
    drain(pipeline)
    pipeline.in_flight = None
    pipeline._in_flight_releases = None  # a restored job is finished: it holds no residual
    dev = pipeline.device
    in_flight = snap["in_flight"] is not None
    for b, g in zip(pipeline.groups, snap["groups"]):
        b.restore_roles(in_flight)
        b.master.copy_(g["master"])
        b.exp_avg.copy_(g["exp_avg"])
        b.exp_avg_sq.copy_(g["exp_avg_sq"])
        for flat in {id(t): t for t in b.param_bufs + b.grad_bufs}.values():
            flat.zero_()
        gathered = [(b.model_flat, g["model_shard"])]
        if in_flight:
            gathered.append((b.job_param_flat(), g["job_shard"]))
        for flat, shard in gathered:
            b.shard_of(flat).copy_(shard)
            all_gather_inplace(flat, pipeline.executor.group)
        if b.tilde is not None:
            b.tilde.copy_(g["tilde"])
        if g["acc_grads"] is not None:
            b.acc_flat.copy_(g["acc_grads"])
    _restore_residuals(pipeline, [g.get("residual") for g in snap["groups"]])
    for rscale, g in zip(pipeline.residual_scales, snap["groups"]):
        if rscale is not None and g.get("residual_scale") is not None:
            rscale.copy_(g["residual_scale"])
    for name in _SCALARS:
        setattr(pipeline, name, snap[name])
    pipeline.counter.count = int(snap["counter_count"])
    if pipeline.scaler is not None:
        pipeline.scaler.load_state_dict(snap["loss_scale"])
    pipeline.tilde_count[0] = snap["tilde_count"].to(dev)
    pipeline.last_grad_norm = None if snap["last_grad_norm"] is None else snap["last_grad_norm"].to(dev)
    pipeline._hyper_history = {
        int(k): [AdamWSettings(**h) for h in v] for k, v in snap["hyper_history"].items()
    }
    stats_type = type(pipeline.stats)
    known = {f.name for f in fields(stats_type)}
    pipeline.stats = stats_type(**{k: v for k, v in snap["stats"].items() if k in known})
    pipeline._unread.clear()
    if in_flight:
        pipeline.in_flight = _finished_ticket(pipeline, snap["in_flight"])
    applied = pipeline.state_step + pending_applied_commits(pipeline)
    pipeline.applied_dev[0] = torch.full((1,), float(applied), dtype=torch.float64, device=dev)
    for b in pipeline.groups:
        b.point_params()
        b.point_grads()
    pipeline.viewing_committed = False


def _restore_residuals(pipeline, saved: Sequence[torch.Tensor | None]) -> None:
    """Put the saved error-feedback residuals back (item 6 of the module docstring)."""
    dropped = False
    for residual, r in zip(pipeline.residuals, saved):
        if residual is not None:
            if r is None:
                residual.zero_()
            else:
                residual.copy_(r)
        elif r is not None and bool(r.ne(0).any()):
            dropped = True
    if dropped:
        logger.warning(
            "acco_ds: the checkpoint holds error-feedback residuals of compressed rounds, and this run has "
            "optimizer.params.compression.error_feedback off (or compression off): they are dropped (what "
            "quantization withheld from the last rounds before the save is not sent)."
        )


def _warn_if_residuals_dropped(saved: Sequence[Dict[str, Any]] | None) -> None:
    nonzero = any(
        g.get("residual") is not None and bool(g["residual"].ne(0).any())
        for snap in saved or []
        for g in snap.get("groups", [])
    )
    if nonzero:
        logger.warning(
            "acco_ds: resuming from the committed state (another world size, mode or schedule): the "
            "error-feedback residuals of the compressed rounds are per rank and are dropped (what quantization "
            "withheld from the rounds before the save, at most half a quantization step per element and rank)."
        )


@torch.no_grad()
def resume_from_committed(
    pipeline,
    shards: Sequence[Dict[str, torch.Tensor]],
    step: int,
    saved: Sequence[Dict[str, Any]] | None = None,
) -> int:
    """Restart ``pipeline`` from a committed optimizer state re-sharded to its layout: a checkpoint saved
    on another world size, with another mode / accumulation / gradient_accumulation_steps, a universal
    checkpoint, or another optimizer's. Collective. Returns the number of micro-batches discarded.

    ``shards[i]``: group i's fp32 master ("fp32"), "exp_avg" and "exp_avg_sq", this rank's shard in this
    pipeline's layout; ``step``: the AdamW step count of that state (commits applied, the save's commit in
    flight included). The run goes on as docs/ALGORITHM.md's start from that state: nothing in flight, no pending
    gradients, the model at theta, a new prologue round (``ACCOPipeline.restart``).

    ``saved``: every saving rank's :func:`capture` (ACCO checkpoints), in rank order. Then the counters
    continue: the committed-step count, engine steps and recorded AdamW settings, round index and the
    global stats come from rank 0 (like :func:`adopt_step_schedule_of_rank0`); the job in flight at the
    save is counted as if it had been swapped in (a commit is in the master already); then the work that
    no commit will use is counted as discarded: the g~ kept for the next commit when that job was a peek
    (acco) and every saving rank's pending micro-batches. The per-rank figures (micro_batches_local,
    comm_wait_s) of saving rank r go to rank r mod W'. Without ``saved`` (no ACCO state) the committed
    and engine step counts become ``step``, the recorded AdamW settings start over and the stats of this
    pipeline are kept."""
    if len(shards) != len(pipeline.groups):
        raise SnapshotMismatchError(
            f"{len(shards)} groups of state for a pipeline of {len(pipeline.groups)} groups"
        )
    for b, g in zip(pipeline.groups, shards):
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            if g[key].numel() != b.layout.shard_numel:
                raise SnapshotMismatchError(
                    f"{key} shard of {g[key].numel()} elements, the layout has {b.layout.shard_numel}"
                )
    drain(pipeline)
    _warn_if_residuals_dropped(saved)
    discarded = 0
    if saved is not None:
        s0 = saved[0]
        for snap in saved:
            if snap.get("format_version") != FORMAT_VERSION:
                raise SnapshotMismatchError(
                    f"ACCO checkpoint state has format_version={snap.get('format_version')}; this acco_ds reads "
                    f"version {FORMAT_VERSION}."
                )
        dev = pipeline.device
        stats_type = type(pipeline.stats)
        known = {f.name for f in fields(stats_type)}
        pipeline.stats = stats_type(**{k: v for k, v in s0["stats"].items() if k in known})
        pipeline.committed_steps = int(s0["committed_steps"])
        pipeline.state_step = int(s0["state_step"])
        pipeline.engine_steps = int(s0["engine_steps"])
        pipeline.round_index = int(s0["round_index"])
        pipeline._hyper_history = {
            int(k): [AdamWSettings(**h) for h in v] for k, v in s0["hyper_history"].items()
        }
        pipeline.last_grad_norm = None if s0["last_grad_norm"] is None else s0["last_grad_norm"].to(dev)
        if pipeline.scaler is not None and s0.get("loss_scale") is not None:
            pipeline.scaler.load_state_dict(s0["loss_scale"])
        before = pipeline.stats.micro_batches_discarded
        if s0["in_flight"] is not None:
            result = _result_from_plain(s0["in_flight"]["result"], dev)
            pipeline._apply_loss_scale(result)
            pipeline._account(result)  # the bookkeeping of its swap-in, which will not happen
            if result.job is Job.PEEK:  # its g~ was kept for the next commit
                pipeline.stats.micro_batches_discarded += int(s0["tilde_count"].reshape(-1)[0].item())
        pipeline.stats.micro_batches_discarded += sum(int(s["counter_count"]) for s in saved)
        pipeline.stats.last_round_counts = []
        world, rank = pipeline.world_size, pipeline.rank
        for key in ("micro_batches_local", "comm_wait_s", "round_end_host_s"):
            mine = [s["stats"].get(key, 0) for r, s in enumerate(saved) if r % world == rank]
            setattr(pipeline.stats, key, sum(mine) if mine else type(getattr(pipeline.stats, key))(0))
        discarded = pipeline.stats.micro_batches_discarded - before
        if pipeline.state_step != step:
            raise SnapshotMismatchError(
                f"the checkpoint's step count {step} disagrees with its ACCO state ({pipeline.state_step} applied "
                "commits): the files come from different saves."
            )
    pipeline.state_step = int(step)
    if saved is None:
        pipeline.committed_steps = pipeline.state_step
        pipeline.engine_steps = pipeline.state_step
        pipeline._hyper_history = {}
    pipeline.commits_launched = pipeline.committed_steps
    pipeline._unread.clear()
    for b, g in zip(pipeline.groups, shards):
        b.exp_avg.copy_(g["exp_avg"])
        b.exp_avg_sq.copy_(g["exp_avg_sq"])
    pipeline.restart([g["fp32"] for g in shards])
    return discarded


def adopt_step_schedule_of_rank0(pipeline) -> None:
    """Adaptive accumulation: the ranks have run different numbers of engine steps (each steps after
    its own micro-batches), but a checkpoint holds one LR-scheduler state (DeepSpeed saves rank 0's and
    restores it on every rank). Give every rank data-parallel rank 0's engine step count and recorded
    AdamW settings, so that the settings commit t uses stay the same on every rank after the resume.
    Collective over the data-parallel group."""
    obj = [pipeline.engine_steps, pipeline._hyper_history]
    group = getattr(pipeline, "control_group", None) or pipeline.dp_group  # CPU (gloo) when there is one
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(obj, src=src, group=group)
    pipeline.engine_steps, pipeline._hyper_history = int(obj[0]), dict(obj[1])


def _result_to_plain(res: RoundResult) -> Dict[str, Any]:
    """The RoundResult as plain values: tensors as CPU copies, the job kind as its value."""
    res.wait_summary()
    return {
        "job": res.job.value,
        "commit_index": res.commit_index,
        "grad_norm": _cpu(res.grad_norm),
        "summary": _cpu(res.summary),
        "traffic": None if res.traffic is None else [res.traffic.sent, res.traffic.received],
        "loss_scale": None if res.loss_scale is None else _cpu(res.loss_scale),
    }


def _result_from_plain(saved: Dict[str, Any], dev: torch.device) -> RoundResult:
    expected = {"job", "commit_index", "grad_norm", "summary"}
    # optional: "traffic" (checkpoints before the byte counts), "loss_scale" (fp16 only)
    if set(saved) - {"traffic", "loss_scale"} != expected:
        raise SnapshotMismatchError(
            f"the checkpoint's job in flight has fields {sorted(saved)}, this acco_ds expects {sorted(expected)}: "
            "the checkpoint was saved by another acco_ds version."
        )
    traffic = saved.get("traffic")
    return RoundResult(
        Job(saved["job"]),
        int(saved["commit_index"]),
        saved["grad_norm"].to(dev),
        saved["summary"],
        traffic=None if traffic is None else Traffic(int(traffic[0]), int(traffic[1])),
        loss_scale=None if saved.get("loss_scale") is None else saved["loss_scale"].to(dev),
    )


def _finished_ticket(pipeline, saved: Dict[str, Any]):
    """(Ticket, RoundEnd) of a job that has already run: ``executor.wait`` returns its result at once."""
    dev = pipeline.device
    result = _result_from_plain(saved["result"], dev)
    p = saved["plan"]
    plan = RoundEnd(Job(p["job"]), p["wait_previous"], p["wait_now"], p["commit_index"])
    ticket = Ticket(saved["name"] + " (restored)")
    ticket.result = result
    if dev.type == "cuda":
        ticket.cuda_done = torch.cuda.Event()
        ticket.cuda_done.record(torch.cuda.current_stream(dev))
    ticket.finished.set()
    return ticket, plan
