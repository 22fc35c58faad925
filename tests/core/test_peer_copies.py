"""``core.peer_copies.PeerCopies.wait_slot_free``: the job's thread writes commit k only once the copies of the steps
naming commit k - 1 are through their exchange (the wards' copies stored), not as soon as the copies' thread has read
the commit. A rank whose node survives then holds its ward's step k - 1 whenever its own records hold step k, so the
two always share a step; with the wait released at the read, a ward lost during the exchange left the holder's copy
two steps behind its own records and nothing to resume from (the node-loss benchmark's failure). Here the exchange
is held open (no process group: ``_send`` replaced) and the wait must not return before it is let go.

And a step's copy leaves the link to the round job in flight when the step was recorded: its exchange starts only
once that job is over, on the CPU executor (the job ran) and on the CUDA one (its side-stream work done, here on the
emulated streams).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from acco_ds.core import comm, peer_copies
from acco_ds.core.emulated_stream import EmulatedCuda


class _Commits:
    numels = [3]

    def __init__(self):
        self.newest = None

    def newest_key(self):
        return self.newest

    def view(self, key):
        return torch.zeros(3), b"meta"


def _copies(tmp_path, exchange, executor=None):
    state = SimpleNamespace(commits=_Commits(), folder=str(tmp_path), rank=0, generation=0, inputs=None)
    copies = peer_copies.PeerCopies(state, None, holder=1, wards=[], timeout_s=30.0, executor=executor)
    copies._send = exchange
    return copies, state


def test_commit_k_waits_for_the_exchange_of_commit_k_minus_1(tmp_path):
    in_exchange, release = threading.Event(), threading.Event()

    def exchange(messages):
        in_exchange.set()
        assert release.wait(30)
        return []

    copies, state = _copies(tmp_path, exchange)
    try:
        state.commits.newest = 4
        copies.step_recorded(4, 4, b"step")
        assert in_exchange.wait(30)  # the copies' thread has read commit 4 and is exchanging it
        done = threading.Event()
        waiter = threading.Thread(target=lambda: (copies.wait_slot_free(5), done.set()), daemon=True)
        waiter.start()
        assert not done.wait(0.5), "commit 5 was let through while the exchange of commit 4 was still open"
        release.set()
        assert done.wait(30)
        assert copies.steps_copied == 1
        copies.wait_slot_free(4)  # nothing older is pending: returns at once
    finally:
        release.set()
        copies.close()


def test_the_wait_ends_with_the_copies_error(tmp_path):
    def exchange(messages):
        raise RuntimeError("Connection closed by peer")

    copies, state = _copies(tmp_path, exchange)
    try:
        state.commits.newest = 2
        copies.step_recorded(2, 2, b"step")
        try:
            copies.wait_slot_free(3)
        except peer_copies.PeerCopyError as err:
            assert "Connection closed by peer" in str(err)
        else:
            raise AssertionError("wait_slot_free returned although the copy of commit 2 failed")
    finally:
        copies.close()


def test_metas_past_the_fixed_message_go_in_a_message_of_their_own():
    for size in (0, 10, peer_copies.META_BYTES - 64, peer_copies.META_BYTES * 3 + 5):
        commit_blob, step_blob = b"c" * 17, bytes(range(256)) * (size // 256) + b"s" * (size % 256)
        fixed, rest = peer_copies.pack_metas(12, 9, commit_blob, step_blob, peer_copies.INPUTS, -(2**40) - 3)
        assert fixed.numel() == peer_copies.META_BYTES
        step, key, clen, slen, form, digest, head, over = peer_copies.unpack_metas(fixed.clone())
        assert (step, key, clen, slen, over) == (12, 9, 17, len(step_blob), rest.numel())
        assert (form, digest) == (peer_copies.INPUTS, -(2**40) - 3)
        assert head + rest.numpy().tobytes() == commit_blob + step_blob


@pytest.mark.parametrize("executor", ["thread", "stream"])
def test_a_copy_starts_only_once_the_round_in_flight_at_its_step_is_over(tmp_path, executor):
    if executor == "thread":
        ex = comm.ThreadExecutor(group=None, timeout_s=30.0)
    else:  # the job's device work ends 0.3 s after its thread is through with it
        ex = comm.StreamExecutor(
            group=None, timeout_s=30.0, device=torch.device("cpu"), cuda=EmulatedCuda(0.3)
        )
    release_job, entered = threading.Event(), threading.Event()
    seen = {}

    def exchange(messages):
        seen["job_over"] = ex.done(ticket)
        entered.set()
        return []

    copies, state = _copies(tmp_path, exchange, ex)
    try:
        ticket = ex.launch("round 9 (peek of step 5)", lambda: release_job.wait(30))
        state.commits.newest = 4
        copies.step_recorded(4, 4, b"step", after=ticket)
        assert not entered.wait(0.5), "the copy went out while the round in flight at its step still ran"
        release_job.set()
        assert entered.wait(30)
        assert seen["job_over"], "the copy went out before the round's (device) work was over"
        copies.wait_slot_free(5)
        assert copies.after_round_s >= 0.5
    finally:
        release_job.set()
        copies.close()
        ex.close()
