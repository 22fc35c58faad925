"""Crash-safe ``save_checkpoint`` and clear ``load_checkpoint`` errors for engines driven by ACCO.

What DeepSpeed 0.19.8 does (``DeepSpeedEngine.save_checkpoint``): every rank writes its files
straight into ``save_dir/<tag>/``; rank 0 then writes ``latest`` right after ITS OWN files, before
the final barrier, with ``open(..., "w")`` (truncate, then write). So a job killed while another
rank is still writing leaves ``latest`` naming a tag whose files are partial, a kill inside that
``open`` leaves an empty ``latest``, and re-saving an existing tag overwrites a complete checkpoint
in place. :func:`save_checkpoint` (installed by ``register.py`` for ACCO engines) instead:

1. has every rank write into the staging tag ``<tag>.acco-partial`` (removed first if an earlier
   save left it), through DeepSpeed's own ``save_checkpoint`` with ``save_latest=False``, which ends
   with a barrier: after it, every rank's files are complete;
2. on the rank that owns the directory (global rank 0, or each node's local rank 0 with
   ``use_node_local_storage``): fsyncs the files, moves an existing ``<tag>`` aside, renames the
   staging directory to ``<tag>`` (atomic on POSIX), fsyncs ``save_dir`` and deletes the old copy;
3. barrier; then rank 0 writes ``latest`` atomically (a temporary file, fsync, ``os.replace``);
   barrier.

So a kill at any point leaves ``latest`` naming the previous complete checkpoint (or the new one once
it is complete), never a partial one; a partial save is a ``*.acco-partial`` directory that nothing
names. (A decoupled checkpoint engine, e.g. Nebula, commits on its own: it goes through DeepSpeed's
method unchanged.)

:func:`load_checkpoint` checks, before DeepSpeed reads anything, that every ``*.pt`` file of the tag
is a complete torch archive (zip central directory present) and raises ACCOCheckpointError naming
the file otherwise (and naming the tags present when the tag does not exist); a module state dict that does not fit the model becomes an ACCOCheckpointError
naming the checkpoint. Then ``preflight.plan_load`` reads what the load needs (every rank's
optimizer partition, the module weights' names and shapes, or a universal checkpoint's files) and the
ranks agree: a missing or truncated file, another model or an optimizer without Adam moments is an
ACCOCheckpointError on every rank before anything is loaded. A checkpoint that cannot be resumed exactly
(another world size, mode, accumulation or gradient_accumulation_steps, or DeepSpeed's own ZeRO
optimizer) is loaded from its committed state, re-sharded (``zero_state.load_committed``), in place of
DeepSpeed's ``_load_zero_checkpoint`` (which refuses another world size).

Saves also write ``universal_checkpoint_info`` into the model file (unless the module brings its own),
which DeepSpeed's ``ds_to_universal.py`` requires; the load takes it out of the returned client state.
"""

from __future__ import annotations

import contextlib
import os
import shutil

import torch.distributed as dist
from deepspeed.checkpoint.constants import (
    UNIVERSAL_CHECKPOINT_INFO,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    UNIVERSAL_CHECKPOINT_VERSION_VALUE,
)

from acco_ds.core.snapshot import SnapshotMismatchError
from acco_ds.deepspeed.checkpoint import zero_state
from acco_ds.deepspeed.checkpoint.files import ACCOCheckpointError, is_complete
from acco_ds.deepspeed.checkpoint.preflight import plan_load

STAGING_SUFFIX = ".acco-partial"
REPLACED_SUFFIX = ".acco-replaced"


def _fsync_path(path: str) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0)
    with contextlib.suppress(OSError):  # some file systems refuse to fsync a directory
        fd = os.open(path, flags)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _owns_directory(engine) -> bool:
    if engine.use_node_local_storage():
        return int(engine.local_rank) == 0
    return int(engine.global_rank) == 0


def publish(save_dir: str, staging: str, tag: str) -> None:
    """Make ``save_dir/staging`` the tag ``save_dir/tag`` (see the module docstring, step 2)."""
    src, dst = os.path.join(save_dir, staging), os.path.join(save_dir, tag)
    for root, _, files in os.walk(src):
        for name in files:
            _fsync_path(os.path.join(root, name))
        _fsync_path(root)
    old = None
    if os.path.exists(dst):
        old = dst + REPLACED_SUFFIX
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
    os.replace(src, dst)
    _fsync_path(save_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_latest(save_dir: str, tag: str, name: str = "latest") -> None:
    """Write ``save_dir/latest`` = tag atomically (temporary file, fsync, rename)."""
    path = os.path.join(save_dir, name)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(save_dir)


def save_checkpoint(
    engine, original, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False
):
    """``DeepSpeedEngine.save_checkpoint`` made crash-safe (module docstring). Collective."""
    client_state = dict(client_state) if client_state is not None else {}
    if getattr(engine.module, UNIVERSAL_CHECKPOINT_INFO, None) is None:
        client_state.setdefault(
            UNIVERSAL_CHECKPOINT_INFO, {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}
        )
    if engine.checkpoint_engine.is_decoupled():
        return original(
            engine,
            save_dir,
            tag=tag,
            client_state=client_state,
            save_latest=save_latest,
            exclude_frozen_parameters=exclude_frozen_parameters,
        )
    if not save_dir:
        raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
    tag = str(tag if tag is not None else f"global_step{engine.global_steps}")
    if tag.endswith((STAGING_SUFFIX, REPLACED_SUFFIX)) or os.sep in tag or tag in ("", ".", ".."):
        raise ValueError(
            f"checkpoint tag {tag!r}: allowed: a plain directory name not ending in {STAGING_SUFFIX}"
        )
    staging = tag + STAGING_SUFFIX
    owner = _owns_directory(engine)
    if owner:
        shutil.rmtree(os.path.join(save_dir, staging), ignore_errors=True)
    ok = original(
        engine,
        save_dir,
        tag=staging,
        client_state=client_state,
        save_latest=False,
        exclude_frozen_parameters=exclude_frozen_parameters,
    )  # ends with a barrier: every rank's files are written
    if owner:
        publish(save_dir, staging, tag)
    dist.barrier()
    if save_latest and int(engine.global_rank) == 0:
        write_latest(save_dir, tag)
    dist.barrier()
    return ok


def _resolve_tag(engine, load_dir, tag):
    if tag is not None:
        return str(tag)
    name = "latest_universal" if engine.load_universal_checkpoint() else "latest"
    path = os.path.join(load_dir, name)
    if not os.path.isfile(path):
        return None  # DeepSpeed warns and returns (None, None)
    with open(path) as f:
        text = f.read().strip()
    if not text:
        raise ACCOCheckpointError(
            f"{path} is empty: the save that wrote it was interrupted (a DeepSpeed save outside acco_ds). "
            "Pass the tag of the last complete checkpoint explicitly: engine.load_checkpoint(dir, tag=...)."
        )
    return text


def check_files(load_dir: str, tag: str) -> None:
    """Raise ACCOCheckpointError when ``load_dir/tag`` does not exist (DeepSpeed fails there with an
    empty AssertionError), or naming the first ``*.pt`` file of it that is not a complete torch
    archive (empty, or a zip without its central directory: a truncated write)."""
    folder = os.path.join(load_dir, tag)
    if not os.path.isdir(folder):
        tags = (
            sorted(d for d in os.listdir(load_dir) if os.path.isdir(os.path.join(load_dir, d)))
            if os.path.isdir(load_dir)
            else []
        )
        raise ACCOCheckpointError(
            f"checkpoint tag {tag!r} not found: {folder} does not exist. Allowed: one of the tags in "
            f"{load_dir}: {', '.join(tags) or '(none)'} (a *{STAGING_SUFFIX} one is a save that was interrupted)."
        )
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not name.endswith(".pt") or not os.path.isfile(path):
            continue
        size = os.path.getsize(path)
        if not is_complete(path):
            raise ACCOCheckpointError(
                f"checkpoint file {path} is truncated ({size} bytes, no complete torch archive): the save that "
                f"wrote it was interrupted or the copy is incomplete. Load another tag (the 'latest' file in "
                f"{load_dir} names the last complete save of acco_ds), or copy the checkpoint again."
            )


def _agree(engine, error: Exception | None) -> None:
    """Raise on every rank when any rank found a problem (its own message, or the first rank's)."""
    group = getattr(getattr(engine.optimizer, "pipeline", None), "control_group", None)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return
    found = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, None if error is None else f"{type(error).__name__}: {error}", group=group)
    if error is not None:
        raise error
    for rank, msg in enumerate(found):
        if msg is not None:
            raise ACCOCheckpointError(f"data-parallel rank {rank} cannot load the checkpoint: {msg}")


def load_checkpoint(engine, original, load_dir, tag=None, **kwargs):
    """``DeepSpeedEngine.load_checkpoint`` with the checks and routes of the module docstring. Collective."""
    plan, error = None, None
    try:
        resolved = _resolve_tag(engine, load_dir, tag)
        if resolved is not None:
            check_files(load_dir, resolved)
            keys = ("load_module_strict", "load_optimizer_states", "load_module_only", "custom_load_fn")
            plan = plan_load(engine, load_dir, resolved, **{k: kwargs[k] for k in keys if k in kwargs})
    except (ACCOCheckpointError, SnapshotMismatchError) as err:
        error = err
    _agree(engine, error)
    if plan is not None and plan.route == "committed":
        source = plan.source

        def _load_zero_checkpoint(load_dir, tag, load_optimizer_states=True):
            zero_state.load_committed(engine.optimizer, source, load_optimizer_states)
            return True

        engine._load_zero_checkpoint = (
            _load_zero_checkpoint  # this call only (DeepSpeed's refuses another world size)
        )
    try:
        out = original(engine, load_dir, tag=tag, **kwargs)
    except RuntimeError as err:
        if "Error(s) in loading state_dict" not in str(err):
            raise
        with contextlib.suppress(Exception):  # leave the model viewing the compute side's buffer
            engine.optimizer.checkpoint_event_epilogue()
        raise ACCOCheckpointError(
            f"checkpoint {os.path.join(load_dir, str(resolved))} holds another model than this engine's "
            f"(parameter names or shapes differ): {str(err).strip()}. Allowed: a checkpoint saved from this model."
        ) from err
    finally:
        engine.__dict__.pop("_load_zero_checkpoint", None)
    path, client_state = out
    if isinstance(client_state, dict) and getattr(engine.module, UNIVERSAL_CHECKPOINT_INFO, None) is None:
        client_state.pop(UNIVERSAL_CHECKPOINT_INFO, None)
    return path, client_state
