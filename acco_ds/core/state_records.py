"""Records in node memory that outlive the process: the rank's committed optimizer state after each commit.

A :class:`RecordFile` is one file in a tmpfs folder (``/dev/shm`` by default: the node's memory, kept when the
process dies, gone when the node does) with a header, a static part written once and two slots; each slot holds
one record: a small pickled dict and a fixed list of fp32 tensors (their sizes fixed when the file is made).

Contract:
- One writer per file (the thread that calls :meth:`RecordFile.write`); readers are other processes, or the
  same rank's next process after a crash. ``write(key, tensors, meta)`` fills the slot not holding the newest
  record: it marks the slot as being written, copies the tensors and the pickled ``meta``, then marks it complete
  with ``key``. A process killed in the middle leaves the other slot, the previous record, complete and
  readable: the marks are plain stores into shared pages, so everything the writer stored before it died is
  there, in order, and a torn slot is never marked complete.
- A write in two parts, for tensors that arrive into the slot itself (a receive): :meth:`RecordFile.begin` marks the
  free slot as being written and returns its flat fp32 view, :meth:`RecordFile.finish` stores the pickled meta and
  marks it complete. Between the two the writer fills the view; nothing else writes to the file.
  :meth:`RecordFile.abandon` gives a begun record up (it is never read).
- :meth:`RecordFile.read` returns the complete records, newest ``key`` first, as copies; a record whose slot was
  rewritten while it was read (a live writer) is left out, not returned torn. :meth:`RecordFile.view` returns
  the writer's own complete record without a copy: valid only while the writer does not rewrite that slot (the
  caller holds the next-but-one write back).
- Keys increase: a write with a key not above the newest record's is refused (a record one commit behind is a
  bug, never silently kept).
- The tensors are written from whatever device they are on (``copy_`` into the mapped pages: from CUDA this is a
  synchronous copy on the calling thread's current stream).
"""

from __future__ import annotations

import mmap
import os
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Sequence

import torch

MAGIC = b"ACCOREC1"
_HEADER = struct.Struct("<8sQQQQ")  # magic, static length, meta capacity, number of tensors, total elements
_SLOT = struct.Struct("<QqQ")  # sequence (odd while being written), key, meta length
HEADER_BYTES = 4096
SLOT_HEADER_BYTES = 64
ALIGN = 4096
NUM_SLOTS = 2


class RecordFileError(ValueError):
    """A record file that does not match what the reader expects (another layout, damaged, not a record file)."""


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class Record:
    """One complete record: its key, its meta dict and its tensors (CPU fp32 copies)."""

    key: int
    meta: Dict[str, Any]
    tensors: List[torch.Tensor]


class RecordFile:
    """One rank's record file (see the module docstring). Make it with :meth:`create` (the writer) or
    :meth:`open` (a reader, or the writer's next process)."""

    def __init__(
        self, path: Path, mm: mmap.mmap, static: Dict[str, Any], meta_capacity: int, numels: List[int]
    ):
        self.path = path
        self._mm = mm
        self.static = static
        self.meta_capacity = meta_capacity
        self.numels = list(numels)
        static_bytes = _aligned(len(pickle.dumps(static)))
        self._slot_offsets = []
        self._slot_bytes = _aligned(SLOT_HEADER_BYTES + meta_capacity) + _aligned(4 * sum(numels))
        first = HEADER_BYTES + static_bytes
        for s in range(NUM_SLOTS):
            self._slot_offsets.append(first + s * self._slot_bytes)
        self._flats = [self._flat_view(s) for s in range(NUM_SLOTS)]
        self._views = [self._tensor_views(s) for s in range(NUM_SLOTS)]
        self._open: tuple | None = None  # (slot, seq, key) of a write begun and not finished

    # -- making and opening ------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        path: str | os.PathLike,
        numels: Sequence[int],
        static: Dict[str, Any],
        meta_capacity: int = 1 << 20,
    ) -> RecordFile:
        """A new, empty record file at ``path`` (an existing one is replaced) for tensors of ``numels`` fp32
        elements, with ``static`` (a picklable dict) stored once and room for ``meta_capacity`` bytes of pickled
        meta per record."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        blob = pickle.dumps(static)
        static_bytes = _aligned(len(blob))
        slot_bytes = _aligned(SLOT_HEADER_BYTES + meta_capacity) + _aligned(4 * sum(numels))
        size = HEADER_BYTES + static_bytes + NUM_SLOTS * slot_bytes
        tmp = path.with_name(path.name + ".new")
        with open(tmp, "w+b") as f:
            f.truncate(size)
            mm = mmap.mmap(f.fileno(), size)
        mm[HEADER_BYTES : HEADER_BYTES + len(blob)] = blob
        _HEADER.pack_into(mm, 0, MAGIC, len(blob), meta_capacity, len(numels), sum(numels))
        numel_table = struct.pack(f"<{len(numels)}Q", *numels)
        if _HEADER.size + len(numel_table) > HEADER_BYTES:
            raise RecordFileError(f"{path}: {len(numels)} tensors do not fit a record file's header")
        mm[_HEADER.size : _HEADER.size + len(numel_table)] = numel_table
        os.replace(tmp, path)
        return cls(path, mm, static, meta_capacity, list(numels))

    @classmethod
    def open(cls, path: str | os.PathLike) -> RecordFile:
        """The record file at ``path`` (mapped shared: a reader sees a live writer's stores, which the torn-read
        check needs); raises :class:`RecordFileError` naming the file when it is not one."""
        path = Path(path)
        try:
            with open(path, "r+b") as f:
                size = os.fstat(f.fileno()).st_size
                if size < HEADER_BYTES:
                    raise RecordFileError(f"{path}: {size} bytes, too short for a record file")
                mm = mmap.mmap(f.fileno(), size)
        except OSError as err:
            raise RecordFileError(f"{path}: cannot open the record file: {err}") from err
        magic, static_len, meta_capacity, count, total = _HEADER.unpack_from(mm, 0)
        if magic != MAGIC:
            raise RecordFileError(f"{path}: not an acco_ds record file (magic {magic!r})")
        numels = list(struct.unpack_from(f"<{count}Q", mm, _HEADER.size))
        if sum(numels) != total:
            raise RecordFileError(f"{path}: damaged header (tensor sizes sum to {sum(numels)}, not {total})")
        try:
            static = pickle.loads(mm[HEADER_BYTES : HEADER_BYTES + static_len])
        except Exception as err:  # noqa: BLE001 - any unpickling failure is a damaged file
            raise RecordFileError(f"{path}: damaged static part: {err}") from err
        out = cls(path, mm, static, meta_capacity, numels)
        expected = out._slot_offsets[-1] + out._slot_bytes
        if size < expected:
            raise RecordFileError(f"{path}: {size} bytes, its layout needs {expected}")
        return out

    def close(self) -> None:
        self._views, self._flats = [], []
        self._mm.close()

    # -- slots -------------------------------------------------------------------------------------
    def _flat_view(self, slot: int) -> torch.Tensor:
        start = self._slot_offsets[slot] + _aligned(SLOT_HEADER_BYTES + self.meta_capacity)
        total = sum(self.numels)
        if total == 0:
            return torch.empty(0, dtype=torch.float32)
        return torch.frombuffer(self._mm, dtype=torch.float32, count=total, offset=start)

    def _tensor_views(self, slot: int) -> List[torch.Tensor]:
        if not self.numels:
            return []
        return list(self._flats[slot].split(self.numels))

    def _slot_header(self, slot: int):
        return _SLOT.unpack_from(self._mm, self._slot_offsets[slot])

    def _newest(self):
        """(slot, seq, key) of the newest complete record, or None."""
        best = None
        for s in range(NUM_SLOTS):
            seq, key, _ = self._slot_header(s)
            if seq > 0 and seq % 2 == 0 and (best is None or key > best[2]):
                best = (s, seq, key)
        return best

    def newest_key(self) -> int | None:
        newest = self._newest()
        return None if newest is None else newest[2]

    def write(self, key: int, tensors: Sequence[torch.Tensor], meta: Dict[str, Any]) -> None:
        """Store a record under ``key`` (see the module docstring). ``tensors`` match the file's sizes."""
        self.write_blob(key, tensors, pickle.dumps(meta))

    def write_blob(self, key: int, tensors: Sequence[torch.Tensor], meta_blob: bytes) -> None:
        """:meth:`write` with the meta already pickled (``meta_blob``)."""
        if len(tensors) != len(self.numels):
            raise RecordFileError(f"{self.path}: {len(tensors)} tensors for a file of {len(self.numels)}")
        for i, (t, n) in enumerate(zip(tensors, self.numels)):
            if t.numel() != n:
                raise RecordFileError(f"{self.path}: tensor {i} has {t.numel()} elements, the file holds {n}")
        blob = meta_blob
        self._check_meta(len(blob))
        self.begin(key)
        slot = self._open[0]
        with torch.no_grad():
            for view, t in zip(self._views[slot], tensors):
                view.copy_(t.detach().reshape(-1))
        self.finish(key, blob)

    def _check_meta(self, size: int) -> None:
        if size > self.meta_capacity:
            raise RecordFileError(
                f"{self.path}: a record's meta of {size} bytes exceeds the file's {self.meta_capacity}"
            )

    def begin(self, key: int) -> torch.Tensor:
        """Begin the record ``key``: mark the slot not holding the newest record as being written and return its
        flat fp32 view (``sum(numels)`` elements, the tensors back to back) for the caller to fill; the slot's
        previous record is no longer readable. :meth:`finish` completes it."""
        if self._open is not None:
            raise RecordFileError(f"{self.path}: record {self._open[2]} was begun and not finished")
        newest = self._newest()
        if newest is not None and key <= newest[2]:
            raise RecordFileError(
                f"{self.path}: record {key} is not newer than the newest held ({newest[2]})"
            )
        slot = 0 if newest is None else 1 - newest[0]
        seq, _, _ = self._slot_header(slot)
        seq = seq + 1 if seq % 2 == 0 else seq  # odd: being written
        _SLOT.pack_into(self._mm, self._slot_offsets[slot], seq, key, 0)
        self._open = (slot, seq, key)
        return self._flats[slot]

    def finish(self, key: int, meta_blob: bytes) -> None:
        """Complete the record :meth:`begin` began under ``key`` with ``meta_blob`` (the pickled meta dict)."""
        if self._open is None or self._open[2] != key:
            raise RecordFileError(f"{self.path}: record {key} was not begun")
        self._check_meta(len(meta_blob))
        slot, seq, _ = self._open
        offset = self._slot_offsets[slot]
        meta_at = offset + SLOT_HEADER_BYTES
        self._mm[meta_at : meta_at + len(meta_blob)] = meta_blob
        _SLOT.pack_into(self._mm, offset, seq + 1, key, len(meta_blob))  # even: complete
        self._open = None

    def abandon(self, key: int) -> None:
        """Give up the record :meth:`begin` began under ``key``: its slot stays marked as being written (never read),
        the newest complete record stays the newest, and the next :meth:`begin` takes the same slot."""
        if self._open is None or self._open[2] != key:
            raise RecordFileError(f"{self.path}: record {key} was not begun")
        self._open = None

    def view(self, key: int) -> tuple | None:
        """``(flat, meta_blob)`` of the complete record ``key`` without a copy (see the module docstring), or None
        when no complete record has that key."""
        for s in range(NUM_SLOTS):
            seq, skey, meta_len = self._slot_header(s)
            if seq > 0 and seq % 2 == 0 and skey == key:
                meta_at = self._slot_offsets[s] + SLOT_HEADER_BYTES
                return self._flats[s], bytes(self._mm[meta_at : meta_at + meta_len])
        return None

    def read(self, with_tensors: bool = True, key: int | None = None) -> List[Record]:
        """The complete records, newest first (copies; see the module docstring); ``with_tensors=False``: their
        keys and meta only (empty tensor lists); ``key``: only the record of that key (an empty list without one)."""
        found = []
        wanted = key
        for s in range(NUM_SLOTS):
            seq, key, meta_len = self._slot_header(s)
            if seq == 0 or seq % 2 or (wanted is not None and key != wanted):
                continue
            meta_at = self._slot_offsets[s] + SLOT_HEADER_BYTES
            blob = bytes(self._mm[meta_at : meta_at + meta_len])
            tensors = [v.clone() for v in self._views[s]] if with_tensors else []
            if self._slot_header(s) != (seq, key, meta_len):
                continue  # rewritten while read
            try:
                meta = pickle.loads(blob)
            except Exception as err:  # noqa: BLE001 - a complete slot that does not unpickle is damage
                raise RecordFileError(f"{self.path}: record {key} is damaged: {err}") from err
            found.append(Record(key, meta, tensors))
        return sorted(found, key=lambda r: r.key, reverse=True)
