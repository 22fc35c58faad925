"""ACCO checkpoints in DeepSpeed's ZeRO-1 layout, driven by ``engine.save_checkpoint`` /
``engine.load_checkpoint``.

Files (DeepSpeed writes them; nothing here touches the file system): ``mp_rank_00_model_states.pt``
(module weights, ``param_shapes`` from ``optimizer.round_robin_bit16_groups``) and one
``[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` per data-parallel rank holding
``{"optimizer_state_dict": state_dict(opt), ...}``.

``state_dict`` has DeepSpeed ZeRO-1's keys, so DeepSpeed's tools read it:

- ``single_partition_of_fp32_groups``: this rank's slice of each group's fp32 master (the
  committed parameters), padding stripped. The ranks' slices, concatenated in rank order, are
  exactly the group's parameters in ``param_shapes`` order: ``zero_to_fp32.py`` rebuilds the fp32
  weights from them.
- ``base_optimizer_state``: ``{"state": {group: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups"}``
  (the moments are this rank's full, padded shards, as DeepSpeed's non-elastic ZeRO-1 saves them;
  ``param_groups`` carries lr/betas/eps/weight_decay and the LR scheduler's keys).
- ``loss_scaler`` (DeepSpeed's scaler object: ``checkpoint.loss_scale``), ``dynamic_loss_scale``, ``overflow``, ``clip_grad``,
  ``zero_stage`` (1), ``group_paddings`` (padding of this rank's slice), ``param_alignment_paddings``
  (0 for every parameter: they are contiguous), ``partition_count``, ``ds_version``,
  ``param_slice_mappings`` (name -> (numel, start) of the parameter's fragment in this rank's slice).

plus ``"acco"``: everything else exact resume needs (``acco_ds.core.snapshot``: the stage of the
pipeline, the finished job in flight and the slot it gathered into, both parameter buffers'
shards, the gradients of the round being accumulated, the kept g~ and its count, counters, the
hyper-parameter history, stats) and the optimizer's count of micro-batches since its last step.

Loads: the same world size, mode, accumulation and gradient_accumulation_steps resume exactly, the
in-flight state too (:func:`load_state_dict`). Any other ACCO checkpoint, DeepSpeed's own ZeRO-1/2
checkpoints and universal checkpoints resume from their committed state, re-sharded to this run by
parameter name (:func:`load_committed`, ``reshard``; ``checkpoint.guard`` / ``checkpoint.preflight`` choose the route
and check the files first).

Events: ``checkpoint_event_prologue`` (the engine calls it first when saving and loading) drains
the pipeline (``snapshot.drain``: adaptive ranks agree on the round count, then the job in flight
is waited for, not swapped in); ``checkpoint_event_epilogue`` has nothing to undo.

Module weights: in acco mode the model computes at the estimate theta~ half of the time, and in
dpu at the previous commit. :func:`install_state_dict_hook` makes ``module.state_dict()`` return
the committed parameters theta (the values ``safe_get_full_fp32_param`` returns, in the
parameters' dtype) instead, so the module weights DeepSpeed saves in ``mp_rank_00_model_states.pt``,
and the ``model.safetensors`` the HF Trainer and accelerate write, are theta. The hook never
communicates, so ``state_dict()`` may be called on one rank only: in fixed accumulation it waits for
this rank's job in flight (every rank launches the same jobs at the same micro-batch, so that job
completes without this rank); in adaptive accumulation a peer may not have launched that job yet and
could be waiting for this rank elsewhere, so the hook does not wait: while the job is still running,
``state_dict()`` holds the parameters the model computes at (a warning says so once). DeepSpeed's
save drains first (``checkpoint_event_prologue``), so its files hold theta in every mode.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Dict, List

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.checkpoint.constants import (
    BASE_OPTIMIZER_STATE,
    CLIP_GRAD,
    DS_VERSION,
    GROUP_PADDINGS,
    LOSS_SCALER,
    PARAM_ALIGNMENT_PADDINGS,
    PARAM_SLICE_MAPPINGS,
    PARTITION_COUNT,
    SINGLE_PARTITION_OF_FP32_GROUPS,
    ZERO_STAGE,
)
from deepspeed.utils.tensor_fragment import fragment_address

from acco_ds.core import snapshot
from acco_ds.deepspeed.checkpoint import loss_scale, reshard
from acco_ds.deepspeed.checkpoint.files import ACCOCheckpointError

logger = logging.getLogger("acco_ds")

ACCO_KEY = "acco"
_STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")
__all__ = ["ACCOCheckpointError", "state_dict", "load_state_dict", "load_committed", "restart_at_master"]


# -- events ------------------------------------------------------------------------------------
def checkpoint_event_prologue(opt) -> None:
    """Drain the pipeline (collective): its state is final and readable, the schedule unchanged."""
    snapshot.drain(opt.pipeline)


def checkpoint_event_epilogue(opt) -> None:
    """Nothing to undo: draining does not change what the next round computes at."""


# -- module weights ----------------------------------------------------------------------------
def install_state_dict_hook(opt, module: torch.nn.Module):
    """Make ``module.state_dict()`` hold the committed parameters theta for every trainable
    parameter ACCO owns (all names of a tied parameter). Returns the hook handle."""
    where = {}
    for gi, b in enumerate(opt.pipeline.groups):
        for p, off, numel in zip(b.params, b.layout.offsets, b.layout.numels):
            where[id(p)] = (gi, off, numel, p.shape)
    names = {
        name: where[id(p)] for name, p in module.named_parameters(remove_duplicate=False) if id(p) in where
    }

    warned = []

    def hook(mod, state, prefix, local_metadata):
        pipeline = opt.pipeline
        if pipeline.in_flight is None:
            return
        if not pipeline.adaptive:
            pipeline.sync_in_flight()
        elif not pipeline.executor.done(pipeline.in_flight[0]):
            if not warned:
                warned.append(True)
                logger.warning(
                    "acco_ds: module.state_dict() during adaptive accumulation with a round in flight holds the "
                    "parameters the model computes at (acco: possibly the estimate), not the committed ones. "
                    "engine.save_checkpoint (+ zero_to_fp32.py) or engine.optimizer.finish() give the committed "
                    "weights."
                )
            return
        flats = snapshot.committed_flats(pipeline)
        if all(flat is b.model_flat for flat, b in zip(flats, pipeline.groups)):
            return
        for name, (gi, off, numel, shape) in names.items():
            key = prefix + name
            if key in state:
                state[key] = flats[gi][off : off + numel].view(shape).detach()

    return module.register_state_dict_post_hook(hook)


# -- save --------------------------------------------------------------------------------------
def _param_names(opt) -> List[List[str]]:
    engine = opt.engine
    names = getattr(engine, "param_names", None) or {}
    return [
        [names.get(p, f"group{gi}.param{pi}") for pi, p in enumerate(group)]
        for gi, group in enumerate(opt.bit16_groups)
    ]


def _slice_mappings(opt) -> List[Dict[str, fragment_address]]:
    out = []
    for b, names in zip(opt.pipeline.groups, _param_names(opt)):
        shard = b.layout.shard_range(b.rank)
        group = OrderedDict()
        for name, off, numel in zip(names, b.layout.offsets, b.layout.numels):
            lo, hi = max(off, shard.start), min(off + numel, shard.stop)
            if hi > lo:
                group[name] = fragment_address(numel=hi - lo, start=lo - shard.start)
        out.append(group)
    return out


def state_dict(opt) -> Dict[str, Any]:
    """This rank's optimizer state (see the module docstring). Collective (drains the pipeline);
    the tensors are CPU copies."""
    pipeline = opt.pipeline
    snap = snapshot.capture(pipeline)
    groups = snap.pop("groups")
    applied = pipeline.state_step + snapshot.pending_applied_commits(pipeline)
    fp32, paddings, base_state = [], [], {}
    for i, (b, g) in enumerate(zip(pipeline.groups, groups)):
        real = b.layout.real_shard_range(b.rank)
        fp32.append(g["master"][: len(real)].clone())
        paddings.append(b.layout.shard_numel - len(real))
        base_state[i] = {
            "step": torch.tensor(float(applied)),
            "exp_avg": g["exp_avg"],
            "exp_avg_sq": g["exp_avg_sq"],
        }
    snap["groups"] = [{k: v for k, v in g.items() if k not in _STATE_KEYS} for g in groups]
    snap["optimizer"] = {"micro_batches_since_step": opt._micro_batches_since_step}
    return {
        # DeepSpeed's own scaler object (a static scale of 1 with bf16/fp32), as ZeRO-1 saves it: ZeRO-1 takes it
        # back as it is (its legacy load), and fails on None
        LOSS_SCALER: loss_scale.to_deepspeed(pipeline.scaler),
        "dynamic_loss_scale": pipeline.scaler is not None and pipeline.scaler.spec.dynamic,
        "overflow": bool(opt.overflow),
        CLIP_GRAD: pipeline.clip,
        BASE_OPTIMIZER_STATE: {
            "state": base_state,
            "param_groups": opt.optimizer.state_dict()["param_groups"],
        },
        SINGLE_PARTITION_OF_FP32_GROUPS: fp32,
        ZERO_STAGE: 1,
        GROUP_PADDINGS: paddings,
        PARAM_ALIGNMENT_PADDINGS: [[0] * len(group) for group in opt.bit16_groups],
        PARTITION_COUNT: [pipeline.world_size] * len(pipeline.groups),
        DS_VERSION: deepspeed.__version__,
        PARAM_SLICE_MAPPINGS: _slice_mappings(opt),
        ACCO_KEY: snap,
    }


# -- load --------------------------------------------------------------------------------------
_ROUTE_ADVICE = (
    "engine.load_checkpoint(path) resumes it (re-sharded from the committed state); "
    "engine.load_checkpoint(path, load_optimizer_states=False) takes its weights only."
)


def _this_rank(opt, state_dict_list) -> Dict[str, Any]:
    if isinstance(state_dict_list, dict):
        return state_dict_list
    world = opt.pipeline.world_size
    rank = dist.get_rank(opt.dp_process_group)
    if len(state_dict_list) != world:
        raise ACCOCheckpointError(
            f"the checkpoint holds {len(state_dict_list)} optimizer partitions (data-parallel world size "
            f"{len(state_dict_list)}), this run has {world} ranks: the exact resume of the in-flight state needs "
            f"the same world size. {_ROUTE_ADVICE}"
        )
    sd = state_dict_list[rank]
    if sd is None:
        raise ACCOCheckpointError(f"the optimizer partition of rank {rank} is missing from the checkpoint.")
    return sd


def _padded(t: torch.Tensor, numel: int) -> torch.Tensor:
    if t.numel() == numel:
        return t
    out = torch.zeros(numel, dtype=t.dtype)
    out[: t.numel()].copy_(t.reshape(-1))
    return out


def exact_resume_possible(opt, snap: Dict[str, Any] | None) -> bool:
    """True when ``snap`` (this rank's "acco" entry of a checkpoint saved on this world size) can be restored
    bit for bit here: same format, mode, accumulation, gradient_accumulation_steps and group layout. Raises
    SnapshotMismatchError for a format this acco_ds cannot read."""
    if snap is None:
        return False
    try:
        snapshot.check_compatible(opt.pipeline, snap)
    except snapshot.SnapshotMismatchError:
        if snap.get("format_version") != snapshot.FORMAT_VERSION:
            raise
        return False
    return True


def load_state_dict(
    opt,
    state_dict_list,
    load_optimizer_states: bool = True,
    load_from_fp32_weights: bool = True,
    checkpoint_folder=None,
    **_ignored,
) -> None:
    """Restore what :func:`state_dict` saved (``state_dict_list``: DeepSpeed's list with one entry
    per rank, only this rank's filled, or this rank's dict), or, with ``checkpoint_folder``, a DeepSpeed
    universal checkpoint (``"checkpoint": {"load_universal": true}``; see :func:`load_committed`).
    Collective.

    The exact resume (the in-flight state too) needs the same world size, mode, accumulation and
    gradient_accumulation_steps; ``engine.load_checkpoint`` routes any other ACCO or ZeRO checkpoint to
    :func:`load_committed` before DeepSpeed gets here (``checkpoint.guard``), so a direct call with one raises.

    ``load_optimizer_states=False`` keeps the current moments and restarts the pipeline at the
    checkpoint's fp32 master weights. The fp32 master always comes from the checkpoint (ACCO ignores
    ``zero_optimization.load_from_fp32_weights=false``: rebuilding it from 16-bit weights could not
    resume exactly)."""
    if checkpoint_folder:
        load_committed(
            opt, open_universal(opt, checkpoint_folder, load_optimizer_states), load_optimizer_states
        )
        return
    sd = _this_rank(opt, state_dict_list)
    if ACCO_KEY not in sd:
        raise ACCOCheckpointError(
            f"this optimizer checkpoint was not saved by ACCO (no 'acco' entry). {_ROUTE_ADVICE}"
        )
    pipeline = opt.pipeline
    saved = sd[ACCO_KEY]
    snapshot.check_compatible(pipeline, saved)
    base = sd[BASE_OPTIMIZER_STATE]
    groups = []
    for i, (b, g) in enumerate(zip(pipeline.groups, saved["groups"])):
        master = _padded(sd[SINGLE_PARTITION_OF_FP32_GROUPS][i], b.layout.shard_numel)
        st = base["state"][i]
        groups.append({**g, "master": master, "exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"]})
    if not load_optimizer_states:
        restart_at_master(opt, [g["master"] for g in groups])
        return
    snapshot.restore(pipeline, {**saved, "groups": groups})
    if pipeline.adaptive:
        snapshot.adopt_step_schedule_of_rank0(pipeline)
    opt.optimizer.load_state_dict({"state": {}, "param_groups": base["param_groups"]})
    opt.overflow = bool(sd.get("overflow", False))
    opt._micro_batches_since_step = int(saved["optimizer"]["micro_batches_since_step"])
    norm = pipeline.last_grad_norm
    opt._global_grad_norm = None if norm is None else norm.reshape(())


# -- the committed state, re-sharded ------------------------------------------------------------
def param_names(opt) -> List[List[str]]:
    """The names (``engine.param_names``) of ACCO's parameters, per group in buffer order."""
    known = getattr(opt.engine, "param_names", None) or {}
    if any(p not in known for group in opt.bit16_groups for p in group):
        raise ACCOCheckpointError(
            "re-sharding a checkpoint needs the parameters' names (engine.param_names): load it through "
            "engine.load_checkpoint."
        )
    return _param_names(opt)


def trainable_shapes(opt) -> Dict[str, tuple]:
    """name -> shape of every parameter ACCO trains."""
    out = {}
    for names, b in zip(param_names(opt), opt.pipeline.groups):
        for name, shape in zip(names, b.layout.shapes):
            out[name] = tuple(shape)
    return out


def _untrained_entries(opt) -> Dict[str, torch.Tensor]:
    """The module's frozen parameters and buffers (not trained by ACCO), by name."""
    module = opt.engine.module
    trained = {id(p) for group in opt.bit16_groups for p in group}
    out = {n: p for n, p in module.named_parameters(remove_duplicate=False) if id(p) not in trained}
    out.update(dict(module.named_buffers()))
    return out


def open_universal(opt, folder: str, load_optimizer_states: bool) -> reshard.UniversalFolder:
    """The universal checkpoint ``folder`` for this run (checks its files: see reshard.UniversalFolder)."""
    if getattr(opt.pipeline, "tp_size", 1) > 1:
        raise ACCOCheckpointError(
            f"{folder}: ACCO loads universal checkpoints without tensor parallelism only (this run has a "
            f"tensor-parallel size of {opt.pipeline.tp_size}). Load a ZeRO checkpoint saved with the same "
            "tensor-parallel size (any data-parallel size)."
        )
    names = [n for group in param_names(opt) for n in group]
    return reshard.UniversalFolder(folder, names, load_optimizer_states, untrained=_untrained_entries(opt))


@torch.no_grad()
def _restore_untrained(opt, source: reshard.UniversalFolder) -> List[str]:
    """Frozen parameters and buffers from a universal checkpoint, where it holds them with this model's
    shape (DeepSpeed's own universal load leaves them as the model was built); returns their names."""
    done = []
    for name, t in _untrained_entries(opt).items():
        value = source.untrained_value(name)
        if value is not None and tuple(value.shape) == tuple(t.shape):
            t.data.copy_(value.to(dtype=t.dtype, device=t.device))
            done.append(name)
    return done


def load_committed(opt, source, load_optimizer_states: bool = True) -> None:
    """Resume from the committed state of ``source`` (``reshard.ZeroPartitions`` of an ACCO or ZeRO
    checkpoint saved on any world size, or ``reshard.UniversalFolder``), re-sharded to this run by
    parameter name. Collective.

    The fp32 master, both moments and the step count are taken exactly; the run restarts from them
    with a new prologue (``snapshot.resume_from_committed``, docs/CHECKPOINTS.md gives the equations):
    the in-flight work of an ACCO checkpoint (the round in flight, the kept g~, pending gradients) is
    dropped and counted as discarded. From a universal checkpoint the frozen parameters and buffers it
    holds are restored too (DeepSpeed does not load the module file of a universal checkpoint). The saved param groups' settings (lr, betas, eps, weight_decay, the
    LR scheduler's keys) replace this run's when the group counts match, as DeepSpeed's universal load
    does. ``load_optimizer_states=False`` takes the fp32 master only and keeps the current moments."""
    pipeline = opt.pipeline
    names = param_names(opt)
    exact = isinstance(source, reshard.ZeroPartitions)
    reshard.check_parameters(trainable_shapes(opt), source.shapes(), source.where, exact=exact)
    keys = ("fp32",) + (reshard.MOMENTS if load_optimizer_states else ())
    shards = [reshard.shard_of(source, b.layout, n, b.rank, keys) for b, n in zip(pipeline.groups, names)]
    if isinstance(source, reshard.UniversalFolder):
        _restore_untrained(opt, source)
    if not load_optimizer_states:
        restart_at_master(opt, [s["fp32"] for s in shards])
        return
    step = reshard.common_step(source, [n for group in names for n in group])
    saved = source.acco_snapshots()
    # another optimizer's files (a ZeRO-1 fp16 run's scaler goes on), or a universal checkpoint
    if saved is None:
        loss_scale.load_from_deepspeed(pipeline.scaler, source.loss_scaler())
    discarded = snapshot.resume_from_committed(pipeline, shards, step, saved)
    groups = source.param_groups()
    if groups is not None and len(groups) == len(opt.optimizer.param_groups):
        for ours, theirs in zip(opt.optimizer.param_groups, groups):
            ours.update({k: v for k, v in theirs.items() if k != "params"})
    opt.overflow = False
    opt._micro_batches_since_step = 0
    norm = pipeline.last_grad_norm
    opt._global_grad_norm = None if norm is None else norm.reshape(())
    if pipeline.rank == 0:
        saved_world = len(saved) if saved is not None else getattr(source, "world_size", None)
        logger.info(
            "acco_ds: resumed from the committed state of %s (saved on %s ranks, now %d; step %d); a new prologue "
            "round starts, %d in-flight micro-batch(es) discarded",
            source.where,
            saved_world if saved_world is not None else "?",
            pipeline.world_size,
            step,
            discarded,
        )


def update_lp_params(opt) -> None:
    """DeepSpeed calls it after a universal load to copy the master into the 16-bit weights:
    :func:`load_committed` has already gathered the master into the model's parameters."""


# -- weights only ------------------------------------------------------------------------------
def restart_at_master(opt, masters=None) -> None:
    """Restart the pipeline (a new prologue, nothing in flight, no pending gradients) at the given fp32
    master shards, or, with ``masters=None``, at the weights the model's parameters hold now (DeepSpeed's
    ``_restore_from_bit16_weights``: a module-only load wrote them there). Adam moments and step counts
    are kept. Collective."""
    pipeline = opt.pipeline
    if pipeline.in_flight is not None:
        logger.info("acco_ds: restarting the pipeline at new weights; the round in flight is dropped")
    pipeline.restart(masters)
    opt._micro_batches_since_step = 0
