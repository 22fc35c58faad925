"""The two "nodes" of the topology benchmark: two network namespaces joined by a rate-limited veth pair.

Contract:
- ``unavailable()`` returns None when this machine can build the network (root; ``ip`` and ``tc``
  of iproute2; a namespace really comes up), else a sentence saying what is missing. The
  benchmark then stops with status 2; it never replaces the link with artificial delays.
- ``TwoNodes()`` is a context manager. On entry it creates namespaces ``acco_topo_<pid>_n0`` and
  ``..._n1`` (``ip netns add``), a veth pair ``topo0`` (in n0) - ``topo1`` (in n1) created directly
  inside them, addresses 10.77.0.1/24 and 10.77.0.2/24 on its ends, and brings up the pair and
  each namespace's loopback. Addresses exist only inside these namespaces; nothing of the host's
  network changes. On exit (also on an exception, KeyboardInterrupt, or SIGTERM turned into
  SystemExit by the benchmark) it deletes both namespaces, which removes the veth pair with them.
- ``set_rate(rate)`` limits both ends of the pair (egress of each node: a ``tbf`` qdisc, rate
  ``rate``, burst 256kb, latency 200ms, as the e2e benchmark's link) or removes the limit (``none``).
  Traffic between the two ranks of one node goes to the node's own address, which Linux routes
  over the namespace's loopback: unlimited, never through the veth pair.
- ``wrap(node, nice)`` turns a shell command into the argv that runs it inside node ``node``
  (``ip netns exec``); ``env(node)`` names the node's interface for gloo/NCCL; ``master_addr`` is
  node 0's address on the link.
- ``BridgedNodes(n)``: the same for ``n`` nodes (2 to 9): namespaces ``..._n0`` .. ``..._n<n-1>`` and a
  switch namespace ``..._sw`` holding a bridge; node i's interface ``link0`` (10.77.1.<i+1>/24) is one end of
  a veth pair whose other end is a port of the bridge. ``set_rate`` limits each node's egress on ``link0``,
  ``wrap``/``env``/``qdisc``/``addrs``/``master_addr`` as above; leaving removes every namespace.
- ``ours()`` lists this module's namespaces present now; ``remove_stale()`` deletes those left by
  a process that no longer exists (a run killed with SIGKILL cannot clean up after itself).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Callable, List

from benchmarks.harness import link

PREFIX = "acco_topo"
ADDRS = ("10.77.0.1", "10.77.0.2")
IFNAMES = ("topo0", "topo1")
NODES = 2
NAME_RE = re.compile(rf"^{PREFIX}_(\d+)_(n\d|sw)$")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed (rc {proc.returncode}): {proc.stderr.strip()}")
    return proc


def ours() -> List[str]:
    """This module's namespaces present now (any process's)."""
    if shutil.which("ip") is None:
        return []
    out = _ip("netns", "list", check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if NAME_RE.match(n)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> List[str]:
    """Delete the namespaces of this module whose creating process is gone; returns their names."""
    gone = [n for n in ours() if not _alive(int(NAME_RE.match(n).group(1)))]
    for name in gone:
        _ip("netns", "del", name, check=False)
    return gone


def unavailable() -> str | None:
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "the two-node network needs Linux network namespaces (ip netns) and tc; this is not Linux"
    if os.geteuid() != 0:
        return f"the two-node network needs root for ip netns and tc (running as uid {os.geteuid()})"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"the two-node network needs {', '.join(missing)} (iproute2) on PATH"
    probe = f"{PREFIX}_{os.getpid()}_probe"
    proc = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        return f"ip netns add did not work: rc {proc.returncode}: {proc.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class TwoNodes:
    """Two namespaces joined by a veth pair (see the module docstring)."""

    def __init__(self) -> None:
        self.names = [f"{PREFIX}_{os.getpid()}_n{i}" for i in range(NODES)]
        self.rate = "none"
        self.addrs = ADDRS
        self.master_addr = ADDRS[0]

    def __enter__(self) -> TwoNodes:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        for name in self.names:
            _ip("netns", "add", name)
        n0, n1 = self.names
        _ip("link", "add", IFNAMES[0], "netns", n0, "type", "veth", "peer", "name", IFNAMES[1], "netns", n1)
        for name, ifname, addr in zip(self.names, IFNAMES, ADDRS):
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", ifname)
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "link", "set", ifname, "up")

    def down(self) -> None:
        for name in self.names:
            _ip("netns", "del", name, check=False)

    def set_rate(self, rate: str) -> None:
        link.check_rate(rate)
        for name, ifname in zip(self.names, IFNAMES):
            tc = ["ip", "netns", "exec", name, "tc", "qdisc"]
            if rate == "none":
                subprocess.run(tc + ["del", "dev", ifname, "root"], capture_output=True, timeout=30)
                continue
            limit = ["root", "tbf", "rate", rate, "burst", "256kb", "latency", "200ms"]
            proc = subprocess.run(
                tc + ["replace", "dev", ifname, *limit], capture_output=True, text=True, timeout=30
            )
            if proc.returncode != 0:
                raise RuntimeError(f"tc on {name}/{ifname} failed: {proc.stderr.strip()}")
        self.rate = rate

    def qdisc(self, node: int) -> str:
        """``tc qdisc show`` of the node's end of the link (what limits it now)."""
        cmd = ["ip", "netns", "exec", self.names[node], "tc", "qdisc", "show", "dev", IFNAMES[node]]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()

    def wrap(self, node: int, nice: int = 0) -> Callable[[str], List[str]]:
        prefix = f"nice -n {int(nice)} " if nice else ""
        return lambda command: [
            "ip",
            "netns",
            "exec",
            self.names[node],
            "sh",
            "-c",
            f"exec {prefix}{command}",
        ]

    @staticmethod
    def env(node: int) -> dict:
        """gloo (and NCCL, on GPUs) bind the node's address on the link; peers on the same node
        reach it over the loopback."""
        return {"GLOO_SOCKET_IFNAME": IFNAMES[node], "NCCL_SOCKET_IFNAME": IFNAMES[node]}


class BridgedNodes(TwoNodes):
    """``n`` namespaces joined through a bridge (see the module docstring)."""

    IFNAME = "link0"

    def __init__(self, n: int) -> None:
        if not 2 <= n <= 9:
            raise ValueError(f"BridgedNodes: 2 to 9 nodes, got {n}")
        super().__init__()
        self.names = [f"{PREFIX}_{os.getpid()}_n{i}" for i in range(n)]
        self.switch = f"{PREFIX}_{os.getpid()}_sw"
        self.addrs = tuple(f"10.77.1.{i + 1}" for i in range(n))
        self.master_addr = self.addrs[0]

    def up(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, (name, addr) in enumerate(zip(self.names, self.addrs)):
            port = f"port{i}"
            _ip("netns", "add", name)
            _ip(
                "link",
                "add",
                self.IFNAME,
                "netns",
                name,
                "type",
                "veth",
                "peer",
                "name",
                port,
                "netns",
                self.switch,
            )
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", self.IFNAME)
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "link", "set", self.IFNAME, "up")

    def down(self) -> None:
        for name in [*self.names, self.switch]:
            _ip("netns", "del", name, check=False)

    def set_rate(self, rate: str) -> None:
        link.check_rate(rate)
        for name in self.names:
            tc = ["ip", "netns", "exec", name, "tc", "qdisc"]
            if rate == "none":
                subprocess.run(tc + ["del", "dev", self.IFNAME, "root"], capture_output=True, timeout=30)
                continue
            limit = ["root", "tbf", "rate", rate, "burst", "256kb", "latency", "200ms"]
            proc = subprocess.run(
                tc + ["replace", "dev", self.IFNAME, *limit], capture_output=True, text=True, timeout=30
            )
            if proc.returncode != 0:
                raise RuntimeError(f"tc on {name}/{self.IFNAME} failed: {proc.stderr.strip()}")
        self.rate = rate

    def qdisc(self, node: int) -> str:
        cmd = ["ip", "netns", "exec", self.names[node], "tc", "qdisc", "show", "dev", self.IFNAME]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()

    def env(self, node: int) -> dict:
        return {"GLOO_SOCKET_IFNAME": self.IFNAME, "NCCL_SOCKET_IFNAME": self.IFNAME}
