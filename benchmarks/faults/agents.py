"""One elastic job on the "nodes" of a namespace network: a torchrun agent per node, and what happens to it when a node dies.

Contract:
- ``Job(net, setup, out, mode, seed)`` describes one ``acco-train`` job under torchrun's elastic agent:
  ``--nnodes 1:N --nproc-per-node setup.per_node --max-restarts setup.max_restarts --rdzv-backend c10d``,
  the rendezvous on node 0's address on the link (node 0's agent hosts the store), ``--local-addr`` each
  node's own address (so the workers' master address is on the link), ``is_host`` true on node 0 only,
  ``last_call_timeout`` and
  ``join_timeout`` from ``setup``; every rank runs ``python -m acco_ds.train`` with the job's options and
  ``--out out`` (one folder both nodes write: the shared file system a cluster's checkpoints need); with
  ``setup.memory_root``, ``--memory-state`` too, each node's memory folder bound to its own folder
  (``node_memory``).
- ``job.start()`` starts both agents, each inside its node's namespace in a session of its own;
  ``job.kill_node(n)`` SIGKILLs every process of node n (its agent and every descendant: torchrun starts
  its workers in sessions of their own) and returns the wall-clock time of the kill; ``job.wait(timeout)``
  waits for the agents that are left and returns their exit statuses; ``job.stop()`` kills whatever is
  left (also on an exception). Logs: ``out/node<n>.log``.
- ``wait_for_save(out, after, timeout)`` / ``wait_for_new_save_folder``: poll the job's checkpoint folder
  (``latest`` names the last complete save; a ``step<N>`` folder appears when a save begins).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

from acco_ds.cli.launch import free_port, rank_env


@dataclass
class Setup:
    """What every job of the benchmark shares."""

    steps: int
    save_every: int
    per_node: int
    max_restarts: int
    last_call_timeout_s: int
    join_timeout_s: int
    model_args: List[str]
    threads: int = 1
    memory_root: str | None = None  # acco-train --memory-state, node n's memory at <memory_root>/node<n>
    memory_form: str | None = None  # acco-train --memory-state-form (None: the config's default)


def agent_command(
    setup: Setup, addrs, node: int, port: int, run_id: str, out: Path, mode: str, seed: int
) -> list:
    """The torchrun argv of node ``node`` of the nodes at ``addrs`` (run inside its namespace)."""
    # node 0 hosts the c10d store (is_host: torch looks for the endpoint among the host's names, and the
    # namespace's address on the link is not one of them)
    rdzv_conf = f"join_timeout={setup.join_timeout_s},last_call_timeout={setup.last_call_timeout_s}"
    rdzv_conf += f",is_host={'true' if node == 0 else 'false'}"
    cmd = [sys.executable, "-u", "-m", "torch.distributed.run", "--nnodes", f"1:{len(addrs)}"]
    cmd += ["--nproc-per-node", str(setup.per_node), "--max-restarts", str(setup.max_restarts)]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{addrs[0]}:{port}", "--rdzv-id", run_id]
    cmd += ["--rdzv-conf", rdzv_conf, "--local-addr", addrs[node], "--monitor-interval", "0.5"]
    cmd += ["-m", "acco_ds.train", "--mode", mode, "--steps", str(setup.steps), "--seed", str(seed)]
    cmd += ["--save-every", str(setup.save_every), "--threads", str(setup.threads), "--out", str(out)]
    cmd += ["--no-progress", *setup.model_args]
    if setup.memory_root is None:
        return cmd
    # the node's own memory: /dev/shm/acco_ds (memory_state's default folder) is <memory_root>/node<n> inside the
    # node's mount namespace (``ip netns exec`` gives every node one), so that killing the node and removing the
    # folder takes its memory with it
    mine = node_memory(setup, node)
    script = f'mkdir -p {shlex.quote(str(mine))} {MEMORY_DIR} && mount --bind {shlex.quote(str(mine))} {MEMORY_DIR} && exec "$@"'
    form = [] if setup.memory_form is None else ["--memory-state-form", setup.memory_form]
    return ["sh", "-c", script, "sh", *cmd, "--memory-state", *form]


MEMORY_DIR = "/dev/shm/acco_ds"


def node_memory(setup: Setup, node: int) -> Path:
    """Where node ``node``'s memory_state records are seen from outside its namespace."""
    return Path(setup.memory_root) / f"node{node}"


def _descendants(pid: int) -> List[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        proc = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True)
        children = [int(x) for x in proc.stdout.split()]
        found += children
        todo += children
    return found


class Job:
    def __init__(self, net, setup: Setup, out: Path, mode: str, seed: int):
        self.net, self.setup, self.out, self.mode, self.seed = net, setup, out, mode, seed
        self.port = free_port()
        self.run_id = f"acco_faults_{os.getpid()}_{self.port}"
        self.procs: Dict[int, subprocess.Popen] = {}

    def start(self) -> float:
        """Start every node's agent; returns the wall-clock time of the start."""
        self.out.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        count = len(self.net.names)
        for node in range(count):
            argv = agent_command(
                self.setup, self.net.addrs, node, self.port, self.run_id, self.out, self.mode, self.seed
            )
            cmd = self.net.wrap(node)(shlex.join(argv))
            env = rank_env(self.setup.threads, count * self.setup.per_node)
            env.update(self.net.env(node))
            # a new c10d store for the workers of every rendezvous round: torch's agents otherwise hand the
            # workers the same store server round after round, and a restarted group with two or more nodes
            # reads the dead round's gloo addresses from it (connectFullMesh: connection refused)
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
            with open(self.out / f"node{node}.log", "w") as log:
                self.procs[node] = subprocess.Popen(
                    cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
        return t0

    def all_running(self) -> bool:
        """Whether every node's agent is still running (the faults' polls stop when one is not)."""
        return all(p.poll() is None for p in self.procs.values())

    def node0_running(self) -> bool:
        """Whether node 0's agent (the one that survives every kill but the rendezvous host's) still runs."""
        return self.procs[0].poll() is None

    def kill_node(self, node: int) -> float:
        """SIGKILL every process of ``node``; returns the wall-clock time of the kill."""
        proc = self.procs[node]
        pids = [proc.pid, *_descendants(proc.pid)]
        t = time.time()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        return t

    def wait(self, timeout: float) -> Dict[int, int | None]:
        """Wait for the agents still running (at most ``timeout`` s); {node: exit status or None}."""
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in self.procs.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return {n: p.poll() for n, p in self.procs.items()}

    def stop(self) -> None:
        for proc in self.procs.values():
            for pid in [proc.pid, *_descendants(proc.pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def log_tail(self, lines: int = 20) -> str:
        out = []
        for node in self.procs:
            path = self.out / f"node{node}.log"
            text = path.read_text(errors="replace").splitlines() if path.exists() else []
            out += [f"--- node{node}.log"] + text[-lines:]
        return "\n".join(out)


def checkpoint_dir(out: Path) -> Path:
    return out / "checkpoints"


def latest_step(out: Path) -> int:
    """The step of the last complete save (0: none yet)."""
    path = checkpoint_dir(out) / "latest"
    try:
        tag = path.read_text().strip()
    except OSError:
        return 0
    return int(tag[len("step") :]) if tag.startswith("step") and tag[len("step") :].isdigit() else 0


def save_folders(out: Path) -> List[int]:
    folder = checkpoint_dir(out)
    if not folder.is_dir():
        return []
    return sorted(int(p.name[4:]) for p in folder.iterdir() if p.is_dir() and p.name[4:].isdigit())


def wait_for_save(out: Path, at_least: int, timeout: float, alive) -> int:
    """Poll until the last complete save is at step >= ``at_least``; returns it (0 on timeout or when
    ``alive()`` turns False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive():
        step = latest_step(out)
        if step >= at_least:
            return step
        time.sleep(0.02)
    return 0


def wait_for_new_save_folder(out: Path, after: int, timeout: float, alive) -> int:
    """Poll (every 2 ms) until a save folder past step ``after`` exists while ``latest`` still names an
    earlier one: a save in progress. Returns its step (0 on timeout)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive():
        newer = [s for s in save_folders(out) if s > after]
        if newer and latest_step(out) < newer[-1]:
            return newer[-1]
        time.sleep(0.002)
    return 0
