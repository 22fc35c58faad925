"""The whole machine's CPU time by kind (``/proc/stat``'s ``cpu`` line), so that a benchmark can tell what a job cost
beyond its processes' own accounting: above all the softirq time of the network's packets, which Linux charges to
whichever thread the interrupt lands on when the kernel does not account interrupt time apart
(``CONFIG_IRQ_TIME_ACCOUNTING``).

:func:`sample` is ``{kind: seconds since boot}`` (empty where /proc/stat is missing); :func:`delta` the seconds of
each kind between two samples.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict

KINDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
_STAT = Path("/proc/stat")


def sample() -> Dict[str, float]:
    try:
        line = _STAT.read_text().splitlines()[0]
    except (OSError, IndexError):
        return {}
    fields = line.split()
    if fields[0] != "cpu":
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    return {k: int(v) / tick for k, v in zip(KINDS, fields[1:])}


def delta(before: Dict[str, float], after: Dict[str, float]) -> Dict[str, float]:
    return {k: after[k] - before[k] for k in KINDS if k in before and k in after}
