"""The throttled link of the e2e benchmark: a private network namespace whose loopback is rate-limited.

Contract:
- ``throttle_unavailable()`` returns None when this machine can throttle (root, ``unshare``,
  ``ip`` and ``tc`` present, and a namespace with a ``tbf`` qdisc on its loopback really comes
  up), else a sentence saying what is missing. The benchmark then stops; it never replaces the
  link with artificial delays.
- ``wrap(rate)`` returns a function that turns a shell command into the argv running it inside
  ``unshare -n sh -c 'ip link set lo up && tc qdisc add dev lo root tbf rate <rate> burst 256kb
  latency 200ms && exec [nice -n N] <command>'`` (rate ``none``: the private loopback, not
  throttled; ``nice``: the scheduling priority of the ranks, for machines shared with other jobs). All
  ranks of a run share that one link; the throttle lives and dies with the namespace.
- ``link_env()``: the environment that keeps NCCL on that link (sockets over ``lo``) on GPUs.
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


def wrap(rate: str, nice: int = 0) -> Callable[[str], List[str]]:
    setup = _setup(rate)
    prefix = f"nice -n {int(nice)} " if nice else ""
    return lambda command: ["unshare", "-n", "sh", "-c", f"{setup} && exec {prefix}{command}"]


def link_env() -> dict:
    """Environment that keeps every collective on the (throttled) loopback. gloo always uses TCP;
    NCCL between GPUs of one node would use NVLink/PCIe or shared memory and bypass the link, so
    on GPUs it is forced onto TCP sockets over ``lo``."""
    try:
        import torch

        cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        cuda = False
    if not cuda:
        return {}
    return {
        "NCCL_P2P_DISABLE": "1",
        "NCCL_SHM_DISABLE": "1",
        "NCCL_IB_DISABLE": "1",
        "NCCL_NET": "Socket",
        "NCCL_SOCKET_IFNAME": "lo",
    }


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
