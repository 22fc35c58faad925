"""Each rank's records (``core.commit_records``) copied into the memory of a rank on another node, so that a lost
node costs at most one step: its ranks' committed state survives in their holders' memory.

The layout: the ranks of one node are those with the same node key (torchrun's ``GROUP_RANK``); nodes in the order
of their lowest rank form a ring; rank r's holder is the rank at r's position (modulo that node's size) on the next
node, and r's wards are the ranks whose holder it is (:func:`holders`). One node: no copies (nothing to survive on).

Contract:
- :class:`PeerCopies` runs one thread per rank with its own gloo group over all ranks (created collectively).
  The training thread hands it every recorded step (:meth:`PeerCopies.step_recorded`, the step record's meta);
  for each step, in order, the thread waits for the commit record the step names (written by the job's thread,
  ``MemoryState.after_job``), then sends its ward-side copy to the holder: the commit's tensors (once per commit)
  and meta, and the step's meta; and receives its wards' copies of the same step into record files of
  ``<folder>/held_by_rank<me>/``, named as the wards' own (``rank<w>.g<gen>.{commits,steps}``), written commit first,
  so that a held step's commit is there whenever the step is.
- Every rank records the same steps in the same order and names the same commits (the steps and commit counts are
  global), so the sends and receives of a step pair up on every rank: no other agreement is needed.
- The copies of a rank are at most one commit behind its own records: ``MemoryState.after_job`` does not write
  commit k before the copies of every step naming commit k - 1 or older are exchanged, the wards' copies stored
  (:meth:`PeerCopies.wait_slot_free`; the job's thread waits there only when the copies are slower than a round).
  The exchange is symmetric, so a holder has stored its ward's step k - 1 before it writes its own commit k: its
  own records and its copy of the ward's always share a step, however an exchange in flight ends.
- Bytes: the copies' sends and receives are counted (``bytes_sent``, ``bytes_received``): per step and rank,
  12 bytes per element of the shard (fp32 master, exp_avg, exp_avg_sq) once per commit, plus the metas.
"""

from __future__ import annotations

import pickle
import queue
import threading
import time
from pathlib import Path
from typing import Dict, List, Sequence

import torch
import torch.distributed as dist

from acco_ds.core.comm import release_groups
from acco_ds.core.state_records import RecordFile

HELD = "held_by_rank{}"
_TAG = 7741


def holders(node_keys: Sequence) -> Dict[int, int]:
    """``{rank: holder}`` for the ranks whose node key is ``node_keys[rank]`` (see the module docstring); empty
    when all ranks are on one node."""
    nodes: Dict = {}
    for r, key in enumerate(node_keys):
        nodes.setdefault(key, []).append(r)
    order = sorted(nodes.values(), key=min)
    if len(order) < 2:
        return {}
    out = {}
    for i, ranks in enumerate(order):
        nxt = order[(i + 1) % len(order)]
        for pos, r in enumerate(ranks):
            out[r] = nxt[pos % len(nxt)]
    return out


class PeerCopyError(RuntimeError):
    """The copies could not keep up or their exchange failed (names the step, the peer and the cause)."""


class PeerCopies:
    """This rank's side of the copies (see the module docstring). ``state``: the rank's ``MemoryState``;
    ``group``: a gloo group over all ranks; ``holder``/``wards``: from :func:`holders`."""

    def __init__(self, state, group, holder: int, wards: List[int], timeout_s: float):
        self.state = state
        self.group = group
        self.holder = holder
        self.wards = list(wards)
        self.timeout_s = float(timeout_s)
        self.numels = list(state.commits.numels)
        self.folder = Path(state.folder) / HELD.format(state.rank)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.steps_copied = 0
        self.seconds = 0.0  # the thread's time in its copies (the waits for the commits' records included)
        self._held: Dict[int, tuple] = {}
        self._needed: List[int] = []  # the commits named by the steps handed over and not yet copied
        self._cond = threading.Condition()
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._sent_commit: int | None = None
        self._thread = threading.Thread(target=self._loop, name="acco_ds-peer-copies", daemon=True)
        self._thread.start()

    # -- the training thread and the job's thread --------------------------------------------------
    def step_recorded(self, step: int, meta: dict) -> None:
        """Copy step ``step`` (its record's ``meta``) once its commit is recorded. Raises the thread's error."""
        self.check()
        with self._cond:
            self._needed.append(meta["last_commit"])
        self._queue.put((int(step), meta))

    def commit_recorded(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def wait_slot_free(self, key: int) -> None:
        """Block until no step that names commit ``key - 1`` or older is still to be copied (exchanged, the wards'
        copies stored): the slot commit ``key`` reuses holds commit ``key - 2``, and the copies stay at most one commit
        behind the rank's own records.
        Raises :class:`PeerCopyError` after ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while any(c <= key - 1 for c in self._needed):
                self.check()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerCopyError(
                        f"acco_ds: commit {key - 2} was not copied to rank {self.holder} within {self.timeout_s:g} s "
                        "(optimizer.params.comm_timeout_s): the copies cannot keep up with the commits"
                    )
                self._cond.wait(min(left, 0.5))

    def check(self) -> None:
        if self._error is not None:
            raise PeerCopyError(
                f"acco_ds: the copies to rank {self.holder} failed: {self._error}"
            ) from self._error

    def close(self) -> None:
        """End the copies' thread, then release its group (``core.comm.release_groups``)."""
        self._queue.put(None)
        self._thread.join(timeout=self.timeout_s)
        if release_groups([self.group], busy=self._thread.is_alive()):
            self.group = None

    # -- the copies' thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    return
                t0 = time.perf_counter()
                self._copy(*item)
                self.seconds += time.perf_counter() - t0
        except BaseException as err:  # noqa: BLE001 - reported to the training thread by check()
            self._error = err
            with self._cond:
                self._cond.notify_all()

    def _own_commit(self, key: int):
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while True:
                newest = self.state.commits.newest_key()
                if newest is not None and newest >= key:
                    found = self.state.commits.read(key=key)
                    if not found:
                        raise PeerCopyError(f"commit {key} left its slot before it was copied")
                    return found[0]
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerCopyError(f"commit {key} was not recorded within {self.timeout_s:g} s")
                self._cond.wait(min(left, 0.2))

    def _copy(self, step: int, meta: dict) -> None:
        key = meta["last_commit"]
        new_commit = key != self._sent_commit
        commit = self._own_commit(key) if new_commit else None
        commit_blob = pickle.dumps(commit.meta) if commit is not None else b""
        step_blob = pickle.dumps(meta)
        header = torch.tensor([int(new_commit), len(commit_blob), len(step_blob), step], dtype=torch.int64)
        headers = {w: torch.empty(4, dtype=torch.int64) for w in self.wards}
        self._exchange([header], {w: [h] for w, h in headers.items()})
        flat = torch.cat([t.reshape(-1) for t in commit.tensors]) if commit is not None else torch.empty(0)
        blob = torch.frombuffer(bytearray(commit_blob + step_blob), dtype=torch.uint8)
        recv = {}
        for w, h in headers.items():
            has, clen, slen, wstep = (int(x) for x in h)
            if wstep != step:
                raise PeerCopyError(f"rank {w} sent step {wstep} while this rank copies step {step}")
            recv[w] = [
                torch.empty(sum(self.numels) if has else 0),
                torch.empty(clen + slen, dtype=torch.uint8),
            ]
        self._exchange([flat, blob], recv)
        self._sent_commit = key
        for w, (wflat, wblob) in recv.items():
            has, clen, _, _ = (int(x) for x in headers[w])
            raw = wblob.numpy().tobytes()
            self._store(w, step, wflat if has else None, raw[:clen], raw[clen:])
        self.steps_copied += 1
        with self._cond:  # only now: the holder may have this step only once the exchange is through
            self._needed.remove(key)
            self._cond.notify_all()

    def _exchange(self, send: List[torch.Tensor], recv: Dict[int, List[torch.Tensor]]) -> None:
        works = []
        for t in send:
            if t.numel():
                works.append(dist.isend(t, dst=self._global(self.holder), group=self.group, tag=_TAG))
                self.bytes_sent += t.numel() * t.element_size()
        for w, tensors in recv.items():
            for t in tensors:
                if t.numel():
                    works.append(dist.irecv(t, src=self._global(w), group=self.group, tag=_TAG))
                    self.bytes_received += t.numel() * t.element_size()
        for work in works:
            work.wait()

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank)

    def _store(self, ward: int, step: int, flat, commit_blob: bytes, step_blob: bytes) -> None:
        files = self._held.get(ward)
        if files is None:
            gen = self.state.generation
            static = {**self.state.ward_static(ward), "held_by": self.state.rank}
            base = self.folder / f"rank{ward}.g{gen}"
            files = (
                RecordFile.create(f"{base}.commits", self.numels, static),
                RecordFile.create(f"{base}.steps", [], static),
            )
            self._held[ward] = files
        commits, steps = files
        step_meta = pickle.loads(step_blob)
        if flat is not None:
            commits.write(step_meta["last_commit"], list(flat.split(self.numels)), pickle.loads(commit_blob))
        steps.write(step, [], step_meta)
