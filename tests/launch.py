"""Start ranks the way users do: the ``deepspeed`` launcher on 127.0.0.1 with gloo (CPU)."""

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


def rank_env(**extra) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
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
    run_deepspeed(REPO / "tests" / "dist" / "worker.py", world, args)
    return torch.load(tmp / "results.pt", weights_only=False)
