"""The committed optimizer state of a checkpoint, by parameter name, re-sharded to this run's layout.

A checkpoint's committed state is, per trainable parameter, its fp32 master weights, Adam's
``exp_avg`` and ``exp_avg_sq`` and the step count. Two sources give it, at any world size:

- :class:`ZeroPartitions`: the per-rank files ``[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` of a
  ZeRO-1/2 checkpoint, ACCO's or DeepSpeed's own (any optimizer with Adam moments). Rank r's
  ``single_partition_of_fp32_groups[g]`` is a contiguous slice of group g's flat vector (padding
  stripped), so the ranks' slices, concatenated in rank order, are the group's parameters in the
  order of the model file's ``param_shapes``; rank r's moments hold the same elements first (then
  padding). Reading a parameter's range touches only the slices of the ranks that hold it (the files
  are memory-mapped, see ``checkpoint.files``).
- :class:`UniversalFolder`: a DeepSpeed universal checkpoint (``ds_to_universal.py``):
  ``zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt``, each holding the full parameter.

:func:`shard_of` cuts this rank's shard of one ACCO group (``GroupLayout``: parameters packed in
order, padded with zeros to a multiple of world_size * 16) out of a source, by name: the grouping and
order of the parameters in the checkpoint do not matter, only names and shapes. Every check runs
when a source is built, before anything is loaded into the run; errors name the file and the problem.
"""

from __future__ import annotations

import math
import os
from typing import Any, Dict, Iterable, List, Sequence, Tuple

import torch
from deepspeed.checkpoint.constants import (
    BASE_OPTIMIZER_STATE,
    BASE_OPTIMIZER_STATE_STEP,
    LOSS_SCALER,
    OPTIMIZER_STATE_DICT,
    PARAM,
    PARAM_ALIGNMENT_PADDINGS,
    PARAM_GROUPS,
    PARTITION_COUNT,
    SINGLE_PARTITION_OF_FP32_GROUPS,
)

from acco_ds.deepspeed.checkpoint.files import ACCOCheckpointError, load_lazy, require_file

MOMENTS = ("exp_avg", "exp_avg_sq")
WEIGHTS_ONLY_ADVICE = (
    "To start from its weights with new Adam moments, load with "
    "engine.load_checkpoint(path, load_optimizer_states=False)."
)

Shape = Tuple[int, ...]


def _step_value(value: Any, where: str) -> int:
    try:
        step = float(value)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ACCOCheckpointError(f"{where}: the step count {value!r} is not a number") from err
    if step < 0 or step != int(step):
        raise ACCOCheckpointError(f"{where}: the step count {step} is not a whole number >= 0")
    return int(step)


def check_parameters(ours: Dict[str, Shape], theirs: Dict[str, Shape], where: str, exact: bool) -> None:
    """Raise ACCOCheckpointError unless every trainable parameter of this run is in the checkpoint
    with its shape (and, with ``exact``, the checkpoint has no other one)."""
    missing = [n for n in ours if n not in theirs]
    unexpected = [n for n in theirs if n not in ours] if exact else []
    mismatched = [
        f"size mismatch for {n}: checkpoint {list(theirs[n])}, this model {list(ours[n])}"
        for n in ours
        if n in theirs and tuple(theirs[n]) != tuple(ours[n])
    ]
    if not (missing or unexpected or mismatched):
        return
    parts = mismatched[:]
    if missing:
        parts.append(f"missing from the checkpoint: {missing}")
    if unexpected:
        parts.append(f"in the checkpoint but not in this model: {unexpected}")
    raise ACCOCheckpointError(
        f"checkpoint {where} holds another model than this engine's (parameter names or shapes differ): "
        f"{'; '.join(parts)}. Allowed: a checkpoint saved from this model (the same trainable parameter names "
        "and shapes)."
    )


class ZeroPartitions:
    """See the module docstring. ``states[r]``: the loaded file of data-parallel rank r (the dict
    DeepSpeed saves, ``{"optimizer_state_dict": ..., ...}``); ``param_shapes``: the model file's list of
    ``{name: shape}`` per group. ``need_moments``: the moments and the step must be there."""

    def __init__(
        self,
        files: Sequence[str],
        states: Sequence[dict],
        param_shapes: Sequence[Dict[str, Any]],
        need_moments: bool,
        where: str,
    ):
        self.where = where
        self.files = list(files)
        world = len(self.files)
        self.world_size = world
        self._osd: List[dict] = []
        for path, sd in zip(self.files, states):
            osd = sd.get(OPTIMIZER_STATE_DICT) if isinstance(sd, dict) else None
            if not isinstance(osd, dict) or SINGLE_PARTITION_OF_FP32_GROUPS not in osd:
                raise ACCOCheckpointError(
                    f"checkpoint file {path} holds no ZeRO stage 1/2 optimizer partition (no "
                    f"'{SINGLE_PARTITION_OF_FP32_GROUPS}'): ACCO reads ZeRO-1/2 checkpoints (DeepSpeed's or its own) and "
                    "DeepSpeed universal checkpoints. " + WEIGHTS_ONLY_ADVICE
                )
            if len(osd[SINGLE_PARTITION_OF_FP32_GROUPS]) != len(param_shapes):
                raise ACCOCheckpointError(
                    f"checkpoint file {path} holds {len(osd[SINGLE_PARTITION_OF_FP32_GROUPS])} parameter groups, the "
                    f"model file's param_shapes {len(param_shapes)}: the files come from different saves."
                )
            pads = osd.get(PARAM_ALIGNMENT_PADDINGS) or []
            if any(any(int(x) for x in group) for group in pads):
                raise ACCOCheckpointError(
                    f"checkpoint file {path} was saved with per-parameter alignment padding ({PARAM_ALIGNMENT_PADDINGS} "
                    f"{pads}): ACCO reads only contiguous ZeRO partitions (DeepSpeed's default). "
                    + WEIGHTS_ONLY_ADVICE
                )
            counts = osd.get(PARTITION_COUNT)
            counts = counts if isinstance(counts, (list, tuple)) else [counts]
            if any(c is not None and int(c) != world for c in counts):
                raise ACCOCheckpointError(
                    f"checkpoint file {path} says partition_count={osd.get(PARTITION_COUNT)}, but {world} partition "
                    f"files were found in {where}: a file is missing or comes from another save."
                )
            self._osd.append(osd)
        self._where: Dict[str, Tuple[int, int, int, Shape]] = {}
        self._spans: List[List[Tuple[int, int]]] = []  # per group, per rank: (start, length) in the group
        self._steps: List[int | None] = []
        for g, shapes in enumerate(param_shapes):
            off = 0
            for name, shape in shapes.items():
                shape = tuple(int(d) for d in shape)
                self._where[name] = (g, off, math.prod(shape), shape)
                off += math.prod(shape)
            spans, start = [], 0
            for osd in self._osd:
                n = osd[SINGLE_PARTITION_OF_FP32_GROUPS][g].numel()
                spans.append((start, n))
                start += n
            if start != off:
                raise ACCOCheckpointError(
                    f"checkpoint {where}: the fp32 partitions of parameter group {g} hold {start} elements in all, "
                    f"the model file's param_shapes {off}: a partition file is truncated, corrupted or from another save."
                )
            self._spans.append(spans)
            self._steps.append(self._check_moments(g, spans) if need_moments else None)

    def _group_state(self, r: int, g: int) -> dict | None:
        base = self._osd[r].get(BASE_OPTIMIZER_STATE)
        if isinstance(base, dict):
            state = base.get("state", {})
            return state.get(g, state.get(str(g)))
        if isinstance(base, (list, tuple)) and g < len(base):
            return base[g]
        return None

    def _check_moments(self, g: int, spans) -> int:
        steps = []
        for r, (_, n) in enumerate(spans):
            path, state = self.files[r], self._group_state(r, g) or {}
            for key in MOMENTS:
                t = state.get(key)
                if not torch.is_tensor(t) or t.numel() < n:
                    raise ACCOCheckpointError(
                        f"checkpoint file {path}: parameter group {g} has no Adam moment '{key}' for its {n} elements "
                        f"(optimizer state keys: {sorted(state)}): it was saved by an optimizer without Adam moments. "
                        "ACCO needs exp_avg, exp_avg_sq and step (Adam/AdamW). " + WEIGHTS_ONLY_ADVICE
                    )
            step = state.get("step", self._osd[r].get(BASE_OPTIMIZER_STATE_STEP))
            if step is None:
                raise ACCOCheckpointError(
                    f"checkpoint file {path}: parameter group {g} has no Adam step count. "
                    + WEIGHTS_ONLY_ADVICE
                )
            steps.append(_step_value(step, path))
        if len(set(steps)) != 1:
            raise ACCOCheckpointError(
                f"checkpoint {self.where}: the ranks' step counts of parameter group {g} differ ({steps}): the "
                "partition files come from different saves."
            )
        return steps[0]

    # -- what the loader reads ----------------------------------------------------------------
    def shapes(self) -> Dict[str, Shape]:
        return {name: w[3] for name, w in self._where.items()}

    def step(self, name: str) -> int:
        return self._steps[self._where[name][0]]

    def _tensor(self, r: int, g: int, key: str) -> torch.Tensor:
        if key == "fp32":
            return self._osd[r][SINGLE_PARTITION_OF_FP32_GROUPS][g]
        return self._group_state(r, g)[key]

    def read(self, name: str, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of parameter ``name``'s flattened ``key`` ("fp32" or a moment), fp32."""
        g, off, _, _ = self._where[name]
        lo, hi = off + start, off + stop
        pieces = []
        for r, (s, n) in enumerate(self._spans[g]):
            a, b = max(lo, s), min(hi, s + n)
            if b > a:
                pieces.append(self._tensor(r, g, key).reshape(-1)[a - s : b - s])
        return torch.cat(pieces).float() if pieces else torch.zeros(0)

    def acco_snapshots(self) -> List[dict] | None:
        """Every rank's "acco" entry (ACCO's in-flight state), or None for another optimizer's files."""
        snaps = [osd.get("acco") for osd in self._osd]
        return snaps if all(s is not None for s in snaps) else None

    def loss_scaler(self):
        """The saving run's loss scaler object (DeepSpeed's ``loss_scaler`` key, rank 0's), or None."""
        return self._osd[0].get(LOSS_SCALER)

    def param_groups(self) -> List[dict] | None:
        base = self._osd[0].get(BASE_OPTIMIZER_STATE)
        return base.get(PARAM_GROUPS) if isinstance(base, dict) else None


class UniversalFolder:
    """A DeepSpeed universal checkpoint (see the module docstring); ``names``: the parameters this run
    trains. ``ds_to_universal.py`` also writes ``zero/<name>/fp32.pt`` for the saved module's other
    entries (frozen parameters, buffers, the other names of tied weights): ``untrained`` lists this run's
    such entries, whose files (where present) must be complete; :meth:`untrained_value` reads one."""

    def __init__(self, folder: str, names: Iterable[str], need_moments: bool, untrained: Iterable[str] = ()):
        self.where = folder
        zero = os.path.join(folder, "zero")
        if not os.path.isdir(zero):
            raise ACCOCheckpointError(
                f"{folder} is not a DeepSpeed universal checkpoint (no zero/ folder): with "
                '"checkpoint": {"load_universal": true} the tag (or the latest_universal file) must name the output '
                "folder of ds_to_universal.py, e.g. python -m deepspeed.checkpoint.ds_to_universal --input_folder "
                "ckpt/global_step100 --output_folder ckpt/global_step100_universal."
            )
        state_file = os.path.join(zero, "optimizer_state.pt")
        self._globals = load_lazy(state_file, "the universal checkpoint's optimizer settings")
        keys = ("fp32",) + (MOMENTS + ("step",) if need_moments else ())
        self._files: Dict[str, Dict[str, str]] = {}
        for name in names:
            files = {key: os.path.join(zero, name, f"{key}.pt") for key in keys}
            for key, path in files.items():
                if key in MOMENTS + ("step",) and not os.path.isfile(path):
                    raise ACCOCheckpointError(
                        f"universal checkpoint {folder} has no Adam state '{key}' for parameter {name!r} ({path} is "
                        "missing): it was converted from an optimizer without Adam moments. ACCO needs exp_avg, "
                        "exp_avg_sq and step (Adam/AdamW). " + WEIGHTS_ONLY_ADVICE
                    )
                require_file(path, f"{key} of parameter {name!r} in a universal checkpoint")
            self._files[name] = files
        self._tensors: Dict[str, Dict[str, torch.Tensor]] = {}
        self._steps: Dict[str, int] = {}
        for name, files in self._files.items():
            loaded = {}
            for key, path in files.items():
                obj = load_lazy(path, f"{key} of parameter {name!r}")
                if key == "step":
                    self._steps[name] = _step_value(obj, path)
                    continue
                t = obj.get(PARAM) if isinstance(obj, dict) else None
                if not torch.is_tensor(t):
                    raise ACCOCheckpointError(
                        f"{path} holds no '{PARAM}' tensor: not a universal checkpoint file"
                    )
                loaded[key] = t
            shapes = {tuple(t.shape) for t in loaded.values()}
            if len(shapes) != 1:
                raise ACCOCheckpointError(
                    f"universal checkpoint {folder}: the states of parameter {name!r} have different shapes "
                    f"{sorted(shapes)}: the folder mixes conversions."
                )
            self._tensors[name] = loaded
        self._untrained = {}
        for name in untrained:
            path = os.path.join(zero, name, "fp32.pt")
            if os.path.isfile(path):
                obj = load_lazy(path, f"the saved value of {name!r}")
                if isinstance(obj, dict) and torch.is_tensor(obj.get(PARAM)):
                    self._untrained[name] = obj[PARAM]

    def untrained_value(self, name: str) -> torch.Tensor | None:
        """The saved value of a frozen parameter or buffer ``name`` (fp32), or None."""
        return self._untrained.get(name)

    def shapes(self) -> Dict[str, Shape]:
        return {name: tuple(t["fp32"].shape) for name, t in self._tensors.items()}

    def step(self, name: str) -> int:
        return self._steps[name]

    def read(self, name: str, key: str, start: int, stop: int) -> torch.Tensor:
        return self._tensors[name][key].reshape(-1)[start:stop].float()

    def acco_snapshots(self) -> None:
        return None  # a universal checkpoint keeps no in-flight state

    def loss_scaler(self):
        """The saving run's loss scaler object (``zero/optimizer_state.pt`` keeps rank 0's global state), or None."""
        return self._globals.get(LOSS_SCALER) if isinstance(self._globals, dict) else None

    def param_groups(self) -> List[dict] | None:
        return self._globals.get(PARAM_GROUPS) if isinstance(self._globals, dict) else None


def shard_of(source, layout, names: Sequence[str], rank: int, keys: Sequence[str]) -> Dict[str, torch.Tensor]:
    """This rank's shard (``layout.shard_numel`` fp32 elements, zeros in the padding) of each ``key``
    ("fp32", "exp_avg", "exp_avg_sq") of one ACCO group whose parameters are ``names`` in order."""
    rng = layout.shard_range(rank)
    out = {key: torch.zeros(layout.shard_numel, dtype=torch.float32) for key in keys}
    for name, off, numel in zip(names, layout.offsets, layout.numels):
        lo, hi = max(off, rng.start), min(off + numel, rng.stop)
        if hi <= lo:
            continue
        for key in keys:
            out[key][lo - rng.start : hi - rng.start] = source.read(name, key, lo - off, hi - off)
    return out


def common_step(source, names: Iterable[str]) -> int:
    """The step count shared by every parameter ``names`` (ACCO keeps one for all groups)."""
    steps = {source.step(n) for n in names}
    if len(steps) != 1:
        raise ACCOCheckpointError(
            f"checkpoint {source.where}: the parameters' step counts differ ({sorted(steps)}); ACCO keeps one step "
            "count for all parameter groups. " + WEIGHTS_ONLY_ADVICE
        )
    return steps.pop()
