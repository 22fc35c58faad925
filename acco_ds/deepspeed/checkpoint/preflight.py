"""What ``engine.load_checkpoint`` will read, checked before DeepSpeed changes anything, and how it loads.

:func:`plan_load` reads the tag's files without changing the run (memory-mapped, see ``checkpoint.files``) and
returns the route of the load, or raises ACCOCheckpointError naming the file and what is wrong: a missing
or truncated file, a checkpoint of another model (parameter names or shapes), an optimizer without Adam
moments, partitions of different saves. Routes:

- ``exact``: an ACCO checkpoint saved on this world size with this mode, accumulation and
  gradient_accumulation_steps: DeepSpeed's own path, bit-exact resume of the in-flight state
  (``zero_state.load_state_dict``).
- ``committed``: any other ZeRO-1/2 checkpoint (ACCO's on another world size or with other settings,
  DeepSpeed's own ZeRO-1/2 AdamW): the committed state is re-sharded from every rank's file
  (``zero_state.load_committed``); ``plan.source`` holds the opened files.
- ``universal``: ``"checkpoint": {"load_universal": true}``: DeepSpeed hands the folder to
  ``zero_state.load_state_dict``, which re-shards it the same way.
- ``weights``: ``load_optimizer_states=False`` or ``load_module_only=True``: the module weights only.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Any, Dict

import torch
from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, PARAM_SHAPES

from acco_ds.deepspeed.checkpoint import reshard, zero_state
from acco_ds.deepspeed.checkpoint.files import ACCOCheckpointError, load_lazy


@dataclass
class LoadPlan:
    route: str  # "exact" | "committed" | "universal" | "weights"
    saved_world_size: int | None = None
    source: Any = None  # reshard.ZeroPartitions for "committed"


def _check_module(engine, module_sd: Dict[str, Any], where: str, strict: bool) -> None:
    """The module weights DeepSpeed will load must fit this model (torch refuses a shape mismatch even
    when not strict; strict also refuses missing and unexpected keys)."""
    ours = {k: tuple(v.shape) for k, v in engine.module.state_dict().items() if torch.is_tensor(v)}
    theirs = {k: tuple(v.shape) for k, v in module_sd.items() if torch.is_tensor(v)}
    if strict:
        reshard.check_parameters(ours, theirs, where, exact=True)
    else:
        reshard.check_parameters({k: s for k, s in ours.items() if k in theirs}, theirs, where, exact=False)


def _zero_file(engine, load_dir: str, tag: str, dp_rank: int) -> str:
    """This data-parallel rank's optimizer file, with the engine's 16-bit prefix or the other one (DeepSpeed
    loads either)."""
    names = [
        engine._get_rank_zero_ckpt_name(load_dir, tag, engine.checkpoint_mp_rank, dp_rank, bf16_mode)
        for bf16_mode in (engine.bfloat16_enabled(), not engine.bfloat16_enabled())
    ]
    found = [n for n in names if os.path.isfile(n)]
    return found[0] if found else names[0]


def plan_load(
    engine,
    load_dir: str,
    tag: str,
    *,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_module_only: bool = False,
    custom_load_fn=None,
) -> LoadPlan:
    """See the module docstring. Reads only; every rank reaches the same verdict from the same files."""
    opt = engine.optimizer
    folder = os.path.join(load_dir, tag)
    model_file = engine._get_ckpt_name(load_dir, tag)
    model = load_lazy(model_file, "the module weights and the engine's state")
    if engine.load_universal_checkpoint():
        source = zero_state.open_universal(opt, folder, load_optimizer_states and not load_module_only)
        reshard.check_parameters(zero_state.trainable_shapes(opt), source.shapes(), folder, exact=False)
        return LoadPlan("universal")
    if os.path.isdir(os.path.join(folder, "zero")) and not glob.glob(os.path.join(folder, "*zero_pp_rank_*")):
        raise ACCOCheckpointError(
            f"{folder} is a DeepSpeed universal checkpoint: load it with "
            '"checkpoint": {"load_universal": true} in the DeepSpeed config.'
        )
    if custom_load_fn is None:
        _check_module(engine, model.get("module") or {}, folder, strict=load_module_strict)
    if load_module_only or not load_optimizer_states:
        return LoadPlan("weights")
    world = int(model.get("dp_world_size", 0) or 0)
    if world < 1:
        raise ACCOCheckpointError(
            f"{model_file} records no data-parallel world size: not a DeepSpeed checkpoint"
        )
    files = [_zero_file(engine, load_dir, tag, r) for r in range(world)]
    for r, path in enumerate(files):
        if not os.path.isfile(path):
            raise ACCOCheckpointError(
                f"checkpoint file {path} is missing: the checkpoint was saved on {world} data-parallel ranks and "
                f"holds no optimizer partition of rank {r}. Copy the whole tag folder {folder}."
            )
    shapes = model.get(PARAM_SHAPES)
    if not isinstance(shapes, (list, tuple)):
        raise ACCOCheckpointError(
            f"{model_file} holds no '{PARAM_SHAPES}': not a ZeRO checkpoint of DeepSpeed"
        )
    saved_shapes = {name: tuple(shape) for group in shapes for name, shape in group.items()}
    reshard.check_parameters(zero_state.trainable_shapes(opt), saved_shapes, folder, exact=True)
    rank = opt.pipeline.rank
    states: dict = {}
    if world == opt.pipeline.world_size:  # the exact resume reads this rank's partition only
        states[rank] = load_lazy(files[rank], f"the optimizer partition of rank {rank}")
        own = states[rank].get(OPTIMIZER_STATE_DICT) if isinstance(states[rank], dict) else None
        if isinstance(own, dict) and zero_state.exact_resume_possible(opt, own.get(zero_state.ACCO_KEY)):
            return LoadPlan("exact", world)
    for r, path in enumerate(files):
        if r not in states:
            states[r] = load_lazy(path, f"the optimizer partition of rank {r}")
    source = reshard.ZeroPartitions(
        files, [states[r] for r in range(world)], shapes, need_moments=True, where=folder
    )
    return LoadPlan("committed", world, source)
