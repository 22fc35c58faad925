"""Periodic saves and the automatic resume of ``acco-train`` (what lets a restarted job go on by itself).

Contract (every function is collective: every rank of the run calls it at the same point):
- ``resume(engine, spec)``: when ``spec.checkpoint_dir`` holds a complete checkpoint (its ``latest`` file,
  written only once a save is complete, see ``acco_ds.deepspeed.checkpoint.guard``), loads it - at whatever
  world size this run has: ACCO re-shards the committed state when the saving run had another one - and
  returns the optimizer steps it holds; else 0. The LR schedule and the step count come back with it.
- ``Saver(engine, spec, start)``: ``saver(step)`` saves tag ``step<N>`` every ``spec.save_every`` steps,
  ``saver(step, final=True)`` at the end of the run, then removes all but the newest ``spec.keep_checkpoints`` saves (rank 0, after the save is
  complete); never at or before ``start`` (the step a resumed run's checkpoint holds). ``saver.seconds`` and
  ``saver.saves`` say what the saves cost. Every ``saver(step)`` first records the step in node memory
  (``acco_ds.deepspeed.checkpoint.memory.record_step``; a no-op without ``optimizer.params.memory_state``).
A resumed run draws its micro-batches from a stream seeded with the step it resumes at (``data_seed``):
a restart never repeats the micro-batches of the steps it kept, at any world size.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from acco_ds.deepspeed.checkpoint import memory

TAG_PREFIX = "step"


def latest_tag(checkpoint_dir: str | None) -> str | None:
    """The tag named by ``checkpoint_dir/latest`` (the last complete save), or None."""
    if not checkpoint_dir:
        return None
    latest = Path(checkpoint_dir) / "latest"
    if not latest.is_file():
        return None
    tag = latest.read_text().strip()
    return tag or None


def _tag_step(tag: str | None) -> int:
    suffix = (tag or "")[len(TAG_PREFIX) :]
    return int(suffix) if (tag or "").startswith(TAG_PREFIX) and suffix.isdigit() else 0


def resume(engine, spec) -> int:
    """Load the newest committed state into ``engine``: the records in node memory (``optimizer.params.
    memory_state``) when they hold a later step than the last complete save of ``spec.checkpoint_dir``, else that
    save; returns its step (0: none)."""
    tag = latest_tag(spec.checkpoint_dir)
    found = memory.newest_step(engine)
    if found is not None and found.step > _tag_step(tag):
        client = memory.resume(engine, found)
        return int(client["acco_train_step"])
    if tag is None:
        return 0
    _, client = engine.load_checkpoint(spec.checkpoint_dir, tag=tag)
    step = int((client or {}).get("acco_train_step", 0))
    if step <= 0:
        raise RuntimeError(
            f"acco-train: the checkpoint {Path(spec.checkpoint_dir) / tag} was not written by acco-train "
            "(no 'acco_train_step' in its client state): point --checkpoint-dir at an empty folder or at "
            "acco-train's own saves"
        )
    return step


def data_seed(seed: int, resumed_at: int) -> int:
    """The micro-batch stream's seed: the run's seed, moved on by the step a resumed run starts at."""
    return seed + 1_000_003 * resumed_at


class Saver:
    """Saves every ``spec.save_every`` steps (and at ``spec.steps``); see the module docstring."""

    def __init__(self, engine, spec, start: int = 0):
        self.engine = engine
        self.spec = spec
        self.start = start  # the step a resumed run started from: already saved
        self.seconds: list = []
        self.saves: list = []

    def __call__(self, step: int, final: bool = False) -> None:
        """Save at ``step`` when it is a multiple of ``save_every``; ``final=True`` (after the run's last
        commit, e.g. once ACCO's ``finish()`` applied it): save unless that step is saved already."""
        if not final:
            memory.record_step(self.engine, step, {"acco_train_step": step})
        every = self.spec.save_every
        if not every or not self.spec.checkpoint_dir or step <= self.start:
            return
        if (step % every and not final) or (self.saves and self.saves[-1] == step):
            return
        t0 = time.perf_counter()
        tag = f"{TAG_PREFIX}{step}"
        self.engine.save_checkpoint(self.spec.checkpoint_dir, tag=tag, client_state={"acco_train_step": step})
        self.seconds.append(time.perf_counter() - t0)
        self.saves.append(step)
        if int(self.engine.global_rank) == 0:
            self._prune(tag)

    def _prune(self, newest: str) -> None:
        root = Path(self.spec.checkpoint_dir)
        tags = sorted(
            (p for p in root.iterdir() if p.is_dir() and p.name[len(TAG_PREFIX) :].isdigit()),
            key=lambda p: int(p.name[len(TAG_PREFIX) :]),
        )
        keep = {p.name for p in tags[-max(1, self.spec.keep_checkpoints) :]} | {newest}
        for p in tags:
            if p.name not in keep:
                shutil.rmtree(p, ignore_errors=True)

    def bytes_on_disk(self) -> int:
        """Bytes of the newest save (every rank's files), 0 when none was made."""
        if not self.saves:
            return 0
        folder = Path(self.spec.checkpoint_dir) / f"{TAG_PREFIX}{self.saves[-1]}"
        return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
