"""Start the ranks of a test: W processes on 127.0.0.1 with the environment a launcher gives them.

Two ways, the same ranks: ``run_deepspeed`` goes through the ``deepspeed`` command exactly as users type it (its
runner, then its per-node launcher: ``acco_ds.cli.launch.runner_command``, with the ranks' environment
``acco-train`` uses), for the tests about launching; ``run_local`` starts the W rank processes itself with what that per-node launcher gives
each of them (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_SIZE``, ``CROSS_RANK``, ``CROSS_SIZE``,
``MASTER_ADDR``/``MASTER_PORT``, ``--local_rank=<r>`` first on the command line, ``python -u``), and, like it,
stops the others when one fails. The rank scripts of the algorithm, checkpoint and integration tests use
``run_local``: the launcher's two extra interpreters (each imports torch and DeepSpeed, about 5 CPU-seconds
per launch) test nothing there, and the DeepSpeed launcher keeps its own tests (tests/ranks/test_cpu_ranks.py,
tests/integrations/, tests/cli/, tests/reliability/test_peer_loss.py, the benchmarks' quick runs).

The ranks of the CPU tests run on the CPU also on a machine with GPUs (``rank_env()``): the same suite passes
unchanged there. ``accelerator="cuda"`` (the GPU tests, NCCL) leaves the GPUs visible. Rank scripts live in this
folder and are launched by path; the repository root reaches them through PYTHONPATH (no ``sys.path`` edits)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from acco_ds.cli import launch as cli_launch
from acco_ds.cli.launch import free_port, launcher_prefix
from tests.ranks import forked_ranks

REPO = Path(__file__).resolve().parents[2]
CPU_RANKS_HOOK = (
    REPO / "tests" / "ranks" / "cpu_hook"
)  # sitecustomize.py: hides CUDA in the ranks at start-up
HIDE_CUDA_ENV = "ACCO_DS_TEST_HIDE_CUDA"

__all__ = [
    "REPO",
    "CPU_RANKS_HOOK",
    "HIDE_CUDA_ENV",
    "deepspeed_cmd",
    "free_port",
    "rank_env",
    "run_deepspeed",
    "run_local",
]


PORT_ATTEMPTS = 3
"""Launches ``run_local`` and ``run_deepspeed`` make when rank 0 cannot listen on the port it was given
(EADDRINUSE: free_port() saw it free, another process took it before rank 0 listened)."""
_PORT_TAKEN = "EADDRINUSE"


def deepspeed_cmd() -> list:
    """The ``deepspeed`` launcher command (``acco_ds.cli.launch.launcher_prefix``)."""
    return launcher_prefix()


def rank_env(accelerator: str = "cpu", **extra) -> dict:
    """The environment of launched ranks (and of the launcher), plus ``extra`` variables.

    Built on ``acco_ds.cli.launch.rank_env`` (one thread per rank, the package importable), then
    ``accelerator="cpu"``: ``DS_ACCELERATOR=cpu`` (DeepSpeed's CPU accelerator, gloo) and CUDA hidden:
    ``CUDA_VISIBLE_DEVICES=""`` for the launcher and, since the ``deepspeed`` launcher sets
    ``CUDA_VISIBLE_DEVICES=0..W-1`` in every rank even for the CPU accelerator, a start-up hook
    (``tests/ranks/cpu_hook/sitecustomize.py``, first on PYTHONPATH) that empties it again in each rank before
    torch loads. ``accelerator="cuda"``: ``DS_ACCELERATOR=cuda``, GPUs as the environment has them."""
    if accelerator not in ("cpu", "cuda"):
        raise ValueError(f"rank_env: accelerator must be 'cpu' or 'cuda', got {accelerator!r}")
    env = cli_launch.rank_env(threads=1)
    paths = [p for p in env.get("PYTHONPATH", "").split(":") if p and p != str(CPU_RANKS_HOOK)]
    env.pop(HIDE_CUDA_ENV, None)
    env["DS_ACCELERATOR"] = accelerator
    if accelerator == "cpu":
        paths.insert(0, str(CPU_RANKS_HOOK))
        env.update({HIDE_CUDA_ENV: "1", "CUDA_VISIBLE_DEVICES": ""})
    env["PYTHONPATH"] = ":".join(paths)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_deepspeed(script: Path, world: int, args: list, timeout: float = 600, env: dict | None = None):
    """Run ``deepspeed --num_gpus world script args`` on 127.0.0.1 and return the CompletedProcess (raises
    on failure with the ranks' output in the message); removes the ranks' DeepSpeed shm buffers after."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        port = free_port()
        cmd = cli_launch.runner_command(world, port, target=str(script), extra=[str(a) for a in args])
        try:
            proc = subprocess.run(
                cmd, env=env or rank_env(), capture_output=True, text=True, timeout=timeout, cwd=REPO
            )
        finally:
            cli_launch.cleanup_shm(port, world)
        # as run_local: the port was taken before rank 0 listened on it, nothing ran
        if proc.returncode == 0 or attempt == PORT_ATTEMPTS or _PORT_TAKEN not in proc.stdout + proc.stderr:
            break
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-6000:]
        raise AssertionError(f"deepspeed launch failed (rc={proc.returncode}): {' '.join(cmd)}\n{tail}")
    return proc


def run_local(
    script: Path, world: int, args: list, timeout: float = 600, env: dict | None = None, check: bool = True
):
    """Start ``world`` ranks of ``script`` on 127.0.0.1 (``python -u script --local_rank=<r> args``, the environment
    DeepSpeed's per-node launcher gives rank r) and wait for them; returns a CompletedProcess whose stdout holds
    every rank's output (stdout and stderr), rank by rank. When a rank exits non-zero the others are terminated
    (SIGTERM, then SIGKILL after 10 s) as DeepSpeed's launcher does. After ``timeout`` seconds, or on a failure
    when ``check``, it raises AssertionError with the end of each rank's output; with ``check=False`` a failed run
    returns with the first failed rank's status as ``returncode``. Removes the ranks' DeepSpeed shm buffers
    after."""
    if os.environ.get("ACCO_DS_TEST_NO_LAUNCH") == "1":
        raise RuntimeError(
            f"ACCO_DS_TEST_NO_LAUNCH=1 (make test-fast) but this test starts ranks of {script}. Mark it "
            "@pytest.mark.launcher (or the module with pytestmark = pytest.mark.launcher)."
        )
    for attempt in range(1, PORT_ATTEMPTS + 1):
        why, rc, text, cmds = _launch_once(script, world, args, timeout, env)
        # the port free_port() saw free was taken before rank 0 listened on it (another process's connection got
        # it as its ephemeral port): nothing ran, start again on another port
        if not why or attempt == PORT_ATTEMPTS or not any(_PORT_TAKEN in t for t in text):
            break
    if why and (check or why.startswith("did not finish")):
        tails = "\n".join(t[-3000:] for t in text)
        raise AssertionError(f"ranks of {script} (world {world}) {why}: {' '.join(cmds[0])}\n{tails}")
    return subprocess.CompletedProcess(cmds[0], rc, stdout="\n".join(text), stderr="")


def _launch_once(script: Path, world: int, args: list, timeout: float, env: dict | None):
    """One launch of ``run_local``'s ranks on a fresh port: (why it failed or "", return code, each rank's output,
    the ranks' commands)."""
    port = free_port()
    base = dict(env or rank_env())
    base.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world),
        LOCAL_SIZE=str(world),
        CROSS_RANK="0",
        CROSS_SIZE="1",
    )
    cmds = [[sys.executable, "-u", str(script), f"--local_rank={r}", *map(str, args)] for r in range(world)]
    with tempfile.TemporaryDirectory(prefix="ranks_") as logs, contextlib.ExitStack() as files:
        outs = [files.enter_context(open(Path(logs) / f"rank{r}.log", "w+")) for r in range(world)]
        procs = [
            _start_rank(cmds[r], {**base, "RANK": str(r), "LOCAL_RANK": str(r)}, outs[r])
            for r in range(world)
        ]
        why, rc = _wait_all(procs, time.monotonic() + timeout, timeout)
        cli_launch.cleanup_shm(port, world)
        text = []
        for r, fh in enumerate(outs):
            fh.seek(0)
            text.append(f"--- rank {r} (exit {procs[r].returncode}) ---\n{fh.read()}")
    return why, rc, text, cmds


def _start_rank(cmd: list, env: dict, out):
    """One rank: forked from a server that has imported torch and DeepSpeed (``tests/ranks/forked_ranks.py``; CPU
    ranks, unless ``ACCO_DS_TEST_FORK_RANKS=0``), else a fresh interpreter; its output into ``out``."""
    forked = forked_ranks.spawn(cmd, env, str(REPO), out.name)
    if forked is not None:
        return forked
    return subprocess.Popen(
        cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
    )


def _wait_all(procs: list, deadline: float, timeout: float) -> tuple:
    """Wait for every rank; ("", 0) when all exited 0, else (what went wrong, the status of the first rank seen
    failing, or -9 after a timeout); the others are then stopped."""
    while None in [
        p.poll() for p in procs
    ]:  # a list: every rank polled, not only up to the first one running
        failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode not in (None, 0)]
        if failed:
            _stop(procs)
            return "failed: " + ", ".join(f"rank {r} exited with status {rc}" for r, rc in failed), failed[0][
                1
            ]
        if time.monotonic() > deadline:
            _stop(procs)
            return f"did not finish in {timeout:.0f} s", -9
        time.sleep(0.05)
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        return "failed: " + ", ".join(f"rank {r} exited with status {rc}" for r, rc in failed), failed[0][1]
    return "", 0


def _stop(procs: list) -> None:
    """SIGTERM to every rank still running (its whole process group), SIGKILL to those alive 10 s later."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)
        end = time.monotonic() + grace
        while any(p.poll() is None for p in alive) and time.monotonic() < end:
            time.sleep(0.05)


def run_scenarios(world: int, scenarios: list, tmp: Path, backend: str = "gloo", **extra_env) -> dict:
    """Run the toy-model scenarios on ``world`` ranks; returns rank 0's results (see tests/ranks/worker.py).
    ``extra_env``: environment variables of the ranks (``rank_env``'s ``extra``)."""
    import torch

    spec = tmp / "scenarios.json"
    spec.write_text(json.dumps(scenarios))
    args = ["--scenarios", spec, "--out", tmp, "--backend", backend]
    env = rank_env(accelerator="cuda" if backend == "nccl" else "cpu", **extra_env)
    run_local(REPO / "tests" / "ranks" / "worker.py", world, args, env=env)
    return torch.load(tmp / "results.pt", weights_only=False)
