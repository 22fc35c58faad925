"""Starting the ranks of a run through DeepSpeed's launcher.

Contract: ``launch_command(spec_path, world, port)`` is the argv of DeepSpeed's per-node launcher for one node
(``python -u -m deepspeed.launcher.launch --world_info=<localhost: 0..W-1> --master_addr=127.0.0.1
--master_port=P --module acco_ds.cli.worker --spec SPEC``): exactly the command the ``deepspeed`` command's
runner builds and starts for a job on one machine, started without the runner, an interpreter that imports torch
and DeepSpeed only to start it (about 2.5 s of CPU and of start-up per run). W ranks, every socket on 127.0.0.1
(gloo on CPU, NCCL on GPUs); the per-node launcher sets each rank's environment, passes ``--local_rank`` and
stops every rank when one fails, as under ``deepspeed``. ``runner_command`` is the ``deepspeed`` command
itself (what users type; the tests of that path use it). ``run_ranks`` runs either (optionally wrapped, e.g. in
a throttled network namespace by the benchmark), with ``OMP_NUM_THREADS`` set to the threads per rank and the
package importable by the ranks, removes the shared-memory buffers DeepSpeed leaves behind on CPU
(``cleanup_shm``), and raises ``LaunchError`` with the tail of the output when a rank fails.

Where the ranks run (``rank_env``): on GPUs with NCCL when there is one GPU per rank; otherwise on the CPU
with gloo (``DS_ACCELERATOR=cpu``), also on a machine with fewer GPUs than ranks (NCCL refuses two ranks on
one GPU). A ``DS_ACCELERATOR`` already in the environment is kept; ``DS_ACCELERATOR=cpu`` makes the run a CPU
run (default world size 2) on a machine with GPUs too.
"""

from __future__ import annotations

import base64
import json
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
    """The ``deepspeed`` command (DeepSpeed's runner), with this interpreter, unbuffered."""
    return [sys.executable, "-u", "-m", "deepspeed.launcher.runner"]


def _target(target: str) -> List[str]:
    """A module is run as ``python -m`` (``--module``), a ``.py`` path as a script."""
    return [target] if target.endswith(".py") else ["--module", target]


def world_info(world: int) -> str:
    """``--world_info`` of a one-node job of ``world`` ranks, encoded as DeepSpeed's runner encodes it
    (``encode_world_info``: URL-safe base64 of the JSON ``{"localhost": [0, ..., W-1]}``)."""
    return base64.urlsafe_b64encode(json.dumps({"localhost": list(range(world))}).encode()).decode()


def launch_command(
    spec_path: str | None,
    world: int,
    port: int,
    target: str = "acco_ds.cli.worker",
    extra: List[str] | None = None,
) -> List[str]:
    """The per-node launcher argv (see the module docstring). ``target`` is a module (run as ``python -m``) or a
    ``.py`` script path; ``--spec spec_path`` (when given) and ``extra`` are passed to every rank."""
    cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world_info(world)}"]
    cmd += ["--master_addr=127.0.0.1", f"--master_port={port}", "--log_level=warning", *_target(target)]
    if spec_path:
        cmd += ["--spec", str(spec_path)]
    return cmd + list(extra or [])


def runner_command(world: int, port: int, target: str, extra: List[str] | None = None) -> List[str]:
    """The ``deepspeed`` command's argv for ``world`` ranks on 127.0.0.1 (``deepspeed --num_gpus W
    --master_addr 127.0.0.1 --master_port P [--module] target extra``), as users start a job."""
    cmd = launcher_prefix() + ["--num_gpus", str(world)]
    cmd += ["--master_addr", "127.0.0.1", "--master_port", str(port), "--log_level", "warning"]
    return cmd + _target(target) + list(extra or [])


def launched_world_and_port(cmd: List[str]) -> tuple:
    """(world size, master port) of a ``launch_command`` or ``runner_command`` argv; None where absent."""
    world = port = None
    for i, arg in enumerate(cmd):
        if arg.startswith("--world_info="):
            world = sum(len(v) for v in json.loads(base64.urlsafe_b64decode(arg.split("=", 1)[1])).values())
        elif arg.startswith("--master_port="):
            port = int(arg.split("=", 1)[1])
        elif arg == "--num_gpus" and i + 1 < len(cmd):
            world = int(cmd[i + 1])
        elif arg == "--master_port" and i + 1 < len(cmd):
            port = int(cmd[i + 1])
    return world, port


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
    world, port = launched_world_and_port(cmd)
    env = rank_env(threads, world)
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
        if port and world:
            cleanup_shm(port, world)
    if proc.returncode != 0:
        where = f" (log: {log_path})" if log_path else ""
        raise LaunchError(
            f"the ranks exited with status {proc.returncode}{where}:\n{tail}\ncommand: {shlex.join(full)}"
        )
