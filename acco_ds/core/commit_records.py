"""The rank's committed optimizer state kept in node memory after every commit, and the training thread's step
counters beside it: what a restarted process resumes from without a disk checkpoint.

Two :class:`~acco_ds.core.state_records.RecordFile` per rank, in the run's folder (``MemoryState.folder``):

- ``rank{r}.g{gen}.commits``: written by :meth:`MemoryState.after_job` on the thread that runs the round's job (the
  communication worker thread, never the compute stream), right after each COMMIT job: per group, the fp32 master
  shard, ``exp_avg`` and ``exp_avg_sq`` (``shard_numel`` elements each, padding included), under the key
  ``commit_index``, with the job's result as plain values (``snapshot``'s form of the job in flight) and
  ``applied``, the AdamW step count after the job. A skipped or empty commit is recorded too (its state is the
  previous one's; its outcome moves the loss scaler).
- ``rank{r}.g{gen}.steps``: written by :meth:`MemoryState.record_step` on the training thread once optimizer step
  ``step`` is done: ``snapshot.counters`` (no drain), ``last_commit`` (the newest COMMIT launched) and
  ``in_flight_commit`` (its index when it is the job in flight, else None), and the caller's ``extra`` (the
  DeepSpeed layer's engine counters and LR scheduler).

A step record ``N`` and the commit record ``last_commit(N)`` together are what a checkpoint saved at step ``N``
holds of the committed state; each file keeps its two newest records, so once step ``N + 1`` is recorded the
pair of ``N`` may be gone but that of ``N + 1`` is complete as soon as its commit's job has finished. A process
killed at any point leaves the pair of the newest step whose commit finished: at most the step in progress and
the one before it are not yet resumable.

``gen`` is the process generation (the launcher's restart count): a restarted process writes new files and
leaves the previous generation's for the readers until its own first step is recorded, then removes them.
The metas are pickled by :func:`dumps` (their tensors as bytes) and read back decoded by :func:`pairs`.
Buffers: the commit record reads ``GroupBuffers.master/exp_avg/exp_avg_sq`` after the job wrote them, on the same
thread, before the next job starts (jobs run one at a time).
"""

from __future__ import annotations

import io
import pickle
import re
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

from acco_ds.core.round_job import RoundResult
from acco_ds.core.schedule import Job
from acco_ds.core.snapshot import _result_to_plain, counters
from acco_ds.core.state_records import Record, RecordFile

KEYS = ("master", "exp_avg", "exp_avg_sq")
_NAME = re.compile(r"rank(\d+)\.g(\d+)\.(commits|steps)$")


def dumps(meta: Dict[str, Any]) -> bytes:
    """A record's pickled meta, its tensors (any dtype, CPU or not, wherever they are in it) stored as their bytes:
    pickling a tensor itself costs about ten times as much (torch serializes its storage). One pass of the C pickler,
    which hands only the tensors to Python (:class:`_Pickler`): the training thread pickles a step record every step."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(meta)
    return buf.getvalue()


def decode(meta: Any) -> Any:
    """A record's meta as it was before :func:`dumps`: its tensors back as CPU tensors."""
    if isinstance(meta, _TensorBytes):
        flat = (
            torch.frombuffer(bytearray(meta.data), dtype=torch.uint8)
            if meta.data
            else torch.empty(0, dtype=torch.uint8)
        )
        return flat.view(getattr(torch, meta.dtype)).reshape(meta.shape).clone()
    if isinstance(meta, dict):
        return {k: decode(v) for k, v in meta.items()}
    if isinstance(meta, (list, tuple)):
        return type(meta)(decode(v) for v in meta)
    return meta


@dataclass(frozen=True)
class _TensorBytes:
    dtype: str
    shape: Tuple[int, ...]
    data: bytes


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        t = obj.detach().to("cpu").contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return _TensorBytes, (str(t.dtype).removeprefix("torch."), tuple(t.shape), data)


def run_folder(root: str, run_id: str) -> Path:
    """The folder of one run's records under ``root``."""
    return Path(root) / re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)


class MemoryState:
    """This rank's two record files (see the module docstring). ``static``: what the DeepSpeed layer stores once
    (parameter names and shapes per group); ``generation``: this process's restart count. ``copies``: a
    ``core.peer_copies.PeerCopies`` once :meth:`copy_to_peer` is called (None: the records stay on this node)."""

    def __init__(self, pipeline, folder: Path, generation: int, static: Dict[str, Any]):
        self.pipeline = pipeline
        self.folder = Path(folder)
        self.generation = int(generation)
        self.rank = pipeline.rank
        self._static = dict(static)
        numels = [b.layout.shard_numel for b in pipeline.groups for _ in KEYS]
        base = self.folder / f"rank{self.rank}.g{self.generation}"
        info = self.ward_static(self.rank)
        self.commits = RecordFile.create(f"{base}.commits", numels, info)
        self.steps = RecordFile.create(f"{base}.steps", [], info)
        self.copies = None
        self.inputs = None  # core.commit_inputs.CommitInputs: the commits' step inputs (inputs-form copies)
        self._older_removed = False
        self.steps_recorded = 0  # by this process (record_step)
        # seconds: the job's thread waiting for the copies and writing commit records, the training thread's step
        # records
        self.seconds = {"commit_wait_s": 0.0, "commit_record_s": 0.0, "step_record_s": 0.0}

    def ward_static(self, rank: int) -> Dict[str, Any]:
        """The static part of ``rank``'s record files: rank, world size, generation, its real shard length per group
        (without the padding) and the caller's ``static``."""
        real = [len(b.layout.real_shard_range(rank)) for b in self.pipeline.groups]
        world = self.pipeline.world_size
        return {
            "rank": rank,
            "world_size": world,
            "generation": self.generation,
            "real_shard": real,
            **self._static,
        }

    def copy_to_peer(self, group, holder: int, wards, timeout_s: float, form: str = "state") -> None:
        """From now on every recorded step is also copied to ``holder``'s memory (``core.peer_copies``); ``form``
        "inputs": a commit's copy is its AdamW inputs where it has them (``core.commit_inputs``), else the state."""
        from acco_ds.core.commit_inputs import CommitInputs
        from acco_ds.core.emulated_stream import EmulatedCuda
        from acco_ds.core.peer_copies import PeerCopies

        if form not in ("inputs", "state"):
            raise ValueError(
                f"acco_ds: memory_state.peer_copy_form must be 'inputs' or 'state', got {form!r}"
            )
        if form == "inputs":
            emulated = isinstance(getattr(self.pipeline.executor, "cuda", None), EmulatedCuda)
            self.inputs = CommitInputs(self.pipeline.groups, self.pipeline.device, emulate_async=emulated)
        self.copies = PeerCopies(self, group, holder, wards, timeout_s, self.pipeline.executor)

    def wrap(self, job: Callable[..., RoundResult], commit_index: int) -> Callable[[], RoundResult]:
        """``job`` (a COMMIT's ``run_round_job``, its keywords bound) followed by :meth:`after_job` on the same thread;
        with inputs-form copies, the job also captures its step inputs (``core.commit_inputs``)."""
        if self.inputs is not None:
            job = partial(job, commit_inputs=self.inputs.capture(commit_index))

        def run() -> RoundResult:
            return self.after_job(job())

        return run

    def after_job(self, result: RoundResult) -> RoundResult:
        """Record the committed state after a COMMIT job (on the job's thread); other jobs pass through."""
        if result.job is Job.COMMIT:
            t0 = time.perf_counter()
            tensors = [getattr(b, k) for b in self.pipeline.groups for k in KEYS]
            applied = int(self.pipeline.applied_dev[0].item())  # ends the job's stream work (CUDA)
            if self.inputs is not None:
                self.inputs.synchronized()
            if self.copies is not None:
                self.copies.wait_slot_free(result.commit_index)
            t1 = time.perf_counter()
            self.commits.write_blob(
                result.commit_index, tensors, dumps({"result": _result_to_plain(result), "applied": applied})
            )
            if self.copies is not None:
                self.copies.commit_recorded()
            self.seconds["commit_wait_s"] += t1 - t0
            self.seconds["commit_record_s"] += time.perf_counter() - t1
        return result

    def record_step(self, step: int, extra: Dict[str, Any]) -> None:
        """Record optimizer step ``step`` (the training thread, once the step is done; see the module docstring)."""
        t0 = time.perf_counter()
        p = self.pipeline
        p.read_swapped_commits()
        in_flight = None
        if p.in_flight is not None and p.in_flight[1].job is Job.COMMIT:
            in_flight = p.commits_launched - 1
        meta = {
            "counters": counters(p),
            "last_commit": p.commits_launched - 1,
            "in_flight_commit": in_flight,
            "extra": extra,
        }
        blob = dumps(meta)  # once: the record's and the copy's
        self.steps.begin(int(step))
        self.steps.finish(int(step), blob)
        self.steps_recorded += 1
        if self.copies is not None and meta["last_commit"] >= 0:
            job = None if p.in_flight is None else p.in_flight[0]
            self.copies.step_recorded(int(step), meta["last_commit"], blob, after=job)
        if not self._older_removed:
            remove_older(self.folder, self.rank, self.generation)
            self._older_removed = True
        self.seconds["step_record_s"] += time.perf_counter() - t0

    def stats(self) -> Dict[str, float]:
        """The copies' bytes, steps, seconds and CPU seconds (their thread's), their waits for the rounds in flight at
        the steps' records, commits sent by form, the wards' inputs that did not give their state and the captures'
        copies the CPU test mode landed late, so far (zeros without copies), and the seconds the records took on the
        job's thread and on the training thread."""
        c = self.copies
        return {
            "peer_copy_bytes_sent": 0 if c is None else c.bytes_sent,
            "peer_copy_bytes_received": 0 if c is None else c.bytes_received,
            "peer_copy_steps": 0 if c is None else c.steps_copied,
            "peer_copy_s": 0.0 if c is None else c.seconds,
            "peer_copy_cpu_s": 0.0 if c is None else c.cpu_seconds,
            "peer_copy_after_round_s": 0.0 if c is None else c.after_round_s,
            "peer_copy_commits_as_state": 0 if c is None else c.commits_sent["state"],
            "peer_copy_commits_as_inputs": 0 if c is None else c.commits_sent["inputs"],
            "peer_copy_mismatches": 0 if c is None else c.mismatches,
            "peer_copy_inputs_landed_late": 0 if self.inputs is None else self.inputs.landed,
            **{f"memory_{k}": v for k, v in self.seconds.items()},
        }

    def close(self) -> None:
        if self.copies is not None:
            self.copies.close()
        self.commits.close()
        self.steps.close()


def remove_older(folder: Path, rank: int, generation: int) -> None:
    """Remove ``rank``'s record files of generations before ``generation`` in ``folder``."""
    for path in Path(folder).glob(f"rank{rank}.g*.*"):
        m = _NAME.match(path.name)
        if m and int(m.group(2)) < generation:
            path.unlink(missing_ok=True)


def generations(folder: Path) -> List[int]:
    """The process generations that left record files in ``folder``, newest first."""
    found = {int(m.group(2)) for p in Path(folder).glob("rank*.g*.steps") if (m := _NAME.match(p.name))}
    return sorted(found, reverse=True)


def ranks_of(folder: Path, generation: int) -> List[int]:
    """The ranks of ``generation`` that have both record files in ``folder``."""
    out = []
    for p in Path(folder).glob(f"rank*.g{generation}.steps"):
        m = _NAME.match(p.name)
        if m and int(m.group(2)) == generation and p.with_suffix(".commits").exists():
            out.append(int(m.group(1)))
    return sorted(out)


def static_of(folder: Path, rank: int, generation: int) -> Dict[str, Any]:
    """The static part of ``rank``'s step file of ``generation`` (rank, world size, what the caller stored)."""
    f = RecordFile.open(Path(folder) / f"rank{rank}.g{generation}.steps")
    try:
        return dict(f.static)
    finally:
        f.close()


def pairs(
    folder: Path, rank: int, generation: int, with_tensors: bool = True
) -> Dict[int, Tuple[Record, Record]]:
    """``{step: (step record, commit record)}`` of ``rank``'s files of ``generation`` in ``folder``: every recorded
    step whose commit record is there (``with_tensors=False``: without the commit records' tensors). Raises
    ``RecordFileError`` for a damaged file."""
    base = Path(folder) / f"rank{rank}.g{generation}"
    step_file, commit_file = RecordFile.open(f"{base}.steps"), RecordFile.open(f"{base}.commits")
    try:
        commits = {r.key: _decoded(r) for r in commit_file.read(with_tensors)}
        found = {}
        for step in map(_decoded, step_file.read()):
            c = commits.get(step.meta["last_commit"])
            if c is not None:
                found[step.key] = (step, c)
        return found
    finally:
        step_file.close()
        commit_file.close()


def _decoded(record: Record) -> Record:
    return Record(record.key, decode(record.meta), record.tensors)


def clear(folder: Path, ranks: Sequence[int]) -> None:
    """Remove the record files of ``ranks`` (a fresh start: records of an earlier run are never resumed)."""
    for r in ranks:
        for path in folder.glob(f"rank{r}.g*.*"):
            if _NAME.match(path.name):
                path.unlink(missing_ok=True)
