"""Each rank's records (``core.commit_records``) copied into the memory of a rank on another node, so that a lost
node costs at most one step: its ranks' committed state survives in their holders' memory.

The layout: the ranks of one node are those with the same node key (torchrun's ``GROUP_RANK``); nodes in the order
of their lowest rank form a ring; rank r's holder is the rank at r's position (modulo that node's size) on the next
node, and r's wards are the ranks whose holder it is (:func:`holders`). One node: no copies (nothing to survive on).

Contract:
- :class:`PeerCopies` runs one thread per rank with its own gloo group over all ranks (created collectively).
  The training thread hands it every recorded step (:meth:`PeerCopies.step_recorded`, the step record's pickled meta);
  for each step, in order, the thread waits for the commit record the step names (written by the job's thread,
  ``MemoryState.after_job``), then sends its ward-side copy to the holder: a fixed-size message with the step, the
  commit's key and both records' pickled metas (their overflow in a message of its own), and the commit's tensors
  once per commit, sent from the commit record's own slot (no copy); and receives its wards' copies of the same
  step into record files of ``<folder>/held_by_rank<me>/``, named as the wards' own
  (``rank<w>.g<gen>.{commits,steps}``): a ward's tensors straight into the slot of its held commit record, which is
  completed once the exchange is through, before the held step record, so that a held step's commit is there
  whenever the step is.
- Every rank records the same steps in the same order and names the same commits (the steps and commit counts are
  global), so the sends and receives of a step pair up on every rank: no other agreement is needed.
- The copies of a rank are at most one commit behind its own records: ``MemoryState.after_job`` does not write
  commit k before the copies of every step naming commit k - 1 or older are exchanged, the wards' copies stored
  (:meth:`PeerCopies.wait_slot_free`; the job's thread waits there only when the copies are slower than a round).
  The exchange is symmetric, so a holder has stored its ward's step k - 1 before it writes its own commit k: its
  own records and its copy of the ward's always share a step, however an exchange in flight ends.
- Bytes: the copies' sends and receives are counted (``bytes_sent``, ``bytes_received``): per step and rank,
  12 bytes per element of the shard (fp32 master, exp_avg, exp_avg_sq) once per commit, plus ``META_BYTES`` (and
  the metas' overflow past it).
"""

from __future__ import annotations

import queue
import struct
import threading
import time
from pathlib import Path
from typing import Dict, List, Sequence

import torch
import torch.distributed as dist

from acco_ds.core.comm import release_groups
from acco_ds.core.state_records import RecordFile

HELD = "held_by_rank{}"
# one tag per message of a step: two sends outstanding to one peer on one tag can hang in gloo (seen with a short
# message before a long one)
_TAGS = {"fixed": 7741, "flat": 7742, "overflow": 7743}
META_BYTES = 4096  # the fixed meta message of every step's copy (longer metas add a message)
_META_HEAD = struct.Struct("<qqQQ")  # step, commit key, commit meta length, step meta length


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
    def step_recorded(self, step: int, commit: int, meta_blob: bytes) -> None:
        """Copy step ``step`` (its record's pickled meta ``meta_blob``, naming commit ``commit``) once that commit is
        recorded. Raises the thread's error."""
        self.check()
        with self._cond:
            self._needed.append(int(commit))
        self._queue.put((int(step), int(commit), meta_blob))

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
        """``(flat, meta_blob)`` of this rank's commit record ``key``, a view of its slot (no copy): the slot is not
        rewritten before this copy is through (:meth:`wait_slot_free`)."""
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while True:
                newest = self.state.commits.newest_key()
                if newest is not None and newest >= key:
                    found = self.state.commits.view(key)
                    if found is None:
                        raise PeerCopyError(f"commit {key} left its slot before it was copied")
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerCopyError(f"commit {key} was not recorded within {self.timeout_s:g} s")
                self._cond.wait(min(left, 0.2))

    def _copy(self, step: int, key: int, step_blob: bytes) -> None:
        """One step's exchange: to the holder, the fixed meta message (:func:`pack_metas`), the commit's flat state
        when the step names a commit not sent yet (the same on every rank: the commits are global), and the metas'
        overflow when they do not fit; from each ward the same, its flat state received straight into the slot of
        its held commit record."""
        new_commit = key != self._sent_commit
        flat, commit_blob = self._own_commit(key) if new_commit else (None, b"")
        fixed, rest = pack_metas(step, key, commit_blob, step_blob)
        sends = self._send({"fixed": fixed, "flat": flat if new_commit else None, "overflow": rest})
        fixed_in = {w: torch.empty(META_BYTES, dtype=torch.uint8) for w in self.wards}
        recvs = {w: self._receive(w, "fixed", fixed_in[w]) for w in self.wards}
        if new_commit:
            for w in self.wards:
                recvs[w] += self._receive(w, "flat", self._held_files(w)[0].begin(key))
        unpacked = {}
        for w in self.wards:
            recvs[w].pop(
                0
            ).wait()  # the ward's fixed message: it says whether metas overflow (a work is waited once)
            wstep, wkey, clen, _, head, over = unpack_metas(fixed_in[w])
            if (wstep, wkey) != (step, key):
                raise PeerCopyError(
                    f"rank {w} sent step {wstep} (commit {wkey}) while this rank copies step {step} (commit {key})"
                )
            if new_commit != bool(clen):
                raise PeerCopyError(
                    f"rank {w} and this rank disagree on whether step {step} brings commit {key}"
                )
            extra = torch.empty(over, dtype=torch.uint8)
            recvs[w] += self._receive(w, "overflow", extra)
            unpacked[w] = (clen, head, extra)
        for work in sends + [x for works in recvs.values() for x in works]:
            work.wait()
        self._sent_commit = key
        for w, (clen, head, extra) in unpacked.items():
            blob = head + extra.numpy().tobytes()
            commits, steps = self._held_files(w)
            if new_commit:
                commits.finish(key, blob[:clen])
            steps.begin(step)
            steps.finish(step, blob[clen:])
        self.steps_copied += 1
        with self._cond:  # only now: the holder may have this step only once the exchange is through
            self._needed.remove(key)
            self._cond.notify_all()

    def _send(self, messages: Dict[str, torch.Tensor | None]) -> list:
        """Post the sends of ``messages`` (``{kind: tensor}``, the empty ones and None left out) to the holder, each on
        its kind's tag; their works, not waited."""
        works = []
        for kind, t in messages.items():
            if t is not None and t.numel():
                works.append(dist.isend(t, dst=self._global(self.holder), group=self.group, tag=_TAGS[kind]))
                self.bytes_sent += t.numel() * t.element_size()
        return works

    def _receive(self, ward: int, kind: str, t: torch.Tensor) -> list:
        """Post the receive of ``t`` from ``ward`` on ``kind``'s tag (nothing when empty); its work in a list, not
        waited."""
        if not t.numel():
            return []
        self.bytes_received += t.numel() * t.element_size()
        return [dist.irecv(t, src=self._global(ward), group=self.group, tag=_TAGS[kind])]

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank)

    def _held_files(self, ward: int):
        """``(commits, steps)``: the record files of ``ward``'s copy, made on first use."""
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
        return files


def pack_metas(step: int, key: int, commit_blob: bytes, step_blob: bytes):
    """``(fixed, rest)``: the fixed-size uint8 message of one step's copy (step, commit key, the two pickled metas'
    lengths, then as much of the metas as fits) and the metas' overflow (empty when they fit)."""
    body = commit_blob + step_blob
    room = META_BYTES - _META_HEAD.size
    fixed = bytearray(META_BYTES)
    _META_HEAD.pack_into(fixed, 0, step, key, len(commit_blob), len(step_blob))
    fixed[_META_HEAD.size : _META_HEAD.size + min(room, len(body))] = body[:room]
    rest = bytearray(body[room:])
    as_tensor = torch.frombuffer(rest, dtype=torch.uint8) if rest else torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(fixed, dtype=torch.uint8), as_tensor


def unpack_metas(fixed: torch.Tensor):
    """``(step, key, commit_len, step_len, head, overflow)`` of a fixed message: ``head`` the metas' bytes it holds,
    ``overflow`` the number of bytes that follow in a message of their own."""
    raw = fixed.numpy().tobytes()
    step, key, clen, slen = _META_HEAD.unpack_from(raw, 0)
    room = META_BYTES - _META_HEAD.size
    head = raw[_META_HEAD.size : _META_HEAD.size + min(room, clen + slen)]
    return step, key, clen, slen, head, max(0, clen + slen - room)
