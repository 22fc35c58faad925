"""acco-train: the pieces (data, model, configs, metrics, options) and one tiny real run that
launches 2 CPU ranks with the DeepSpeed launcher and checks the outputs and that the loss fell."""

from __future__ import annotations

import json
import math
import shutil
import subprocess

import pytest
import torch

from acco_ds.cli import dsconfig
from acco_ds.cli.args import parse
from acco_ds.cli.metrics import merge_ranks, smoothed_loss, summarize, time_to_loss
from acco_ds.data import load_corpus, micro_batch, stream, val_windows
from acco_ds.data.corpus import split_blocks
from acco_ds.models import GPTConfig, TinyGPT
from tests.cli.train_run import TINY, run_train


def test_corpus_is_the_stdlib_split_deterministically():
    a, b = load_corpus(), load_corpus()
    assert a.files > 50 and a.train.dtype == torch.uint8
    assert a.sha256 == b.sha256 and torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    total = a.train.numel() + a.val.numel()
    assert 0.04 < a.val.numel() / total < 0.06
    assert b"def " in bytes(a.train[:200000].tolist())


def test_split_blocks_every_nth_block_is_validation():
    data = torch.arange(10 * 4, dtype=torch.int64)
    train, val = split_blocks(data, block=4, val_every=5)
    assert val.tolist() == list(range(16, 20)) + list(range(36, 40))
    assert train.numel() == 32 and not set(train.tolist()) & set(val.tolist())


def test_micro_batches_are_a_pure_function_of_seed_rank_index():
    data = torch.randint(0, 256, (5000,), dtype=torch.uint8)
    x1, y1 = micro_batch(data, 16, 4, seed=3, rank=1, index=7)
    x2, y2 = micro_batch(data, 16, 4, seed=3, rank=1, index=7)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])
    x3, _ = micro_batch(data, 16, 4, seed=3, rank=0, index=7)
    assert not torch.equal(x1, x3)
    it = stream(data, 16, 4, seed=3, rank=1, start=7)
    assert torch.equal(next(it)[0], x1)
    xa, _ = val_windows(data, 16, 10, rank=0, world=2)
    xb, _ = val_windows(data, 16, 10, rank=1, world=2)
    assert xa.shape == (5, 16) and xb.shape == (5, 16) and not torch.equal(xa, xb)


def test_tiny_gpt_loss_and_shapes():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(n_layer=1, n_head=2, d_model=32, context=16))
    x = torch.randint(0, 256, (3, 16))
    assert model(x).shape == (3, 16, 256)
    loss = model(x, x)
    assert abs(loss.item() - math.log(256)) < 1.0  # near uniform at initialisation
    with pytest.raises(ValueError, match="exceeds the model context"):
        model(torch.randint(0, 256, (1, 17)))
    with pytest.raises(ValueError, match="divisible by n_head"):
        GPTConfig(d_model=30, n_head=4)


def test_configs_share_everything_but_the_optimizer_section():
    k = dsconfig.Knobs(micro_batch=4, grad_accum=4, world_size=2, num_params=10**6)
    cfgs = {m: dsconfig.build_config(m, k) for m in dsconfig.ALL_MODES}
    for cfg in cfgs.values():
        assert cfg["train_batch_size"] == 32 and cfg["gradient_clipping"] == 1.0
        assert cfg["scheduler"] == cfgs["zero1"]["scheduler"]
    assert cfgs["acco"]["optimizer"]["type"] == "ACCO" and cfgs["acco"]["zero_optimization"] == {"stage": 1}
    assert cfgs["sync"]["optimizer"]["params"]["accumulation"] == "fixed"
    assert cfgs["zero2"]["zero_optimization"]["overlap_comm"] is True
    assert cfgs["zero1"]["optimizer"]["params"]["betas"] == cfgs["acco"]["optimizer"]["params"]["betas"]
    with pytest.raises(ValueError, match="even --grad-accum"):
        dsconfig.build_config("acco", dsconfig.Knobs(micro_batch=4, grad_accum=3, world_size=2))
    assert dsconfig.config_mode(cfgs["dpu"]) == ("dpu", "fixed")
    assert dsconfig.config_mode(cfgs["zero2"]) == ("zero2", "fixed")
    assert "peek_lr_scale" not in cfgs["acco"]["optimizer"]["params"]  # the paper's estimate unless asked
    ahead = dsconfig.Knobs(micro_batch=4, grad_accum=4, world_size=2, peek_lr_scale=1.5)
    assert dsconfig.build_config("acco", ahead)["optimizer"]["params"]["peek_lr_scale"] == 1.5
    assert "peek_lr_scale" not in dsconfig.build_config("dpu", ahead)["optimizer"]["params"]
    kept = dsconfig.Knobs(micro_batch=4, grad_accum=4, world_size=2, memory_state=True)
    assert dsconfig.build_config("acco", kept)["optimizer"]["params"]["memory_state"] == {"enabled": True}
    kept = dsconfig.Knobs(
        micro_batch=4, grad_accum=4, world_size=2, memory_state=True, memory_state_form="state"
    )
    ms = dsconfig.build_config("acco", kept)["optimizer"]["params"]["memory_state"]
    assert ms == {"enabled": True, "peer_copy_form": "state"}


def test_user_config_batch_is_checked(tmp_path):
    k = dsconfig.Knobs(micro_batch=4, grad_accum=2, world_size=2)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}))
    assert dsconfig.load_user_config(str(path), k)["train_batch_size"] == 8
    path.write_text(json.dumps({"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2}))
    with pytest.raises(ValueError, match="train_batch_size=7"):
        dsconfig.load_user_config(str(path), k)


def test_options_are_checked(capsys):
    a = parse(["--out", "x"])
    assert a.mode == ["acco", "zero1"] and a.world_size >= 1 and a.threads >= 1
    for bad, msg in (
        (["--grad-accum", "3"], "even --grad-accum"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--peek-lr-scale", "0"], "--peek-lr-scale must be in (0, 4]"),
        (["--peek-lr-scale", "1.5", "--mode", "sync"], "--peek-lr-scale applies to the acco run"),
        (["--memory-state-form", "state"], "--memory-state-form state applies with --memory-state only"),
    ):
        with pytest.raises(SystemExit):
            parse(bad)
        assert msg in capsys.readouterr().err


def _rank_log(times, mbs, losses):
    return [
        {"step": i + 1, "t": t, "mb": m, "loss_sum": s} for i, (t, m, s) in enumerate(zip(times, mbs, losses))
    ]


def test_merge_and_summary_of_rank_records():
    logs = [
        _rank_log([1.0, 2.0, 3.0, 4.0], [2, 4, 6, 8], [10.0, 18.0, 24.0, 28.0]),
        _rank_log([1.1, 2.2, 3.0, 4.5], [2, 4, 6, 8], [10.0, 18.0, 24.0, 28.0]),
    ]
    recs = merge_ranks(logs, micro_batch=3)
    assert [r["time_s"] for r in recs] == [1.1, 2.2, 3.0, 4.5]
    assert [r["samples"] for r in recs] == [12, 24, 36, 48]
    assert recs[0]["loss"] == pytest.approx(5.0) and recs[-1]["loss"] == pytest.approx(2.0)
    ranks = [{"train_s": 4.5, "peak_mem_mib": 1.0, "micro_batches_local": 8, "val_loss": 2.5}] * 2
    s = summarize(recs, ranks, warmup=1, micro_batch=3)
    assert s["step_time_s"] == pytest.approx(1.1)  # median of 1.1, 0.8, 1.5
    assert s["samples_per_s"] == pytest.approx(36 / 3.4)
    assert smoothed_loss(recs, 24)[-1] == pytest.approx((56 - 36) / 8)
    assert time_to_loss(recs, 3.5, 12) == 3.0 and time_to_loss(recs, 0.1, 12) is None


def test_summary_says_what_communication_cost_and_acco_hid():
    """The overlap figures of each ACCO run: the jobs' time over the training time, and the part of it the training
    thread did not wait for; none for a run without ACCO; the table and the closing sentence show them."""
    from acco_ds.cli.job import overlap_line, table_rows

    recs = merge_ranks(
        [_rank_log([1.0, 2.0, 3.0, 4.0], [2, 4, 6, 8], [10.0, 18.0, 24.0, 28.0])], micro_batch=3
    )
    stats = {"job_reduce_scatter_s": 0.6, "job_step_s": 0.2, "job_all_gather_s": 0.2, "comm_wait_s": 0.25}
    rank = {"train_s": 4.0, "peak_mem_mib": 1.0, "micro_batches_local": 8, "val_loss": 2.5}
    acco = summarize(recs, [dict(rank, stats=stats)], warmup=1, micro_batch=3)
    zero1 = summarize(recs, [rank], warmup=1, micro_batch=3)
    assert acco["comm_share"] == pytest.approx(0.25) and acco["hidden_share"] == pytest.approx(0.75)
    assert zero1["comm_share"] is None and zero1["hidden_share"] is None
    rows = table_rows({"runs": {"acco": acco, "zero1": zero1}})
    i, j = rows[0].index("comm % of time"), rows[0].index("comm hidden %")
    assert (rows[1][i], rows[1][j], rows[2][i], rows[2][j]) == ("25", "75", "-", "-")
    line = overlap_line({"runs": {"acco": acco, "zero1": zero1}})
    assert "acco: communication 25% of the training time, 75% of it hidden" in line and "zero1" not in line
    assert overlap_line({"runs": {"zero1": zero1}}) is None


def _acco_works() -> bool:
    from acco_ds.cli.job import acco_registered

    return acco_registered()[0]


@pytest.mark.launcher
def test_acco_train_tiny_run(tmp_path):
    """A real 2-rank run of every default mode with tiny settings (about a minute on 2 CPU cores)."""
    out = tmp_path / "out"
    modes = ["acco", "zero1"] if _acco_works() else ["zero1"]
    proc, summary, lines = run_train(tmp_path, ["--mode", *modes, "--steps", "16", *TINY])
    assert (out / "loss_vs_samples.png").stat().st_size > 1000 and (
        out / "loss_vs_time.png"
    ).stat().st_size > 1000
    for mode in modes:
        s = summary["runs"][mode]
        mine = [x for x in lines if x["mode"] == mode]
        assert s["steps"] == 16 and mine[-1]["step"] == 16 and mine[-1]["samples"] == 16 * 2 * 4 * 2
        assert mine[-1]["loss"] < mine[0]["loss"] - 1.0, (mode, mine[0]["loss"], mine[-1]["loss"])
        assert s["val_loss"] < math.log(256) - 1.0
        assert len(s["peak_mem_mib"]) == 2 and min(s["peak_mem_mib"]) > 50
        # the validation curve: at the start and every step (--eval-every defaults to steps / 10, at least 1), the
        # last point the final validation loss at the training time
        curve = s["val_curve"]
        assert curve["step"] == list(range(17)) and curve["val_loss"][-1] == s["val_loss"]
        assert curve["time_s"][0] == 0.0 and curve["time_s"][-1] == pytest.approx(s["train_s"], rel=0.05)
    assert summary["machine"]["deepspeed"] and summary["model"]["params"] > 0
    if "acco" in modes:  # the time to zero1's final validation loss, and the sentence closing the summary
        t = summary["time_to_loss"]
        assert t["baseline"] == "zero1" and t["baseline_crossing"]["reached"] and "acco" in t["runs"]
        assert "time to zero1's final validation loss" in proc.stdout
        assert "acco-train: zero1's final validation loss" in proc.stdout


@pytest.mark.skipif(
    shutil.which("acco-train") is None, reason="acco-train is not installed (pip install -e .)"
)
def test_console_script_help():
    proc = subprocess.run(["acco-train", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--accumulation" in proc.stdout


def test_progress_loss_keeps_the_last_value_when_no_micro_batch_ran():
    from acco_ds.cli.steplog import StepLog

    log = StepLog()
    assert math.isnan(log.recent_loss())
    log.micro(2.0)
    log.micro(4.0)
    assert log.recent_loss() == 3.0
    assert log.recent_loss() == 3.0  # the final update after the loop: no new micro-batch
    log.micro(1.0)
    assert log.recent_loss() == 1.0
