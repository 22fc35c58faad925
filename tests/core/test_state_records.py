"""``acco_ds.core.state_records``: the two-slot record files in node memory that outlive the process.

A writer killed (SIGKILL) at random points of a stream of writes always leaves its newest complete record whole
and readable, never a torn one; keys must increase; bad files and bad writes are refused naming the file."""

from __future__ import annotations

import os
import pickle
import signal
import time

import pytest
import torch

from acco_ds.core import commit_records
from acco_ds.core.state_records import RecordFile, RecordFileError

NUMELS = [5, 0, 17]


def _tensors(key: int):
    return [torch.full((n,), float(key)) for n in NUMELS]


def test_round_trip_keeps_the_two_newest(tmp_path):
    f = RecordFile.create(tmp_path / "r", NUMELS, {"world_size": 2})
    assert f.read() == [] and f.newest_key() is None
    for key in (3, 4, 7):
        f.write(key, _tensors(key), {"key": key})
    got = RecordFile.open(tmp_path / "r").read()
    assert [r.key for r in got] == [7, 4]
    for r in got:
        assert r.meta == {"key": r.key}
        assert all(torch.equal(t, e) for t, e in zip(r.tensors, _tensors(r.key)))
    assert RecordFile.open(tmp_path / "r").static == {"world_size": 2}
    assert [r.tensors for r in f.read(with_tensors=False)] == [[], []]


def test_bad_writes_and_files_are_refused(tmp_path):
    f = RecordFile.create(tmp_path / "r", NUMELS, {}, meta_capacity=64)
    f.write(5, _tensors(5), {})
    with pytest.raises(RecordFileError, match="record 5 is not newer than the newest held \\(5\\)"):
        f.write(5, _tensors(5), {})
    with pytest.raises(RecordFileError, match="tensor 2 has 3 elements, the file holds 17"):
        f.write(6, [torch.zeros(5), torch.zeros(0), torch.zeros(3)], {})
    with pytest.raises(RecordFileError, match="exceeds the file's 64"):
        f.write(6, _tensors(6), {"x": "y" * 100})
    assert [r.key for r in f.read()] == [5]  # nothing of the refused writes landed
    (tmp_path / "other").write_bytes(b"x" * 5000)
    with pytest.raises(RecordFileError, match="other: not an acco_ds record file"):
        RecordFile.open(tmp_path / "other")
    with pytest.raises(RecordFileError, match="missing: cannot open"):
        RecordFile.open(tmp_path / "missing")


def _write_until_killed(path) -> None:
    """The forked writer: records of 8 MiB back to back, every element of record k equal to k."""
    torch.set_num_threads(1)  # no OpenMP pool in a forked child
    f = RecordFile.create(path, [1 << 21, 3], {})
    key = 0
    while True:
        key += 1
        f.write(key, [torch.full((1 << 21,), float(key)), torch.full((3,), float(-key))], {"key": key})


def _has_record(path) -> bool:
    if not path.exists():
        return False
    try:
        f = RecordFile.open(path)
    except RecordFileError:  # the header is not written yet
        return False
    try:
        return f.newest_key() is not None
    finally:
        f.close()


def test_a_writer_killed_mid_write_leaves_its_previous_record(tmp_path):
    """SIGKILL at random points of back-to-back writes: the newest complete record is always whole (every element
    its key), and some kills did land inside a write (a slot left marked as being written)."""
    torn_seen, rng = 0, torch.Generator().manual_seed(0)
    for trial in range(12):
        path = tmp_path / f"r{trial}"
        pid = os.fork()
        if pid == 0:
            try:
                _write_until_killed(path)
            finally:
                os._exit(1)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _has_record(path):  # a loaded machine starts the child late
            time.sleep(0.005)
        time.sleep(0.03 + 0.1 * float(torch.rand(1, generator=rng)))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        f = RecordFile.open(path)
        records = f.read()
        assert records, "no complete record after the kill"
        for r in records:
            assert r.meta == {"key": r.key}
            assert torch.equal(r.tensors[0], torch.full_like(r.tensors[0], float(r.key))), (
                f"record {r.key} torn"
            )
            assert torch.equal(r.tensors[1], torch.full((3,), float(-r.key)))
        torn_seen += sum(f._slot_header(s)[0] % 2 for s in range(2))
        f.close()
    assert torn_seen > 0, "no kill landed inside a write: the check above proved nothing"


def test_a_write_in_two_parts_and_a_view_without_copy(tmp_path):
    """``begin`` hides the slot's previous record at once and shows nothing new until ``finish``; ``view`` is the
    slot itself (a receive into it lands in the record); out-of-order parts are refused."""
    f = RecordFile.create(tmp_path / "r", NUMELS, {})
    f.write(1, _tensors(1), {"key": 1})
    f.write(2, _tensors(2), {"key": 2})
    flat = f.begin(3)
    assert flat.numel() == sum(NUMELS)
    assert [r.key for r in RecordFile.open(tmp_path / "r").read()] == [2]  # record 1's slot is being written
    with pytest.raises(RecordFileError, match="record 3 was begun and not finished"):
        f.begin(4)
    flat.copy_(torch.cat(_tensors(3)))
    with pytest.raises(RecordFileError, match="record 4 was not begun"):
        f.finish(4, b"")
    f.finish(3, pickle.dumps({"key": 3}))
    got = RecordFile.open(tmp_path / "r").read()
    assert [r.key for r in got] == [3, 2] and got[0].meta == {"key": 3}
    assert all(torch.equal(t, e) for t, e in zip(got[0].tensors, _tensors(3)))
    view, blob = f.view(3)
    assert pickle.loads(blob) == {"key": 3} and f.view(1) is None
    view.fill_(7.0)  # the view is the slot: what is written through it is the record
    assert all(torch.equal(t, torch.full_like(t, 7.0)) for t in f.read(key=3)[0].tensors)
    with pytest.raises(RecordFileError, match="record 3 is not newer than the newest held \\(3\\)"):
        f.begin(3)


def test_record_metas_keep_their_tensors_dtypes_and_shapes():
    """``commit_records.dumps``/``decode``: a meta's tensors come back equal in dtype, shape and every bit (bf16, a
    0-d scalar, an empty one, nested in lists, tuples and dicts); other values unchanged."""
    meta = {
        "scale": torch.tensor(65536.0),
        "summary": torch.tensor([0.0, 1.0, 4.0, 2.0]),
        "nested": [torch.tensor([1.5, -2.25], dtype=torch.bfloat16), (torch.zeros(0, 3), 7, "x")],
        "counts": torch.tensor([[3, 4]], dtype=torch.int64),
        "plain": {"lr": 1e-3, "none": None},
    }
    back = commit_records.decode(pickle.loads(commit_records.dumps(meta)))
    flat_in, flat_out = _leaves(meta), _leaves(back)
    assert len(flat_in) == len(flat_out) == 9
    for a, b in zip(flat_in, flat_out):
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        else:
            assert a == b and type(a) is type(b)
    assert isinstance(back["nested"][1], tuple)


def _leaves(x):
    if isinstance(x, dict):
        return [v for k in sorted(x) for v in _leaves(x[k])]
    if isinstance(x, (list, tuple)):
        return [v for item in x for v in _leaves(item)]
    return [x]
