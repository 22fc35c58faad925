"""The CPU test ranks run on the CPU also where a GPU is visible (tests/ranks/launch.py, rank_env).

The ``deepspeed`` launcher writes ``CUDA_VISIBLE_DEVICES=0,...,W-1`` into every rank's environment whatever
the accelerator; this machine has no GPU, so the check is on what a rank's torch would see: the variable must
be empty in the rank when torch is imported, and DeepSpeed's accelerator must be the CPU one.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.ranks.launch import CPU_RANKS_HOOK, HIDE_CUDA_ENV, rank_env, run_deepspeed, run_local

RANK_SCRIPT = """
import json, os, sys
seen = {"cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "ds_accelerator": os.environ.get("DS_ACCELERATOR")}
import torch
seen["cuda_available"] = torch.cuda.is_available()
rank = os.environ["RANK"]
with open(os.path.join(sys.argv[-1], f"rank{rank}.json"), "w") as f:
    json.dump(seen, f)
"""


@pytest.mark.launcher
def test_launched_cpu_ranks_do_not_see_cuda(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    run_deepspeed(script, 2, [tmp_path], timeout=300)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen == {"cuda_visible": "", "ds_accelerator": "cpu", "cuda_available": False}, seen


def test_rank_env_for_gpu_ranks_leaves_cuda_alone(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    env = rank_env(accelerator="cuda", EXTRA=1)
    assert env["DS_ACCELERATOR"] == "cuda" and env["CUDA_VISIBLE_DEVICES"] == "0" and env["EXTRA"] == "1"
    assert HIDE_CUDA_ENV not in env and str(CPU_RANKS_HOOK) not in env["PYTHONPATH"].split(":")
    cpu = rank_env()
    assert cpu["DS_ACCELERATOR"] == "cpu" and cpu["CUDA_VISIBLE_DEVICES"] == "" and cpu[HIDE_CUDA_ENV] == "1"
    assert cpu["PYTHONPATH"].split(":")[0] == str(CPU_RANKS_HOOK)


def test_acco_train_ranks_go_to_the_cpu_when_gpus_are_fewer(monkeypatch, capsys):
    from acco_ds.cli import launch

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr(launch, "_cuda_device_count", lambda: 1)
    env = launch.rank_env(2, world=2)
    assert env["DS_ACCELERATOR"] == "cpu" and env["CUDA_VISIBLE_DEVICES"] == ""
    assert "2 ranks but 1 GPU(s)" in capsys.readouterr().err
    assert "DS_ACCELERATOR" not in launch.rank_env(1, world=1)  # one GPU per rank: NCCL on the GPU
    monkeypatch.setattr(launch, "_cuda_device_count", lambda: 0)
    assert launch.rank_env(1, world=1)["DS_ACCELERATOR"] == "cpu"
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    monkeypatch.setattr(launch, "_cuda_device_count", lambda: 1)
    assert launch.rank_env(1, world=2)["DS_ACCELERATOR"] == "cuda"  # the user's choice is kept


def test_ds_accelerator_cpu_makes_a_cpu_run_on_a_gpu_machine(monkeypatch):
    """The tests' processes carry DS_ACCELERATOR=cpu (tests/conftest.py): acco-train started from a test then
    plans 2 CPU ranks in fp32, as on a machine without a GPU, whatever torch sees."""
    from acco_ds.cli import args, launch

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert launch._cuda_device_count() == 0 and launch.default_world_size() == 2
    a = args.parse(["--out", "x"])
    assert a.world_size == 2 and a.dtype == "fp32"
    monkeypatch.delenv("DS_ACCELERATOR")
    assert launch._cuda_device_count() == 1 and launch.default_world_size() == 1


LOCAL_SCRIPT = """
import json, os, sys, time
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR", "CUDA_VISIBLE_DEVICES")
rank = int(os.environ["RANK"])
print(f"rank {rank} says hello", flush=True)
if sys.argv[-1] == "fail":
    up = os.path.join(sys.argv[-2], "rank0.up")
    if rank == 1:  # once rank 0 has said hello (the error must quote it), however late it starts
        while not os.path.exists(up):
            time.sleep(0.01)
        sys.exit(3)
    open(up, "w").close()
    time.sleep(120)
with open(os.path.join(sys.argv[-1], f"rank{rank}.json"), "w") as f:
    json.dump({"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv[1:]}, f)
"""


@pytest.mark.launcher
def test_run_local_gives_each_rank_what_the_deepspeed_launcher_gives(tmp_path):
    """The environment and ``--local_rank`` of each rank as DeepSpeed's per-node launcher sets them, CUDA hidden;
    every rank's output comes back."""
    script = tmp_path / "rank.py"
    script.write_text(LOCAL_SCRIPT)
    proc = run_local(script, 3, [tmp_path], timeout=120)
    assert proc.returncode == 0 and all(f"rank {r} says hello" in proc.stdout for r in range(3))
    ports = set()
    for r in range(3):
        seen = json.loads((tmp_path / f"rank{r}.json").read_text())
        env = seen.pop("env")
        ports.add(env.pop("MASTER_ADDR"))
        assert seen == {"argv": [f"--local_rank={r}", str(tmp_path)]}
        assert env == {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "3", "LOCAL_SIZE": "3",
                       "CROSS_RANK": "0", "CROSS_SIZE": "1", "CUDA_VISIBLE_DEVICES": ""}  # fmt: skip
    assert ports == {"127.0.0.1"}


@pytest.mark.launcher
def test_run_local_stops_the_other_ranks_when_one_fails(tmp_path):
    """Rank 1 exits 3 at once while rank 0 would sleep 2 minutes: rank 0 is stopped within seconds, the error
    names rank 1 and its status and quotes the ranks' output; ``check=False`` returns that status instead."""
    script = tmp_path / "rank.py"
    script.write_text(LOCAL_SCRIPT)
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="rank 1 exited with status 3") as err:
        run_local(script, 2, [tmp_path, "fail"], timeout=120)
    assert time.monotonic() - t0 < 60 and "rank 0 says hello" in str(err.value)
    proc = run_local(script, 2, [tmp_path, "fail"], timeout=120, check=False)
    assert proc.returncode == 3 and "rank 1 says hello" in proc.stdout


GLOO_SCRIPT = """
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.launcher
def test_run_local_starts_again_when_the_port_was_taken(tmp_path, monkeypatch):
    """The port free_port() returned is taken (here by a listening socket) before rank 0 listens on it: rank 0 fails
    with EADDRINUSE, and run_local launches again on another port instead of failing the test."""
    import socket

    from tests.ranks import launch

    script = tmp_path / "gloo_rank.py"
    script.write_text(GLOO_SCRIPT)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = [taken.getsockname()[1]]
        real = launch.free_port
        monkeypatch.setattr(launch, "free_port", lambda: ports.pop(0) if ports else real())
        proc = launch.run_local(script, 2, [], timeout=120)
        assert not ports, "the taken port was not tried first"
    assert proc.returncode == 0
    monkeypatch.setattr(launch, "PORT_ATTEMPTS", 1)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:  # one attempt: the failure is reported
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(launch, "free_port", lambda: taken.getsockname()[1])
        with pytest.raises(AssertionError, match="EADDRINUSE"):
            launch.run_local(script, 2, [], timeout=120)
