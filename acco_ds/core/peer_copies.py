"""Each rank's records (``core.commit_records``) copied into the memory of a rank on another node, so that a lost
node costs at most one step: its ranks' committed state survives in their holders' memory.

The layout: the ranks of one node are those with the same node key (torchrun's ``GROUP_RANK``); nodes in the order
of their lowest rank form a ring; rank r's holder is the rank at r's position (modulo that node's size) on the next
node, and r's wards are the ranks whose holder it is (:func:`holders`). One node: no copies (nothing to survive on).

Contract:
- :class:`PeerCopies` runs one thread per rank with its own gloo group over all ranks (created collectively).
  The training thread hands it every recorded step (:meth:`PeerCopies.step_recorded`, the step record's pickled meta);
  for each step, in order, the thread waits for the round job in flight when the step was recorded (the link is
  the round's first: a copy sent beside it lengthens the round, most where the link is slow) and for the commit
  record the step names (written by the job's thread, ``MemoryState.after_job``), then sends its ward-side copy to
  the holder: a fixed-size message with the step, the commit's key and both records' pickled metas (their overflow
  in a message of its own), and the commit's tensors once per commit, sent from the commit record's own slot (no
  copy); and receives its wards' copies of the same step into record files of ``<folder>/held_by_rank<me>/``,
  named as the wards' own (``rank<w>.g<gen>.{commits,steps}``): a ward's tensors straight into the slot of its held
  commit record, which is completed once the exchange is through, before the held step record, so that a held
  step's commit is there whenever the step is.
- Every rank records the same steps in the same order and names the same commits (the steps and commit counts are
  global), so the sends and receives of a step pair up on every rank: no other agreement is needed.
- The copies of a rank are at most one commit behind its own records: ``MemoryState.after_job`` does not write
  commit k before the copies of every step naming commit k - 1 or older are exchanged, the wards' copies stored
  (:meth:`PeerCopies.wait_slot_free`; the job's thread waits there only when the copies are slower than a round).
  The exchange is symmetric, so a holder has stored its ward's step k - 1 before it writes its own commit k: its
  own records and its copy of the ward's always share a step, however an exchange in flight ends.
- The form of a commit's copy (:meth:`PeerCopies._form`, decided alike by the ward and its holder from what both
  know): with ``memory_state.peer_copy_form`` "inputs" (``core.commit_inputs``), the commit's AdamW inputs when the
  previous copy was of the commit before and the commit's step was the plain AdamW; the holder copies its held
  commit ``k - 1`` into the new record's slot, steps it there with the host AdamW, and completes the record only
  when the digest of the result is the one the ward sent (``commit_inputs.state_digest`` of its own record). It
  sends its verdict back; a mismatch abandons that record (the held copy stays at the commit before) and the pair
  sends the state from then on (logged on both sides). Otherwise, and for a process's first copy: the state.
- Bytes: the copies' sends and receives are counted (``bytes_sent``, ``bytes_received``): per step and rank, once
  per commit, 12 bytes per element of the shard for the state (fp32 master, exp_avg, exp_avg_sq), the gradient's
  element size (4 in fp32, 2 in bf16 and fp16) plus 40 bytes per group for the inputs; plus ``META_BYTES`` (and the
  metas' overflow past it), and 8 bytes of verdict per inputs copy.
"""

from __future__ import annotations

import logging
import queue
import struct
import threading
import time
from pathlib import Path
from typing import Dict, List, Sequence

import torch
import torch.distributed as dist

from acco_ds.core.comm import release_groups
from acco_ds.core.commit_inputs import state_digest, step_copy
from acco_ds.core.state_records import RecordFile
from acco_ds.ops.adamw import set_host_threads

logger = logging.getLogger(__name__)

HELD = "held_by_rank{}"
# one tag per message of a step: two sends outstanding to one peer on one tag can hang in gloo (seen with a short
# message before a long one)
_TAGS = {"fixed": 7741, "flat": 7742, "overflow": 7743, "verdict": 7744}
META_BYTES = 4096  # the fixed meta message of every step's copy (longer metas add a message)
_META_HEAD = struct.Struct("<qqQQqq")  # step, commit key, commit meta length, step meta length, form, digest
THREAD = "acco_ds-peer-copies"  # the name of the copies' thread
NO_COMMIT, STATE, INPUTS = 0, 1, 2  # a step's copy: no new commit, the commit's state, the commit's inputs


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
    ``group``: a gloo group over all ranks; ``holder``/``wards``: from :func:`holders`; ``executor``: the round jobs'
    (``core.comm``), whose job in flight at a step's record the step's copy waits for (None: no wait)."""

    def __init__(self, state, group, holder: int, wards: List[int], timeout_s: float, executor=None):
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
        self.commits_sent = {"state": 0, "inputs": 0}  # this rank's copies of commits, by form
        self.mismatches = 0  # wards' inputs whose step did not give their state (this rank as holder)
        self.seconds = 0.0  # the thread's time in its copies (the waits for the commits' records included)
        self.cpu_seconds = 0.0  # the CPU time the thread spent in them (time.thread_time)
        self.after_round_s = 0.0  # the thread's waits for the round job in flight at a step's record
        self.executor = executor
        self._held: Dict[int, tuple] = {}
        self._needed: List[int] = []  # the commits named by the steps handed over and not yet copied
        self._cond = threading.Condition()
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._sent_commit: int | None = None
        # inputs-form copies (core.commit_inputs): the wards' inputs received, the wards told to send the state, this
        # rank's switch to the state, and the holder's verdict on the last inputs sent
        self._inputs_in: Dict[int, torch.Tensor] = {}
        self._state_wards: set = set()
        self._to_state = False
        self._verdict_in = torch.zeros(1, dtype=torch.int64)
        self._verdict_out: Dict[int, torch.Tensor] = {}
        self._verdict_work = None
        self._thread = threading.Thread(target=self._loop, name=THREAD, daemon=True)
        self._thread.start()

    # -- the training thread and the job's thread --------------------------------------------------
    def step_recorded(self, step: int, commit: int, meta_blob: bytes, after=None) -> None:
        """Copy step ``step`` (its record's pickled meta ``meta_blob``, naming commit ``commit``) once that commit is
        recorded and the round job ``after`` (``core.comm.Ticket``: the job in flight when the step was recorded, or
        None) is over. Raises the thread's error."""
        self.check()
        with self._cond:
            self._needed.append(int(commit))
        self._queue.put((int(step), int(commit), meta_blob, after))

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
        set_host_threads(1)  # the inputs-form copies' host steps leave the cores to training
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    return
                *copy, after = item
                if after is not None and self.executor is not None:
                    t0 = time.perf_counter()
                    self.executor.wait_over(after, self.timeout_s)
                    self.after_round_s += time.perf_counter() - t0
                t0, c0 = time.perf_counter(), time.thread_time()
                self._copy(*copy)
                self.seconds += time.perf_counter() - t0
                self.cpu_seconds += time.thread_time() - c0
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
        """One step's exchange: to the holder, the fixed meta message (:func:`pack_metas`), the commit's copy when the
        step names a commit not sent yet (the same on every rank: the commits are global) in its form
        (:meth:`_form`), and the metas' overflow when they do not fit; from each ward the same: its state received
        straight into the slot of its held commit record, or its inputs, which step the held copy of the previous
        commit (:meth:`_store_stepped`)."""
        self._read_verdict()
        new_commit = key != self._sent_commit
        flat, commit_blob = self._own_commit(key) if new_commit else (None, b"")
        # the commit is recorded, its job over: only now is its form the holder's too (see _form)
        form = self._form(key, self._to_state) if new_commit else NO_COMMIT
        digest = 0
        if form == INPUTS:
            digest = state_digest(flat)
            flat = self.state.inputs.flat(key)
        if form != NO_COMMIT:
            self.commits_sent["inputs" if form == INPUTS else "state"] += 1
        fixed, rest = pack_metas(step, key, commit_blob, step_blob, form, digest)
        sends = self._send({"fixed": fixed, "flat": flat, "overflow": rest})
        if form == INPUTS:  # the holder's verdict on the copy it steps, read before the next commit's copy
            self.bytes_received += self._verdict_in.element_size()
            self._verdict_work = dist.irecv(
                self._verdict_in, src=self._global(self.holder), group=self.group, tag=_TAGS["verdict"]
            )
        fixed_in = {w: torch.empty(META_BYTES, dtype=torch.uint8) for w in self.wards}
        recvs = {w: self._receive(w, "fixed", fixed_in[w]) for w in self.wards}
        forms = {w: self._form(key, w in self._state_wards) if new_commit else NO_COMMIT for w in self.wards}
        for w in self.wards:
            if forms[w] == STATE:
                recvs[w] += self._receive(w, "flat", self._held_files(w)[0].begin(key))
            elif forms[w] == INPUTS:
                recvs[w] += self._receive(w, "flat", self._inputs_buffer(w))
        unpacked = {}
        for w in self.wards:
            recvs[w].pop(
                0
            ).wait()  # the ward's fixed message: it says whether metas overflow (a work is waited once)
            wstep, wkey, clen, _, wform, wdigest, head, over = unpack_metas(fixed_in[w])
            if (wstep, wkey) != (step, key):
                raise PeerCopyError(
                    f"rank {w} sent step {wstep} (commit {wkey}) while this rank copies step {step} (commit {key})"
                )
            if wform != forms[w] or new_commit != bool(clen):
                raise PeerCopyError(
                    f"rank {w} sent step {step} in form {wform} (commit meta {clen} bytes) where this rank expects "
                    f"form {forms[w]} (0: no commit, 1: the state, 2: the inputs)"
                )
            extra = torch.empty(over, dtype=torch.uint8)
            recvs[w] += self._receive(w, "overflow", extra)
            unpacked[w] = (clen, head, extra, wdigest)
        for work in sends + [x for works in recvs.values() for x in works]:
            work.wait()
        self._sent_commit = key
        verdicts = []
        for w, (clen, head, extra, wdigest) in unpacked.items():
            blob = head + extra.numpy().tobytes()
            commits, steps = self._held_files(w)
            if forms[w] == STATE:
                commits.finish(key, blob[:clen])
            elif forms[w] == INPUTS:
                verdicts.append(self._store_stepped(w, key, blob[:clen], wdigest))
            steps.begin(step)
            steps.finish(step, blob[clen:])
        for work in verdicts:
            work.wait()
        self.steps_copied += 1
        with self._cond:  # only now: the holder may have this step only once the exchange is through
            self._needed.remove(key)
            self._cond.notify_all()

    def _form(self, key: int, as_state: bool) -> int:
        """The form of commit ``key``'s copy between a ward and its holder, decided alike on both sides: the inputs
        when the form is configured, the pair has not switched to the state (``as_state``), the previous copy was of
        commit ``key - 1`` (the holder's base) and commit ``key`` has inputs (its step was the plain AdamW: the same
        job on every rank, so this rank's own slot says it for the ward's too). Only once this rank's commit record
        ``key`` is written: before, the commit's job may still be capturing its inputs (a step is recorded while its
        commit is in flight), and the two sides would decide at different points of it."""
        inputs = self.state.inputs
        if inputs is None or as_state or self._sent_commit != key - 1 or not inputs.has(key):
            return STATE
        return INPUTS

    def _store_stepped(self, ward: int, key: int, commit_blob: bytes, digest: int):
        """Step the held copy of ``ward``'s commit ``key - 1`` with the inputs received into a new held record of
        commit ``key``; complete it when its digest is the ward's, else abandon it and switch the pair's copies to
        the state. Returns the work of the verdict sent to the ward."""
        commits, _ = self._held_files(ward)
        base = commits.view(key - 1)
        if base is None:
            raise PeerCopyError(f"the copy of rank {ward} holds no commit {key - 1} to step to commit {key}")
        flat = commits.begin(key)
        flat.copy_(base[0])
        step_copy(flat, self._inputs_buffer(ward), self.state.inputs.layout)
        mine = state_digest(flat)
        ok = mine == digest
        if ok:
            commits.finish(key, commit_blob)
        else:
            commits.abandon(key)
            self._state_wards.add(ward)
            self.mismatches += 1
            logger.warning(
                "acco_ds: memory_state: the host AdamW's step of rank %d's copy to commit %d does not give rank "
                "%d's state (digest %d, not %d); its copies are sent as the state from now on "
                "(memory_state.peer_copy_form='state' does so from the start)",
                ward, key, ward, mine, digest,
            )  # fmt: skip
        out = self._verdict_out.setdefault(ward, torch.zeros(1, dtype=torch.int64))
        out[0] = 0 if ok else 1
        self.bytes_sent += out.element_size()
        return dist.isend(out, dst=self._global(ward), group=self.group, tag=_TAGS["verdict"])

    def _read_verdict(self) -> None:
        """The holder's verdict on the last copy sent as inputs: a mismatch switches this rank's copies to the state."""
        if self._verdict_work is None:
            return
        self._verdict_work.wait()
        self._verdict_work = None
        if int(self._verdict_in[0]) != 0 and not self._to_state:
            self._to_state = True
            logger.warning(
                "acco_ds: memory_state: rank %d's step of this rank's copy did not give this rank's state; the "
                "copies are sent as the state from now on",
                self.holder,
            )

    def _inputs_buffer(self, ward: int) -> torch.Tensor:
        buf = self._inputs_in.get(ward)
        if buf is None:
            buf = self._inputs_in[ward] = torch.empty(self.state.inputs.layout.nbytes, dtype=torch.uint8)
        return buf

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


def pack_metas(step: int, key: int, commit_blob: bytes, step_blob: bytes, form: int = STATE, digest: int = 0):
    """``(fixed, rest)``: the fixed-size uint8 message of one step's copy (step, commit key, the two pickled metas'
    lengths, the copy's form and the digest of the state its inputs give, then as much of the metas as fits) and the
    metas' overflow (empty when they fit)."""
    body = commit_blob + step_blob
    room = META_BYTES - _META_HEAD.size
    fixed = bytearray(META_BYTES)
    _META_HEAD.pack_into(fixed, 0, step, key, len(commit_blob), len(step_blob), form, digest)
    fixed[_META_HEAD.size : _META_HEAD.size + min(room, len(body))] = body[:room]
    rest = bytearray(body[room:])
    as_tensor = torch.frombuffer(rest, dtype=torch.uint8) if rest else torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(fixed, dtype=torch.uint8), as_tensor


def unpack_metas(fixed: torch.Tensor):
    """``(step, key, commit_len, step_len, form, digest, head, overflow)`` of a fixed message: ``head`` the metas'
    bytes it holds, ``overflow`` the number of bytes that follow in a message of their own."""
    raw = fixed.numpy().tobytes()
    step, key, clen, slen, form, digest = _META_HEAD.unpack_from(raw, 0)
    room = META_BYTES - _META_HEAD.size
    head = raw[_META_HEAD.size : _META_HEAD.size + min(room, clen + slen)]
    return step, key, clen, slen, form, digest, head, max(0, clen + slen - room)
