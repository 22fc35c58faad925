"""PeerMonitor names the lost peer from the heartbeat view (acco_ds/core/liveness.py), here with an
in-process store whose death can be timed: when the store host dies, the view freezes, and a rank is
named only if it had already fallen silent when the last view was read (the store calls that fail can
take seconds to return: that wait must not count as the silence of the ranks that were alive). The store
host keeps the store up after its report while a peer may still read the view, and not when every peer
is lost (a two-node job's survivor: it would only delay the restart)."""

from __future__ import annotations

import threading
import time

import pytest

from acco_ds.core import liveness
from acco_ds.core.liveness import PeerMonitor

PERIOD = 0.1


class _Backing:
    def __init__(self, fail_after_s: float):
        self.values: dict = {}
        self.lock = threading.Lock()
        self.dead = False
        self.fail_after_s = fail_after_s  # how long a call to the dead store blocks before it raises


class _Store:
    """The subset of a c10d store PeerMonitor uses; every clone shares one backing."""

    def __init__(self, backing: _Backing):
        self.b = backing

    def clone(self):
        return _Store(self.b)

    def set_timeout(self, _timeout):
        pass

    def _alive(self):
        if self.b.dead:
            time.sleep(self.b.fail_after_s)
            raise RuntimeError("Connection reset by peer")

    def add(self, key, amount):
        self._alive()
        with self.b.lock:
            self.b.values[key] = self.b.values.get(key, 0) + amount
            return self.b.values[key]

    def multi_get(self, keys):
        self._alive()
        with self.b.lock:
            return [str(self.b.values.get(k, 0)).encode() for k in keys]


def _monitors(backing):
    out = [PeerMonitor([0, 1, 2], r, PERIOD, "t", store=_Store(backing)) for r in range(3)]
    for m in out:
        m.start()
    return out


def test_store_host_death_names_the_store_host_not_a_live_rank():
    backing = _Backing(fail_after_s=6 * PERIOD)  # the failed call returns long after two periods
    mons = _monitors(backing)
    try:
        time.sleep(8 * PERIOD)
        mons[0].stop()  # rank 0, the store host, is killed: its heartbeats and the store end together
        backing.dead = True
        mons[1].stop()  # rank 1 saw the failure and exited at once
        report = mons[2].report()
    finally:
        for m in mons:
            m.stop()
    assert report.store_lost and not report.lost, report.describe()
    assert report.describe().startswith("lost peer: rank 0 (it hosts the rendezvous store")


def test_rank_silent_before_the_store_died_is_named():
    backing = _Backing(fail_after_s=2 * PERIOD)
    mons = _monitors(backing)
    try:
        time.sleep(6 * PERIOD)
        mons[1].stop()  # rank 1 freezes first
        time.sleep(6 * PERIOD)
        mons[0].stop()
        backing.dead = True
        report = mons[2].report()
    finally:
        for m in mons:
            m.stop()
    assert report.lost == [1], report.describe()


@pytest.mark.parametrize("ranks, kept_up", [([0, 1], False), ([0, 1, 2], True)])
def test_the_store_host_keeps_the_store_up_only_for_live_readers(monkeypatch, ranks, kept_up):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)  # rank 0 hosts the store
    sleeps = []
    real_sleep = time.sleep

    def recording_sleep(s):
        sleeps.append(s)
        real_sleep(s)

    monkeypatch.setattr(liveness.time, "sleep", recording_sleep)
    backing = _Backing(fail_after_s=PERIOD)
    mons = [PeerMonitor(ranks, r, PERIOD, "t", store=_Store(backing)) for r in ranks]
    for m in mons:
        m.start()
    try:
        real_sleep(6 * PERIOD)
        mons[1].stop()  # rank 1 is lost; rank 2, where there is one, is alive and reads the view too
        report = mons[0].report()
    finally:
        for m in mons:
            m.stop()
    assert report.lost == [1], report.describe()
    assert (3 * PERIOD in sleeps) == kept_up, sleeps
