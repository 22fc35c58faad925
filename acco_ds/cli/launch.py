"""Starting the ranks of a run through DeepSpeed's launcher.

Contract: ``launch_command(spec_path, world, port)`` is the argv of
``python -m deepspeed.launcher.runner --num_gpus W --master_addr 127.0.0.1 --master_port P
--module acco_ds.cli.worker --spec SPEC``: one node, W ranks, every socket on 127.0.0.1 (gloo on
CPU, NCCL on GPUs). ``run_ranks`` runs it (optionally wrapped, e.g. in a throttled network
namespace by the benchmark), with ``OMP_NUM_THREADS`` set to the threads per rank and the
package importable by the ranks, removes the shared-memory buffers DeepSpeed leaves behind on
CPU (``cleanup_shm``), and raises ``LaunchError`` with the tail of the output when a rank fails.

Where the ranks run (``rank_env``): on GPUs with NCCL when there is one GPU per rank; otherwise on the CPU
with gloo (``DS_ACCELERATOR=cpu``), also on a machine with fewer GPUs than ranks (NCCL refuses two ranks on
one GPU). A ``DS_ACCELERATOR`` already in the environment is kept; ``DS_ACCELERATOR=cpu`` makes the run a CPU
run (default world size 2) on a machine with GPUs too.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable, List

PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])


class LaunchError(RuntimeError):
    """A launched run exited with a non-zero status."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cuda_available() -> bool:
    return _cuda_device_count() > 0


def _cuda_device_count() -> int:
    """GPUs the ranks may use: 0 when ``DS_ACCELERATOR=cpu`` names the CPU accelerator (then the run is a CPU
    run whatever the machine has), else torch's count."""
    if os.environ.get("DS_ACCELERATOR", "").strip().lower() == "cpu":
        return 0
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # pragma: no cover - a broken CUDA setup falls back to CPU ranks
        return 0


def default_world_size() -> int:
    """All GPUs when CUDA is there, else 2 CPU ranks."""
    if _cuda_available():
        import torch

        return torch.cuda.device_count()
    return 2


def launcher_prefix() -> List[str]:
    """DeepSpeed's launcher (what the ``deepspeed`` command runs), with this interpreter, unbuffered."""
    return [sys.executable, "-u", "-m", "deepspeed.launcher.runner"]


def launch_command(
    spec_path: str | None,
    world: int,
    port: int,
    target: str = "acco_ds.cli.worker",
    extra: List[str] | None = None,
) -> List[str]:
    """The launcher argv. ``target`` is a module (run as ``python -m``) or a ``.py`` script path;
    ``--spec spec_path`` (when given) and ``extra`` are passed to every rank."""
    cmd = launcher_prefix() + ["--num_gpus", str(world)]
    cmd += ["--master_addr", "127.0.0.1", "--master_port", str(port), "--log_level", "warning"]
    cmd += [target] if target.endswith(".py") else ["--module", target]
    if spec_path:
        cmd += ["--spec", str(spec_path)]
    return cmd + list(extra or [])


def rank_env(threads: int, world: int | None = None) -> dict:
    """The ranks' environment: ``threads`` OpenMP/MKL threads each, the package importable, and the CPU
    accelerator (``DS_ACCELERATOR=cpu``, ``CUDA_VISIBLE_DEVICES=""`` for the launcher) unless every one of the
    ``world`` ranks (None: any number) gets its own GPU or the environment names an accelerator."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    paths = [PACKAGE_PARENT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("PYTHONUNBUFFERED", "1")
    warn = "ignore::FutureWarning,ignore::DeprecationWarning"
    env["PYTHONWARNINGS"] = ",".join(w for w in (env.get("PYTHONWARNINGS"), warn) if w)
    gpus = _cuda_device_count()
    if "DS_ACCELERATOR" not in env and gpus == 0:
        env["DS_ACCELERATOR"] = "cpu"  # skips DeepSpeed's probing and its warning on CPU-only hosts
    elif "DS_ACCELERATOR" not in env and world is not None and world > gpus:
        env["DS_ACCELERATOR"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
        print(
            f"acco_ds: {world} ranks but {gpus} GPU(s): the ranks run on the CPU with gloo (NCCL cannot put two "
            f"ranks on one GPU; use --world-size {gpus} for GPU ranks).",
            file=sys.stderr,
            flush=True,
        )
    return env


def cleanup_shm(port: int, world: int, addr: str = "127.0.0.1") -> int:
    """Remove the shared-memory buffers DeepSpeed's CPU communication op creates per rank
    (``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``, 69 MB each) and never
    unlinks: without this every CPU run leaks them into RAM. Returns how many were removed."""
    removed = 0
    uid = os.getuid() if hasattr(os, "getuid") else 0
    for rank in range(world):
        path = Path(f"/dev/shm/deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{rank}")
        try:
            path.unlink()
            removed += 1
        except (FileNotFoundError, PermissionError, IsADirectoryError):
            pass
    return removed


def _flag(cmd: List[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd[:-1] else None


def run_ranks(
    cmd: List[str],
    threads: int,
    log_path: Path | None = None,
    show_stderr: bool = False,
    wrap: Callable[[str], List[str]] | None = None,
    timeout: float | None = None,
    env_extra: dict | None = None,
) -> None:
    """Run ``cmd`` (wrapped by ``wrap(shell_command)`` when given) and wait for it, with
    ``env_extra`` added to the ranks' environment.

    Output: to the terminal when ``log_path`` is None; else stdout (DeepSpeed's log chatter) goes
    to ``log_path`` and stderr too, unless ``show_stderr`` keeps it on the terminal (the progress
    bar and any traceback). Raises LaunchError, quoting the end of the log, on a non-zero exit."""
    full = wrap(shlex.join(cmd)) if wrap else cmd
    world = _flag(cmd, "--num_gpus")
    env = rank_env(threads, int(world) if world else None)
    env.update(env_extra or {})
    tail = ""
    try:
        if log_path is None:
            proc = subprocess.run(full, env=env, timeout=timeout)
        else:
            with open(log_path, "w") as fh:
                err = None if show_stderr else subprocess.STDOUT
                proc = subprocess.run(full, env=env, stdout=fh, stderr=err, timeout=timeout)
            tail = "\n".join(Path(log_path).read_text(errors="replace").splitlines()[-40:])
    finally:
        port, world = _flag(cmd, "--master_port"), _flag(cmd, "--num_gpus")
        if port and world:
            cleanup_shm(int(port), int(world), _flag(cmd, "--master_addr") or "127.0.0.1")
    if proc.returncode != 0:
        where = f" (log: {log_path})" if log_path else ""
        raise LaunchError(
            f"the ranks exited with status {proc.returncode}{where}:\n{tail}\ncommand: {shlex.join(full)}"
        )
