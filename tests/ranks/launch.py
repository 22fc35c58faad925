"""Start ranks the way users do: DeepSpeed's launcher on 127.0.0.1, through ``acco_ds.cli.launch`` (the
launcher command and environment ``acco-train`` uses), plus what the tests need on top.

The ranks of the CPU tests run on the CPU also on a machine with GPUs (``rank_env()``): the same suite passes
unchanged there. ``accelerator="cuda"`` (the GPU tests, NCCL) leaves the GPUs visible. Rank scripts live in this
folder and are launched by path; the repository root reaches them through PYTHONPATH (no ``sys.path`` edits)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from acco_ds.cli import launch as cli_launch
from acco_ds.cli.launch import free_port, launcher_prefix

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
]


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
    port = free_port()
    cmd = cli_launch.launch_command(None, world, port, target=str(script), extra=[str(a) for a in args])
    try:
        proc = subprocess.run(
            cmd, env=env or rank_env(), capture_output=True, text=True, timeout=timeout, cwd=REPO
        )
    finally:
        cli_launch.cleanup_shm(port, world)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-6000:]
        raise AssertionError(f"deepspeed launch failed (rc={proc.returncode}): {' '.join(cmd)}\n{tail}")
    return proc


def run_scenarios(world: int, scenarios: list, tmp: Path, backend: str = "gloo") -> dict:
    """Run the toy-model scenarios on ``world`` ranks; returns rank 0's results (see tests/ranks/worker.py)."""
    import torch

    spec = tmp / "scenarios.json"
    spec.write_text(json.dumps(scenarios))
    args = ["--scenarios", spec, "--out", tmp, "--backend", backend]
    env = rank_env(accelerator="cuda" if backend == "nccl" else "cpu")
    run_deepspeed(REPO / "tests" / "ranks" / "worker.py", world, args, env=env)
    return torch.load(tmp / "results.pt", weights_only=False)
