"""This process's CPU time by thread, so that a run's CPU cost can be split between the training thread, the
round jobs' thread, the copies' thread and the native threads of the libraries (gloo's transfer loops).

Linux only (``/proc/self/task``); elsewhere :func:`sample` is empty and :func:`by_name` gives nothing. A thread is
named by its Python name where Python started it (the main thread: ``MainThread``), else by the name the kernel
has for it (``/proc/self/task/<tid>/comm``: ``gloo_tcp_loop``, ``pt_gloo_runloop``); threads of one name are summed.
Time is ``schedstat``'s nanoseconds on the CPU (user and kernel), or ``stat``'s clock ticks where schedstat is missing.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Dict, Tuple

ENDED = "(ended)"  # the CPU time of threads that ended between two samples (the process's time minus the live ones')
_TASKS = Path("/proc/self/task")


def sample() -> Dict[int, Tuple[str, float]]:
    """``{tid: (name, cpu seconds so far)}`` of this process's live threads (empty where /proc is missing)."""
    if not _TASKS.is_dir():
        return {}
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out = {}
    for task in _TASKS.iterdir():
        try:
            tid = int(task.name)
            cpu = _seconds(task, tick)
            name = names.get(tid) or (task / "comm").read_text().strip()
        except (OSError, ValueError):
            continue  # the thread ended while it was read
        out[tid] = (name, cpu)
    return out


def _seconds(task: Path, tick: int) -> float:
    try:
        return int((task / "schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick  # utime, stime


def by_name(before: Dict[int, Tuple[str, float]], after: Dict[int, Tuple[str, float]], process_s: float):
    """``{name: cpu seconds}`` between two samples, by thread name (a thread started in between counts from zero),
    with :data:`ENDED` the rest of ``process_s`` (the process's CPU time between the samples, ``time.process_time``)
    when positive; empty when ``after`` is."""
    if not after:
        return {}
    out: Dict[str, float] = {}
    for tid, (name, cpu) in after.items():
        start = before.get(tid)
        out[name] = out.get(name, 0.0) + cpu - (start[1] if start and start[0] == name else 0.0)
    rest = process_s - sum(out.values())
    if rest > 0:
        out[ENDED] = rest
    return out
