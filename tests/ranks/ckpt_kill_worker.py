"""Per-rank worker for tests/checkpoint/test_damaged_and_interrupted.py (started by the ``deepspeed`` launcher).

``--phase save``: train 2 steps, save tag ``step2`` (complete), train 2 more steps and save tag
``step4`` while rank ``--kill_rank`` dies in the middle of writing its optimizer file: it writes
half of the file, waits ``--linger`` seconds (the other ranks go on with the save meanwhile) and
SIGKILLs itself; the launcher then ends the job. ``--variant acco`` saves through the engine's
``save_checkpoint`` (acco_ds's crash-safe save), ``--variant deepspeed`` through DeepSpeed's own
method (kept by register.py), to show what it leaves behind. Rank 0 saves the committed fp32
parameters at step 2 to ``<dir>/expected_step2.pt`` first.

``--phase resume``: load ``<dir>`` (tag from ``latest``; when that fails, record the error and load
``step2`` explicitly), record what was loaded, compare the loaded parameters with the expected ones, train 2 more steps; then try the tags given with
``--try_tags`` and record the error each one raises. Rank 0 writes ``<dir>/resume.json``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import time

import deepspeed  # noqa: E402
import torch
from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: E402

import acco_ds  # noqa: E402,F401
from tests.ranks import rank_start, readback, toy  # noqa: E402

GAS = 4


def config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": toy.MICRO_BATCH,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "ACCO", "params": {"lr": 0.02, "mode": "acco"}},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
    }


def train(engine, rank: int, steps: int, start: int) -> None:
    for s in range(steps):
        for j in range(GAS):
            loss = engine(*toy.micro_batch(rank, (start + s) * GAS + j))
            engine.backward(loss)
            engine.step()


def committed(engine) -> torch.Tensor:
    return readback.full_state(engine, toy.trainable(engine.module))


def save(engine, args, tag: str) -> None:
    if args.variant == "acco":
        engine.save_checkpoint(args.dir, tag=tag)
    else:
        DeepSpeedEngine._acco_original_save_checkpoint(engine, args.dir, tag=tag)


def die_while_writing(engine, rank: int, linger: float) -> None:
    """Make this rank's next optimizer-state write stop half-way and kill the process."""
    ce = engine.checkpoint_engine
    original = ce.save

    def save_half_then_die(state_dict, path):
        if "optim_states" not in str(path):
            return original(state_dict, path)
        buf = io.BytesIO()
        torch.save(state_dict, buf)
        data = buf.getvalue()
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
        print(f"ACCO_HALF_WRITTEN rank {rank} {path}", flush=True)
        time.sleep(linger)
        os.kill(os.getpid(), signal.SIGKILL)

    ce.save = save_half_then_die


def phase_save(engine, args, rank: int) -> None:
    train(engine, rank, 2, 0)
    params = committed(engine)
    if rank == 0:
        torch.save(params, os.path.join(args.dir, "expected_step2.pt"))
    save(engine, args, "step2")
    train(engine, rank, 2, 2)
    if rank == args.kill_rank:
        die_while_writing(engine, rank, args.linger)
    save(engine, args, "step4")
    print("ACCO_SAVE_RETURNED", flush=True)  # never reached: the killed rank takes the job down


def phase_resume(engine, args, rank: int) -> None:
    with open(os.path.join(args.dir, "latest")) as f:
        out = {"latest": f.read()}
    try:
        load_path, _ = engine.load_checkpoint(args.dir)
        out["latest_error"] = None
    except Exception as err:  # the DeepSpeed variant: latest names the partial checkpoint
        out["latest_error"] = {"type": type(err).__name__, "message": str(err)}
        load_path, _ = engine.load_checkpoint(args.dir, tag="step2")
    out["loaded"] = None if load_path is None else os.path.relpath(load_path, args.dir)
    expected = torch.load(os.path.join(args.dir, "expected_step2.pt"))
    got = committed(engine)
    out["max_diff_to_step2"] = (got - expected).abs().max().item()
    train(engine, rank, 2, 2)
    out["trained_on"] = bool(torch.isfinite(committed(engine)).all())
    out["errors"] = {}
    for tag in args.try_tags:
        try:
            path, _ = engine.load_checkpoint(args.dir, tag=tag)
            out["errors"][tag] = {"type": None, "loaded": path}
        except Exception as err:  # recorded for the test
            out["errors"][tag] = {"type": type(err).__name__, "message": str(err)}
    if rank == 0:
        with open(os.path.join(args.dir, "resume.json"), "w") as f:
            json.dump(out, f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=("save", "resume"), required=True)
    ap.add_argument("--dir", nargs="+", required=True, help="save: one folder; resume: one or more")
    ap.add_argument("--variant", choices=("acco", "deepspeed"), default="acco")
    ap.add_argument("--kill_rank", type=int, default=1)
    ap.add_argument("--linger", type=float, default=3.0)
    ap.add_argument("--try_tags", nargs="*", default=[])
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    rank = rank_start.init_rank()
    for folder in args.dir:  # resume: one fresh engine per folder
        model = toy.build()
        engine, *_ = deepspeed.initialize(model=model, config=config(), model_parameters=model.parameters())
        args_one = argparse.Namespace(**{**vars(args), "dir": folder})
        if args.phase == "save":
            phase_save(engine, args_one, rank)
        else:
            phase_resume(engine, args_one, rank)
        engine.optimizer.pipeline.close()


if __name__ == "__main__":
    main()
