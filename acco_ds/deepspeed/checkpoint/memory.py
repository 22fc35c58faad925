"""Resume an ACCO engine from the committed state its ranks kept in node memory (``optimizer.params.memory_state``),
without a disk checkpoint: the DeepSpeed side of ``acco_ds.core.commit_records``.

- :func:`attach` (the optimizer's construction): creates this rank's commit record file and hands it to the
  pipeline, whose round jobs then record every commit on the communication thread. A first start (the launcher's
  restart count 0) removes this rank's records of an earlier run with the same run id: they are never resumed.
- :func:`record_step` (the training thread, once an optimizer step is done; acco-train calls it every step):
  records the step's counters with the engine's (global steps and samples, skipped steps, the LR scheduler's
  state, the optimizer's param groups) and the caller's client state.
- :func:`newest_step` then :func:`resume` (collective, every rank of the restarted run): the newest step every
  saving rank's records hold, and the load of that step at this run's world size. The records become what a
  checkpoint saved at that step holds of the committed state (DeepSpeed ZeRO-1's per-rank layout plus ACCO's
  counters), read through ``reshard.ZeroPartitions`` and ``zero_state.load_committed``: the same re-sharded load
  as a disk checkpoint's at another world size, bit for bit in weights, moments, loss scaler and LR schedule.

What is not recorded: frozen parameters and module buffers (a restarted process builds them as the first start
did), the data loader's position (the caller's client state carries it) and, in acco, a PEEK in flight at the step
(its micro-batches are counted as discarded on disk; here they are not counted). The records of every saving rank
must be readable where each new rank runs (one node, or a shared memory folder): a rank whose records are missing
makes :func:`newest_step` return 0, with a warning naming the missing ranks, and the caller falls back to disk.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from deepspeed.checkpoint.constants import (
    BASE_OPTIMIZER_STATE,
    OPTIMIZER_STATE_DICT,
    PARTITION_COUNT,
    SINGLE_PARTITION_OF_FP32_GROUPS,
)

from acco_ds.core import commit_records
from acco_ds.core.commit_records import KEYS, MemoryState
from acco_ds.deepspeed.checkpoint import reshard, zero_state
from acco_ds.deepspeed.checkpoint.files import ACCOCheckpointError

logger = logging.getLogger("acco_ds")

RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"


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
    names = zero_state.param_names(opt)
    static = {
        "param_shapes": [
            {n: tuple(p.shape) for n, p in zip(group_names, params)}
            for group_names, params in zip(names, opt.bit16_groups)
        ],
        "real_shard": [len(b.layout.real_shard_range(b.rank)) for b in pipeline.groups],
    }
    pipeline.memory_state = MemoryState(pipeline, folder, generation, static)


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


@dataclass(frozen=True)
class Found:
    """The committed state a restarted run resumes from: step ``step`` of the records the ``world`` ranks of
    process generation ``generation`` left in ``folder``."""

    folder: Path
    generation: int
    step: int
    world: int


def _find(folder: Path, current: int) -> tuple[Found | None, str]:
    """The newest generation before ``current`` whose every rank holds a common step, and its newest such step."""
    why = f"no records in {folder} from an earlier start"
    for gen in commit_records.generations(folder):
        if gen >= current:
            continue
        ranks = commit_records.ranks_of(folder, gen)
        if not ranks:
            continue
        world = int(commit_records.static_of(folder, ranks[0], gen)["world_size"])
        missing = [r for r in range(world) if r not in ranks]
        if missing:
            why = f"{folder} lacks the records of rank(s) {missing} of the {world} of start {gen}"
            continue
        common = None
        for r in range(world):
            steps = set(commit_records.pairs(folder, r, gen, with_tensors=False))
            common = steps if common is None else common & steps
        if common:
            return Found(folder, gen, max(common), world), ""
        why = f"the {world} ranks' records of start {gen} in {folder} share no step"
    return None, why


def newest_step(engine) -> Found | None:
    """What every rank of this run can resume from in node memory, agreed by all (collective): None when
    memory_state is off, on a first start, when there is nothing, or when the ranks do not all see the same records
    (a log line says why; the caller then loads from disk)."""
    opt = engine.optimizer
    cfg = getattr(opt, "cfg", None)
    if cfg is None or not cfg.memory_state.enabled:
        return None
    ms = cfg.memory_state
    found, why = _find(commit_records.run_folder(ms.dir, ms.resolved_run_id()), _generation())
    key = 0 if found is None else found.generation << 40 | found.step
    t = torch.tensor([key, -key], dtype=torch.int64)
    group = getattr(opt.pipeline, "control_group", None)
    if group is None and dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    lo, hi = int(t[0]), -int(t[1])
    if lo != hi:
        logger.warning(
            "acco_ds: rank %d: the ranks do not all see the same records in node memory%s; loading from disk",
            opt.pipeline.rank,
            f" ({why})" if why else "",
        )
        return None
    if found is None and opt.pipeline.rank == 0 and _generation() > 0:
        logger.warning("acco_ds: no committed state to resume from node memory: %s; loading from disk", why)
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


def resume(engine, found: Found) -> Dict[str, Any]:
    """Load ``found`` (from :func:`newest_step`) into ``engine``; returns the client state recorded with it.
    Collective."""
    opt = engine.optimizer
    files: List[str] = []
    states: List[dict] = []
    extra = None
    for r in range(found.world):
        step_rec, commit_rec = commit_records.pairs(found.folder, r, found.generation)[found.step]
        real_shard = commit_records.static_of(found.folder, r, found.generation)["real_shard"]
        files.append(
            f"{found.folder}/rank{r}.g{found.generation} (step {found.step}, commit {commit_rec.key})"
        )
        states.append(_as_checkpoint(step_rec, commit_rec, real_shard, found.world))
        extra = extra or step_rec.meta["extra"]
    shapes = commit_records.static_of(found.folder, 0, found.generation)["param_shapes"]
    where = f"node memory ({found.folder}, start {found.generation}, step {found.step})"
    source = reshard.ZeroPartitions(files, states, shapes, need_moments=True, where=where)
    zero_state.load_committed(opt, source)
    if engine.lr_scheduler is not None and extra["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(extra["lr_scheduler"])
    engine.global_steps = extra["global_steps"]
    engine.global_samples = extra["global_samples"]
    engine.skipped_steps = extra["skipped_steps"]
    return dict(extra["client"])
