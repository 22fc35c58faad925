"""The throttled link of bench_e2e: a private network namespace whose loopback is rate-limited.

Contract:
- ``throttle_unavailable()`` returns None when this machine can throttle (root, ``unshare``,
  ``ip`` and ``tc`` present, and a namespace with a ``tbf`` qdisc on its loopback really comes
  up), else a sentence saying what is missing. The benchmark then stops; it never replaces the
  link with artificial delays.
- ``wrap(rate)`` returns a function that turns a shell command into the argv running it inside
  ``unshare -n sh -c 'ip link set lo up && tc qdisc add dev lo root tbf rate <rate> burst 256kb
  latency 200ms && exec <command>'`` (rate ``none``: the private loopback, not throttled). All
  ranks of a run share that one link; the throttle lives and dies with the namespace.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Callable, List

RATE_RE = re.compile(r"^(none|\d+(\.\d+)?(kbit|mbit|gbit))$")


def check_rate(rate: str) -> str:
    if not RATE_RE.match(rate):
        raise ValueError(f"link rate {rate!r} is not 'none' or a tc rate such as 400mbit, 2gbit, 800kbit")
    return rate


def rate_mbit(rate: str) -> float:
    """The rate in Mbit/s (inf for 'none'), for sorting and plotting."""
    if rate == "none":
        return float("inf")
    value = float(re.match(r"[\d.]+", rate).group(0))
    return value * {"kbit": 1e-3, "mbit": 1.0, "gbit": 1e3}[re.search(r"[kmg]bit$", rate).group(0)]


def _setup(rate: str) -> str:
    check_rate(rate)
    up = "ip link set lo up"
    if rate == "none":
        return up
    return f"{up} && tc qdisc add dev lo root tbf rate {rate} burst 256kb latency 200ms"


def wrap(rate: str) -> Callable[[str], List[str]]:
    setup = _setup(rate)
    return lambda command: ["unshare", "-n", "sh", "-c", f"{setup} && exec {command}"]


def throttle_unavailable() -> str | None:
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "throttling needs Linux network namespaces (unshare -n) and tc; this is not Linux"
    if os.geteuid() != 0:
        return f"throttling needs root for unshare -n and tc (running as uid {os.geteuid()})"
    missing = [tool for tool in ("unshare", "ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"throttling needs {', '.join(missing)} (util-linux / iproute2) on PATH"
    probe = wrap("100mbit")("tc qdisc show dev lo")
    proc = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0 or "tbf" not in proc.stdout:
        return f"a throttled namespace did not come up: {shlex_join(probe)} -> rc {proc.returncode}: " + (
            proc.stderr.strip() or proc.stdout.strip()
        )
    return None


def shlex_join(argv: List[str]) -> str:
    import shlex

    return shlex.join(argv)
