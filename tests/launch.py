"""Start ranks the way users do: the ``deepspeed`` launcher on 127.0.0.1 with gloo (CPU).

The ranks of the CPU tests run on the CPU also on a machine with GPUs (``rank_env()``): the same suite passes
unchanged there. ``accelerator="cuda"`` (the GPU tests, NCCL) leaves the GPUs visible."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_cmd() -> list:
    exe = shutil.which("deepspeed")
    return [exe] if exe else [sys.executable, "-m", "deepspeed.launcher.runner"]


CPU_RANKS_HOOK = REPO / "tests" / "cpu_ranks"  # sitecustomize.py: hides CUDA in the ranks at start-up
HIDE_CUDA_ENV = "ACCO_DS_TEST_HIDE_CUDA"


def rank_env(accelerator: str = "cpu", **extra) -> dict:
    """The environment of launched ranks (and of the launcher), plus ``extra`` variables.

    ``accelerator="cpu"``: ``DS_ACCELERATOR=cpu`` (DeepSpeed's CPU accelerator, gloo) and CUDA hidden:
    ``CUDA_VISIBLE_DEVICES=""`` for the launcher and, since the ``deepspeed`` launcher sets
    ``CUDA_VISIBLE_DEVICES=0..W-1`` in every rank even for the CPU accelerator, a start-up hook
    (``tests/cpu_ranks/sitecustomize.py``, first on PYTHONPATH) that empties it again in each rank before torch
    loads. ``accelerator="cuda"``: ``DS_ACCELERATOR=cuda``, GPUs as the environment has them."""
    if accelerator not in ("cpu", "cuda"):
        raise ValueError(f"rank_env: accelerator must be 'cpu' or 'cuda', got {accelerator!r}")
    env = dict(os.environ)
    paths = [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    paths = [p for p in paths if p != str(CPU_RANKS_HOOK)]
    env.pop(HIDE_CUDA_ENV, None)
    env["DS_ACCELERATOR"] = accelerator
    if accelerator == "cpu":
        paths.insert(0, str(CPU_RANKS_HOOK))
        env.update({HIDE_CUDA_ENV: "1", "CUDA_VISIBLE_DEVICES": ""})
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(paths))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_deepspeed(script: Path, world: int, args: list, timeout: float = 600, env: dict | None = None):
    """Run ``deepspeed --num_gpus world script args`` and return the CompletedProcess (raises on failure
    with the ranks' output in the message)."""
    cmd = deepspeed_cmd() + [
        "--num_gpus",
        str(world),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(script),
        *map(str, args),
    ]
    proc = subprocess.run(
        cmd, env=env or rank_env(), capture_output=True, text=True, timeout=timeout, cwd=REPO
    )
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-6000:]
        raise AssertionError(f"deepspeed launch failed (rc={proc.returncode}): {' '.join(cmd)}\n{tail}")
    return proc


def run_scenarios(world: int, scenarios: list, tmp: Path, backend: str = "gloo") -> dict:
    """Run the toy-model scenarios on ``world`` ranks; returns rank 0's results (see dist/worker.py)."""
    import torch

    spec = tmp / "scenarios.json"
    spec.write_text(json.dumps(scenarios))
    args = ["--scenarios", spec, "--out", tmp, "--backend", backend]
    env = rank_env(accelerator="cuda" if backend == "nccl" else "cpu")
    run_deepspeed(REPO / "tests" / "dist" / "worker.py", world, args, env=env)
    return torch.load(tmp / "results.pt", weights_only=False)
