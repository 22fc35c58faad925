"""acco-train's periodic saves and its automatic resume (``--save-every``, ``--checkpoint-dir``;
``acco_ds.cli.checkpoints``), through both ways of starting it: its own DeepSpeed launch, and torchrun starting
every rank (``acco_ds.cli.in_launcher``), which is how an elastic agent restarts a job.

- A run of 6 steps saving every 2 keeps the newest two saves (``latest`` names the last complete one) and says
  what the saves cost; a second run pointed at the same folder with ``--steps 10`` at ANOTHER world size
  resumes at step 6 (ACCO re-shards the committed state), trains steps 7-10 only, and saves 8 and 10.
- Under torchrun (2 ranks, then a restart with 1): the second start resumes from the first one's last save,
  the run folder's ``starts.jsonl`` records both starts.
- fp16: a run resumed at another world size goes on from the saved loss scale and skipped-step count.
- A folder holding a checkpoint acco-train did not write is refused, naming the folder.
Tiny model, 2 CPU ranks, fp32 (fp16 where said)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from acco_ds.cli import launch as cli_launch
from tests.ranks.launch import free_port, rank_env

pytestmark = pytest.mark.launcher  # starts ranks through a launcher (left out by make test-fast)

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--n-layer", "1", "--d-model", "64", "--n-head", "2", "--context", "64", "--micro-batch", "4",
        "--grad-accum", "2", "--warmup-steps", "2", "--lr", "3e-3", "--eval-windows", "8", "--no-progress"]  # fmt: skip


def env() -> dict:
    base = rank_env()
    return dict(base, PYTHONPATH=os.pathsep.join([str(ROOT), base.get("PYTHONPATH", "")]))


def train(cwd: Path, *args, torchrun_world: int | None = None) -> subprocess.CompletedProcess:
    """``python -m acco_ds.train ...`` (its own launch) or, with ``torchrun_world``, under torchrun."""
    if torchrun_world is None:
        cmd = [sys.executable, "-m", "acco_ds.train", *TINY, *args]
    else:
        port = free_port()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
               torchrun_world, "--master-addr", "127.0.0.1", "--master-port", port,
               "-m", "acco_ds.train", *TINY, *args]  # fmt: skip
    cmd = [str(c) for c in cmd]
    try:
        return subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True, timeout=600)
    finally:
        if torchrun_world is not None:
            cli_launch.cleanup_shm(port, torchrun_world)


def ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]


def rank0(out: Path, label: str = "acco") -> dict:
    return json.loads((out / "runs" / label / "rank0.json").read_text())


def step_records(out: Path, label: str = "acco") -> list:
    return [json.loads(x) for x in (out / "runs" / label / "rank0.jsonl").read_text().splitlines()]


def saved_tags(folder: Path) -> list:
    return sorted((p.name for p in folder.iterdir() if p.is_dir()), key=lambda n: int(n[len("step") :]))


def test_saves_then_resumes_at_another_world_size(tmp_path):
    ckpt = tmp_path / "ckpt"
    common = ["--mode", "acco", "--save-every", "2", "--keep-checkpoints", "2", "--checkpoint-dir", ckpt]
    ok(train(tmp_path, *common, "--steps", "6", "--world-size", "2", "--out", tmp_path / "first"))
    first = rank0(tmp_path / "first")
    assert first["resumed_at_step"] == 0 and first["steps"] == 6
    assert first["saves"] == [2, 4, 6] and len(first["save_s"]) == 3 and first["checkpoint_bytes"] > 0
    assert saved_tags(ckpt) == ["step4", "step6"] and (ckpt / "latest").read_text().strip() == "step6"

    ok(train(tmp_path, *common, "--steps", "10", "--world-size", "1", "--out", tmp_path / "second"))
    second = rank0(tmp_path / "second")
    assert second["world"] == 1 and second["resumed_at_step"] == 6 and second["steps"] == 10
    assert second["saves"] == [8, 10] and saved_tags(ckpt) == ["step8", "step10"]
    records = step_records(tmp_path / "second")
    steps = [r["step"] for r in records]
    assert steps and min(steps) > 6 and max(steps) == 10, steps  # only the steps the checkpoint lacked
    # it went on from the trained model, not from initialisation (a loss of ln 256 = 5.55 there): its first
    # micro-batches' loss is below that, and 4 more steps lowered the validation loss
    first_mb_loss = records[0]["loss_sum"] / records[0]["mb"]
    assert first_mb_loss < math.log(256) - 0.4, first_mb_loss
    assert second["val_loss"] < first["val_loss"], (second["val_loss"], first["val_loss"])


def test_torchrun_restart_resumes_from_the_last_save(tmp_path):
    out = tmp_path / "job"
    args = ["--mode", "acco", "--save-every", "2", "--out", out]
    ok(train(tmp_path, *args, "--steps", "4", torchrun_world=2))
    ok(train(tmp_path, *args, "--steps", "6", torchrun_world=1))
    starts = [json.loads(x) for x in (out / "runs" / "acco" / "starts.jsonl").read_text().splitlines()]
    assert [(s["world"], s["resumed_at_step"], s["steps"]) for s in starts] == [(2, 0, 4), (1, 4, 6)]
    assert [(s["skipped_steps"], s["loss_scale"]) for s in starts] == [(0, None), (0, None)]  # fp32: no scale
    assert saved_tags(out / "checkpoints")[-1] == "step6"


def test_fp16_resume_keeps_the_loss_scale_and_the_skipped_steps(tmp_path):
    """--dtype fp16 from scale 2^20: the first run skips its overflowing steps and saves at step 4; the run resumed
    from that save at another world size starts from the saved scale and count (not from 2^20 and 0 again)."""
    ckpt = tmp_path / "ckpt"
    common = ["--mode", "acco", "--dtype", "fp16", "--initial-scale-power", "20", "--save-every", "4"]
    common += ["--checkpoint-dir", ckpt]
    ok(train(tmp_path, *common, "--steps", "4", "--world-size", "2", "--out", tmp_path / "first"))
    first = rank0(tmp_path / "first")
    assert first["fp16"] and first["saves"] == [4] and first["skipped_steps"] >= 1, first
    assert first["loss_scale"] < 2**20
    ok(train(tmp_path, *common, "--steps", "8", "--world-size", "1", "--out", tmp_path / "second"))
    second = rank0(tmp_path / "second")
    assert second["resumed_at_step"] == 4 and second["steps"] == 8
    records = step_records(tmp_path / "second")
    assert records[0]["step"] == 5 and records[0]["skipped_steps"] >= first["skipped_steps"], records[0]
    assert records[0]["loss_scale"] <= first["loss_scale"], (records[0], first["loss_scale"])
    assert second["skipped_steps"] >= first["skipped_steps"] and second["loss_scale"] <= first["loss_scale"]


def test_a_folder_with_someone_elses_checkpoint_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / "global_step3").mkdir(parents=True)
    (ckpt / "latest").write_text("global_step3")
    proc = train(tmp_path, "--mode", "acco", "--steps", "2", "--world-size", "1", "--save-every", "1",
                 "--checkpoint-dir", ckpt, "--out", tmp_path / "out")  # fmt: skip
    assert proc.returncode != 0
    assert str(ckpt) in proc.stdout + proc.stderr
