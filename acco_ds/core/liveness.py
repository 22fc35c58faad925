"""Which peer is lost: heartbeats through the rendezvous store, read when a collective fails.

A failed or timed-out collective says that *some* peer is gone (gloo names only an address and a
port). To name the rank, every rank runs a :class:`PeerMonitor`, a daemon thread with its own store
client (``Store.clone()``, so it never shares a socket with torch's own use of the store). Every
``interval_s`` seconds it increments its key ``<prefix>/hb/<rank>`` and reads every rank's key
(one ``multi_get``), keeping the time each counter last moved. A rank that notices a failure adds
``FAILING`` to its own key first, so that the peers that see the same failure at the same time do
not take it for the lost one when it exits in turn.

:meth:`PeerMonitor.report` (after a collective failed) watches the view for up to four periods
and names the ranks whose counter has not moved for at least two periods and that are not marked
failing: their process died or froze (SIGKILL, the OOM killer, a node that went down, SIGSTOP).
When the store stops answering, its host is gone too (rank 0 with the ``deepspeed`` launcher and
env:// / tcp:// initialisation, which runs the store in rank 0's process); the view taken until then
still names a rank that fell silent before it, else the store host is the lost peer. The store
host, when it fails itself, keeps the store up for three more periods before raising, so that the
others can still read the view; not when every other rank is found lost (no one is left to read it, and a
two-node job's survivor would only restart later).

Cost: one store increment and one multi-get per rank per period (a tenth of comm_timeout_s, within
[0.2, 5] s), off the training path. No DeepSpeed here; the store is the default group's.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Dict, List, Sequence

import torch.distributed as dist

FAILING = 1 << 40
"""Added to a rank's heartbeat counter when it has seen a failure itself (it is alive, then exits)."""

_RUNNING: weakref.WeakSet[PeerMonitor] = weakref.WeakSet()


@atexit.register
def _stop_running_monitors() -> None:
    """Stop and join every heartbeat thread before the interpreter finalises. A daemon thread that is
    inside a store call (GIL released) when finalisation starts is ended by pthread_exit as it takes
    the GIL back, from within pybind11's noexcept GIL guard: ``std::terminate`` ("terminate called
    without an active exception", SIGABRT) at exit of a job that trained fine."""
    for monitor in list(_RUNNING):
        monitor.stop()


def heartbeat_interval(timeout_s: float) -> float:
    """The heartbeat period for a communication timeout: a tenth of it, within [0.2, 5] s, so the
    lost peer is named within three periods of the failure (at most 15 s)."""
    return min(5.0, max(0.2, timeout_s / 10.0))


@dataclass
class PeerReport:
    """What :meth:`PeerMonitor.report` found out."""

    lost: List[int] = field(default_factory=list)  # ranks whose heartbeat stopped
    failing: List[int] = field(default_factory=list)  # ranks that saw the failure themselves (alive)
    store_lost: bool = False  # the rendezvous store stopped answering and no other rank fell silent
    store_host: str = ""  # who hosts the store, for the message
    silent_s: float = 0.0  # how long the first lost rank has been silent
    unavailable: str = ""  # why no report could be made (no store), else ""

    def describe(self) -> str:
        """One sentence naming the lost peer(s), for error messages."""
        if self.unavailable:
            return f"the lost peer could not be identified ({self.unavailable})"
        if self.store_lost:
            return (
                f"lost peer: {self.store_host} (it hosts the rendezvous store, which does not answer: the process "
                "died or is frozen)"
            )
        if self.lost:
            ranks = ", ".join(str(r) for r in self.lost)
            word = "rank" if len(self.lost) == 1 else "ranks"
            text = f"lost peer: {word} {ranks} (no heartbeat for {self.silent_s:.1f} s: the process died or is frozen)"
            if self.failing:
                word = "rank" if len(self.failing) == 1 else "ranks"
                text += f"; {word} {', '.join(str(r) for r in self.failing)} saw the failure too"
            return text
        return "every peer still sends heartbeats: the collective failed or stalled for another reason"


def _default_store():
    """The default process group's store (a private torch accessor; None when it is not there)."""
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None:
        return None
    try:
        return getter()
    except (RuntimeError, ValueError):
        return None


def _store_host() -> str:
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return "the torchrun agent"
    return "rank 0"


def _hosts_store(rank: int) -> bool:
    return rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"


class PeerMonitor:
    """Heartbeats of ``ranks`` (global ranks) under ``prefix`` of the default group's store.

    ``start()`` begins the heartbeat thread; ``report()`` is called after a communication failure
    (it never raises); ``stop()`` ends the thread. Every rank of the group uses the same ``prefix``."""

    def __init__(self, ranks: Sequence[int], rank: int, interval_s: float, prefix: str, store=None):
        self.ranks = list(ranks)
        self.rank = rank
        self.interval_s = float(interval_s)
        self.prefix = prefix
        base = store if store is not None else _default_store()
        self._store = None
        self._why = "" if base is not None else "the default process group has no store"
        if base is not None:
            try:
                self._store = base.clone() if hasattr(base, "clone") else base
                self._store.set_timeout(timedelta(seconds=max(2.0, 4 * self.interval_s)))
            except (RuntimeError, AttributeError) as err:  # a store type that cannot clone
                self._store, self._why = None, f"the store cannot be shared with a thread: {err}"
        self._keys = [f"{prefix}/hb/{r}" for r in self.ranks]
        self._lock = threading.Lock()
        self._values: Dict[int, int] = {}
        self._changed_at: Dict[int, float] = {}
        self._view_since = 0.0  # when the first view was read
        self._view_at = 0.0  # when the last view was read
        self._store_down_at = 0.0  # when the store stopped answering (0: it answers)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._store is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._beat, name="acco-heartbeat", daemon=True)
        _RUNNING.add(self)
        self._thread.start()

    def _read(self, store) -> List[int]:
        if hasattr(store, "multi_get"):
            return [int(v) for v in store.multi_get(self._keys)]
        return [int(store.add(k, 0)) for k in self._keys]

    def _beat(self) -> None:
        store = self._store.clone() if hasattr(self._store, "clone") else self._store
        own = f"{self.prefix}/hb/{self.rank}"
        try:
            for k in self._keys:  # create every key, so that multi_get never waits for one
                store.add(k, 0)
            while not self._stop.is_set():
                store.add(own, 1)
                values = self._read(store)
                now = time.monotonic()
                with self._lock:
                    for r, v in zip(self.ranks, values):
                        if self._values.get(r) != v:
                            self._values[r] = v
                            self._changed_at[r] = now
                    self._view_since = self._view_since or now
                    self._view_at = now
                self._stop.wait(self.interval_s)
        except Exception:  # the store host is gone: report() judges from the view taken until now
            with self._lock:
                self._store_down_at = time.monotonic()

    def stop(self) -> None:
        """End the heartbeat thread and join it: it returns within one store operation (bounded by the
        store timeout, at most max(2, 4 x interval) s). Idempotent."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=max(2.0, 4 * self.interval_s) + 1.0)
        _RUNNING.discard(self)

    def _mark_failing(self) -> None:
        with contextlib.suppress(Exception):  # the store is down: report() says so
            self._store.add(f"{self.prefix}/hb/{self.rank}", FAILING)

    def report(self) -> PeerReport:
        """Name the lost peers (blocks up to four heartbeat periods; three more on the store host while
        another rank may still be reading the view: one not found lost). Never raises."""
        if self._store is None or self._thread is None:
            return PeerReport(unavailable=self._why or "the heartbeat monitor is not running")
        self._mark_failing()
        host = _store_host()
        p = self.interval_s
        t0 = time.monotonic()
        while True:  # until a rank has been silent for two periods, the store died, or four periods
            with self._lock:
                # silence as of the last view: once the store is down no counter moves any more, and
                # measuring up to the moment the failed store call returned would name a live rank
                end = self._view_at
                silent = {
                    r: end - self._changed_at.get(r, self._view_since) for r in self.ranks if r != self.rank
                }
                failing = [r for r in self.ranks if r != self.rank and self._values.get(r, 0) >= FAILING]
                store_down = bool(self._store_down_at)
            lost = sorted(
                (r for r in silent if silent[r] >= 2 * p and r not in failing), key=lambda r: -silent[r]
            )
            if lost or store_down or time.monotonic() - t0 >= 4 * p:
                break
            time.sleep(p / 4)
        readers = [r for r in self.ranks if r != self.rank and r not in lost]
        if _hosts_store(self.rank) and readers:
            time.sleep(3 * p)  # keep the store up for the peers that are still reading the view
        if not lost and store_down:
            return PeerReport(store_lost=True, store_host=host, failing=failing)
        return PeerReport(
            lost=lost, failing=failing, silent_s=silent[lost[0]] if lost else 0.0, store_host=host
        )


class BlockBoard:
    """Which ranks are blocked at their round cap (adaptive accumulation with
    ``max_micro_batches_per_round``), through the rendezvous store, so a draining rank ends only the
    rounds a blocked peer waits for, and never an unneeded one.

    A rank about to wait, at the end of round R, for its job in flight (launched at the end of round
    R - 1) calls ``post(R)``: that job completes once every rank has launched R rounds. It calls
    ``post(None)`` when the wait is over. ``needed()`` is the largest R posted by any rank, or 0. Store
    traffic: two writes per blocking wait at the cap, reads only while draining. Without a store the
    board is unavailable (``needed()`` returns None) and the caller falls back to its own rule."""

    def __init__(self, monitor: PeerMonitor | None):
        self._store = None
        if monitor is not None and monitor._store is not None:
            base = monitor._store
            self._store = base.clone() if hasattr(base, "clone") else base
            self._keys = [f"{monitor.prefix}/blocked/{r}" for r in monitor.ranks]
            self._own = f"{monitor.prefix}/blocked/{monitor.rank}"
            for k in self._keys:
                self._store.add(k, 0)  # create every key, so reads never wait for a missing one

    def post(self, rounds: int | None) -> None:
        if self._store is not None:
            self._store.set(self._own, str(0 if rounds is None else rounds + 1))

    def needed(self) -> int | None:
        if self._store is None:
            return None
        return max(int(self._store.add(k, 0)) for k in self._keys) - 1
