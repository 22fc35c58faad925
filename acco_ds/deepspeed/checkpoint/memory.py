"""Resume an ACCO engine from the committed state its ranks kept in node memory (``optimizer.params.memory_state``),
without a disk checkpoint: the DeepSpeed side of ``acco_ds.core.commit_records``.

- :func:`attach` (the optimizer's construction): creates this rank's record files and hands them to the pipeline,
  whose round jobs then record every commit on the communication thread; with ``peer_copy`` and ranks on more than
  one node (torchrun's ``GROUP_RANK``, the DeepSpeed launcher's ``CROSS_RANK``, else the host name) it also starts
  the copies to a rank on another node (``core.peer_copies``; a gloo group of their own). A first start (the
  launcher's restart count 0) removes this rank's records, and the copies it held, of an earlier run with the same
  run id: they are never resumed.
- :func:`record_step` (the training thread, once an optimizer step is done; acco-train calls it every step):
  records the step's counters with the engine's (global steps and samples, skipped steps, the LR scheduler's
  state, the optimizer's param groups) and the caller's client state, and hands the step to the copies. A loop that
  never calls it is told so (:func:`after_step`): its commits are recorded, but a restart finds no step to resume.
- :func:`newest_step` then :func:`resume` (collective, every rank of the restarted run): every rank lists what its
  node holds (its ranks' own records and the copies it keeps for other nodes' ranks), the ranks agree on the newest
  step every saving rank is held at somewhere, and each saving rank's records are sent by one rank holding them to
  all. They become what a checkpoint saved at that step holds of the committed state (DeepSpeed ZeRO-1's per-rank
  layout plus ACCO's counters), read through ``reshard.ZeroPartitions`` and ``zero_state.load_committed``: the same
  re-sharded load as a disk checkpoint's at another world size, bit for bit in weights, moments, loss scaler and
  LR schedule. A saving rank held nowhere (its node and its copy's holder both lost) makes :func:`newest_step`
  return None with an error naming it; the caller then loads the newest disk checkpoint.

What is not recorded: frozen parameters and module buffers (a restarted process builds them as the first start
did), the data loader's position (the caller's client state carries it) and, in acco, a PEEK in flight at the step
(its micro-batches are counted as discarded on disk; here they are not counted).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
from deepspeed.checkpoint.constants import (
    BASE_OPTIMIZER_STATE,
    OPTIMIZER_STATE_DICT,
    PARTITION_COUNT,
    SINGLE_PARTITION_OF_FP32_GROUPS,
)

from acco_ds.core import commit_records, peer_copies
from acco_ds.core.comm import new_subgroup
from acco_ds.core.commit_records import KEYS, MemoryState
from acco_ds.deepspeed.checkpoint import reshard, zero_state
from acco_ds.deepspeed.checkpoint.files import ACCOCheckpointError

logger = logging.getLogger("acco_ds")

RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
UNRECORDED_STEPS = 5
"""The optimizer step at which a run with memory_state on and no step recorded yet is told so (once)."""


def _generation() -> int:
    try:
        return int(os.environ.get(RESTART_COUNT, "0"))
    except ValueError:
        return 0


def attach(opt, cfg) -> None:
    """Give ``opt.pipeline`` its :class:`~acco_ds.core.commit_records.MemoryState` when ``cfg.memory_state`` is
    enabled (see the module docstring)."""
    ms = cfg.memory_state
    if not ms.enabled:
        return
    pipeline = opt.pipeline
    if getattr(pipeline, "tp_size", 1) > 1:
        raise ACCOCheckpointError(
            "optimizer.params.memory_state.enabled=true: keeps the committed state of runs without tensor "
            f"parallelism only (this run has a tensor-parallel size of {pipeline.tp_size}). Allowed: false here."
        )
    folder = commit_records.run_folder(ms.dir, ms.resolved_run_id())
    generation = _generation()
    if generation == 0:
        commit_records.clear(folder, [pipeline.rank])
        commit_records.clear(folder / peer_copies.HELD.format(pipeline.rank), range(pipeline.world_size))
    names = zero_state.param_names(opt)
    static = {
        "param_shapes": [
            {n: tuple(p.shape) for n, p in zip(group_names, params)}
            for group_names, params in zip(names, opt.bit16_groups)
        ]
    }
    state = MemoryState(pipeline, folder, generation, static)
    pipeline.memory_state = state
    if ms.peer_copy:
        keys = [None] * pipeline.world_size
        dist.all_gather_object(keys, node_key(), group=pipeline.control_group)
        holders = peer_copies.holders(keys)
        if holders:
            group = new_subgroup(pipeline.dp_group, "gloo", cfg.comm_timeout_s)
            wards = [r for r, h in holders.items() if h == pipeline.rank]
            state.copy_to_peer(group, holders[pipeline.rank], wards, cfg.comm_timeout_s, ms.peer_copy_form)
        elif pipeline.rank == 0:
            logger.info(
                "acco_ds: memory_state: every rank is on one node, so the committed state is kept in this node's "
                "memory only (no copy on another node)"
            )


def node_key() -> str:
    """This process's node: torchrun's ``GROUP_RANK``, else the DeepSpeed launcher's ``CROSS_RANK``, else the host."""
    for var in ("GROUP_RANK", "CROSS_RANK"):
        if os.environ.get(var):
            return f"{var}={os.environ[var]}"
    return socket.gethostname()


def record_step(engine, step: int, client: Dict[str, Any] | None = None) -> None:
    """Record optimizer step ``step`` of ``engine`` (a no-op without ``memory_state``); ``client``: what the
    caller needs back at a resume (picklable)."""
    opt = engine.optimizer
    ms = getattr(getattr(opt, "pipeline", None), "memory_state", None)
    if ms is None:
        return
    sched = engine.lr_scheduler
    extra = {
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "skipped_steps": engine.skipped_steps,
        "lr_scheduler": None if sched is None else sched.state_dict(),
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.optimizer.param_groups],
        "client": dict(client or {}),
    }
    ms.record_step(step, extra)


def after_step(opt) -> None:
    """Called at every engine optimizer step, after it: at the ``UNRECORDED_STEPS``-th, when memory_state is on and
    no step has been recorded (:func:`record_step` never called), keep a notice in ``opt.memory_notice`` and log it on
    global rank 0. Nothing else changes: the commits are still recorded (and copied once steps are)."""
    ms = getattr(opt.pipeline, "memory_state", None)
    if ms is None or opt.steps_taken != UNRECORDED_STEPS or ms.steps_recorded:
        return
    opt.memory_notice = (
        f"acco_ds: optimizer.params.memory_state is on, but none of the {UNRECORDED_STEPS} optimizer steps so far was "
        "recorded: each commit's state is kept, yet a restart has no step to resume at and starts over. Call "
        "acco_ds.deepspeed.checkpoint.memory.record_step(engine, step, client_state) after each engine.step() at a "
        "step's end (acco-train does; docs/REFERENCE.md, memory_state.enabled), or set memory_state.enabled to false."
    )
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.warning(opt.memory_notice)


@dataclass(frozen=True)
class Found:
    """The committed state a restarted run resumes from: step ``step`` of the records the ``world`` ranks of
    process generation ``generation`` left; ``providers[r]``: the rank of this run that holds saving rank r's
    records (its own node's, or the copy its holder kept)."""

    generation: int
    step: int
    world: int
    providers: Tuple[int, ...]


def _folders(folder: Path) -> List[Path]:
    """Where this node keeps records: its ranks' own, then the copies held for other nodes' ranks."""
    return [folder] + sorted(p for p in folder.glob(peer_copies.HELD.format("*")) if p.is_dir())


def _inventory(folder: Path, current: int) -> Dict[Tuple[int, int], Tuple[Path, int, Tuple[int, ...]]]:
    """``{(generation, saving rank): (folder, its world size, its resumable steps)}`` of the records this node
    holds from generations before ``current`` (its own first, where both are here)."""
    out = {}
    for where in _folders(folder):
        for gen in commit_records.generations(where):
            if gen >= current:
                continue
            for r in commit_records.ranks_of(where, gen):
                if (gen, r) in out:
                    continue
                world = int(commit_records.static_of(where, r, gen)["world_size"])
                steps = tuple(sorted(commit_records.pairs(where, r, gen, with_tensors=False)))
                if steps:
                    out[(gen, r)] = (where, world, steps)
    return out


def _choose(everyone: List[dict]) -> Tuple[Found | None, str]:
    """From every rank's inventory summary (``{(gen, r): (world, steps)}``, in rank order): the newest generation
    whose every saving rank is held somewhere with a common step, its newest such step and a provider per rank."""
    gens = sorted({g for inv in everyone for g, _ in inv}, reverse=True)
    why = "no records from an earlier start"
    for gen in gens:
        worlds = {w for inv in everyone for (g, _), (w, _) in inv.items() if g == gen}
        world = max(worlds)
        held = {
            r: [(p, set(inv[(gen, r)][1])) for p, inv in enumerate(everyone) if (gen, r) in inv]
            for r in range(world)
        }
        lost = [r for r, h in held.items() if not h]
        if lost:
            return None, (
                f"the committed state of saving rank(s) {lost} of start {gen} (world size {world}) is lost: neither "
                "their node nor the node holding their copy is in this run"
            )
        common = None
        for h in held.values():
            steps = set().union(*(s for _, s in h))
            common = steps if common is None else common & steps
        if not common:
            why = f"the {world} ranks' records of start {gen} share no step"
            continue
        step = max(common)
        providers = tuple(min(p for p, s in held[r] if step in s) for r in range(world))
        return Found(gen, step, world, providers), ""
    return None, why


def newest_step(engine) -> Found | None:
    """What this run can resume from in node memory, agreed by all its ranks (collective): None when memory_state
    is off, on a first start, or when there is nothing complete to resume from; then a logged line says why (an
    error when a saving rank's state is lost with its node and its copy) and the caller loads from disk."""
    opt = engine.optimizer
    cfg = getattr(opt, "cfg", None)
    if cfg is None or not cfg.memory_state.enabled:
        return None
    ms, pipeline = cfg.memory_state, opt.pipeline
    inventory = _inventory(commit_records.run_folder(ms.dir, ms.resolved_run_id()), _generation())
    summary = {k: (w, steps) for k, (_, w, steps) in inventory.items()}
    everyone = [None] * pipeline.world_size
    dist.all_gather_object(everyone, summary, group=pipeline.control_group)
    found, why = _choose(everyone)
    if found is None and pipeline.rank == 0 and _generation() > 0:
        log = logger.error if "is lost" in why else logger.warning
        log(
            "acco_ds: no committed state to resume from node memory: %s; loading the newest disk checkpoint",
            why,
        )
    return found


def _as_checkpoint(step_rec, commit_rec, real_shard: List[int], world: int) -> Dict[str, Any]:
    """One saving rank's records in the per-rank layout of a ZeRO-1 checkpoint with ACCO's counters;
    ``real_shard[g]``: the rank's elements of group g without the padding."""
    info = commit_rec.meta
    n_groups = len(real_shard)
    tensors = commit_rec.tensors
    fp32, state = [], {}
    for g in range(n_groups):
        master, exp_avg, exp_avg_sq = tensors[g * len(KEYS) : (g + 1) * len(KEYS)]
        fp32.append(master[: real_shard[g]])
        state[g] = {
            "step": torch.tensor(float(info["applied"])),
            "exp_avg": exp_avg,
            "exp_avg_sq": exp_avg_sq,
        }
    acco = dict(step_rec.meta["counters"])
    in_flight = step_rec.meta["in_flight_commit"]
    acco["in_flight"] = {"result": info["result"]} if in_flight is not None else None
    return {
        OPTIMIZER_STATE_DICT: {
            SINGLE_PARTITION_OF_FP32_GROUPS: fp32,
            BASE_OPTIMIZER_STATE: {"state": state, "param_groups": step_rec.meta["extra"]["param_groups"]},
            PARTITION_COUNT: [world] * n_groups,
            "acco": acco,
        }
    }


def _provide(folder: Path, found: Found, r: int) -> dict:
    """Saving rank r's records at ``found`` from this node, in a checkpoint's per-rank layout, with their static."""
    where, _, _ = _inventory(folder, _generation())[(found.generation, r)]
    step_rec, commit_rec = commit_records.pairs(where, r, found.generation)[found.step]
    static = commit_records.static_of(where, r, found.generation)
    return {
        "state": _as_checkpoint(step_rec, commit_rec, static["real_shard"], found.world),
        "extra": step_rec.meta["extra"],
        "param_shapes": static["param_shapes"],
        "file": f"{where}/rank{r}.g{found.generation} (step {found.step}, commit {commit_rec.key})",
    }


def resume(engine, found: Found) -> Dict[str, Any]:
    """Load ``found`` (from :func:`newest_step`) into ``engine``: each saving rank's records are sent by their
    provider to every rank (over the control group), then loaded as a disk checkpoint saved on ``found.world``
    ranks would be. Returns the client state recorded with the step. Collective."""
    opt = engine.optimizer
    pipeline = opt.pipeline
    ms = opt.cfg.memory_state
    folder = commit_records.run_folder(ms.dir, ms.resolved_run_id())
    group = pipeline.control_group
    parts = []
    for r, provider in enumerate(found.providers):
        obj = [_provide(folder, found, r) if provider == pipeline.rank else None]
        src = provider if group is None else dist.get_global_rank(group, provider)
        dist.broadcast_object_list(obj, src=src, group=group)
        parts.append(obj[0])
    where = f"node memory (start {found.generation}, step {found.step}, {found.world} ranks)"
    source = reshard.ZeroPartitions(
        [p["file"] for p in parts], [p["state"] for p in parts], parts[0]["param_shapes"], need_moments=True,
        where=where,
    )  # fmt: skip
    zero_state.load_committed(opt, source)
    extra = parts[0]["extra"]
    if engine.lr_scheduler is not None and extra["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(extra["lr_scheduler"])
    engine.global_steps = extra["global_steps"]
    engine.global_samples = extra["global_samples"]
    engine.skipped_steps = extra["skipped_steps"]
    return dict(extra["client"])
