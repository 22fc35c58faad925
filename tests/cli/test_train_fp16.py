"""acco-train --dtype fp16: the options and configs (DeepSpeed's dynamic loss scaling for every contender), the
records and reports that carry the loss scale and the skipped steps, and one short real run of acco and zero1 on 2
CPU ranks (fp16 allowed on the CPU accelerator in the ranks where the CPU lacks fp16 kernels) that starts at a loss
scale too high for fp16, so they skip steps while the scale comes down, and still train; sync beside them takes
ZeRO-1's decisions."""

from __future__ import annotations

import math

import pytest
import torch

from acco_ds.cli import dsconfig
from acco_ds.cli.args import parse
from acco_ds.cli.job import table_rows
from acco_ds.cli.metrics import merge_ranks, summarize
from acco_ds.cli.steplog import StepLog
from tests.cli.train_run import TINY, run_train


def test_fp16_options_fill_deepspeed_defaults_and_are_checked(capsys):
    a = parse(["--out", "x", "--dtype", "fp16"])
    assert (a.dtype, a.initial_scale_power, a.loss_scale_window) == ("fp16", 16, 1000)
    a = parse(["--out", "x", "--dtype", "fp16", "--initial-scale-power", "0", "--loss-scale-window", "3"])
    assert (a.initial_scale_power, a.loss_scale_window) == (0, 3)
    for bad, msg in (
        (["--dtype", "fp32", "--initial-scale-power", "8"], "--initial-scale-power applies to --dtype fp16"),
        (["--loss-scale-window", "8"], "--loss-scale-window applies to --dtype fp16"),
        (["--dtype", "fp16", "--initial-scale-power", "64"], "--initial-scale-power must be in [0, 63]"),
        (["--dtype", "fp16", "--loss-scale-window", "0"], "--loss-scale-window must be >= 1, got 0"),
        (["--dtype", "fp16", "--config", "ds.json"], "--dtype fp16 with --config"),
    ):
        with pytest.raises(SystemExit):
            parse(["--out", "x", *bad])
        assert msg in capsys.readouterr().err, bad


def test_fp16_config_of_every_contender_is_deepspeed_dynamic_loss_scaling():
    k = dsconfig.Knobs(
        micro_batch=4,
        grad_accum=4,
        world_size=2,
        num_params=10**6,
        fp16=True,
        initial_scale_power=12,
        loss_scale_window=7,
    )
    want = {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 12,
        "loss_scale_window": 7,
        "hysteresis": 2,
        "min_loss_scale": 1,
    }
    for mode in dsconfig.ALL_MODES:
        cfg = dsconfig.build_config(mode, k)
        assert cfg["fp16"] == want and "bf16" not in cfg and dsconfig.fp16_enabled(cfg), mode
    # ACCO follows the model's dtype for its communication, as ZeRO-1 does
    assert dsconfig.build_config("acco", k)["optimizer"]["params"]["comm_dtype"] == "auto"
    plain = dsconfig.build_config("zero1", dsconfig.Knobs(micro_batch=4, grad_accum=4, world_size=2))
    assert "fp16" not in plain and not dsconfig.fp16_enabled(plain)
    assert not dsconfig.fp16_enabled({"fp16": {"enabled": False}})
    with pytest.raises(ValueError, match="bf16 and fp16 are both set"):
        dsconfig.build_config(
            "zero1", dsconfig.Knobs(micro_batch=4, grad_accum=4, world_size=2, bf16=True, fp16=True)
        )


def test_step_records_carry_the_probe_and_the_merge_keeps_them():
    probes = iter([{"loss_scale": 1024.0, "skipped_steps": 1}, {"loss_scale": 512.0, "skipped_steps": 2}])
    log = StepLog(probe=lambda: next(probes))
    log.micro(3.0)
    log.step(1, 0.5)
    log.micro(2.0)
    log.step(2, 1.0)
    assert [(r["loss_scale"], r["skipped_steps"]) for r in log.records] == [(1024.0, 1), (512.0, 2)]
    merged = merge_ranks([log.records, log.records], micro_batch=2)
    assert [(r["loss_scale"], r["skipped_steps"]) for r in merged] == [(1024.0, 1), (512.0, 2)]
    plain = StepLog()
    plain.micro(1.0)
    plain.step(1, 0.1)
    assert "loss_scale" not in plain.records[0] and "loss_scale" not in merge_ranks([plain.records], 2)[0]


def _rank(fp16: bool, scale, skipped: int) -> dict:
    return {
        "train_s": 1.0,
        "peak_mem_mib": 100.0,
        "micro_batches_local": 4,
        "val_loss": 2.0,
        "fp16": fp16,
        "loss_scale": scale,
        "skipped_steps": skipped,
        "fp16_allowed_on_cpu": fp16,
    }


def test_summary_and_table_show_skipped_steps_and_scale_with_fp16():
    recs = merge_ranks(
        [[{"step": s, "t": float(s), "mb": 2 * s, "loss_sum": 3.0 * s} for s in (1, 2, 3, 4)]], 2
    )
    fp16 = summarize(recs, [_rank(True, 2048.0, 3)], warmup=1, micro_batch=2)
    assert (fp16["fp16"], fp16["loss_scale"], fp16["skipped_steps"], fp16["fp16_allowed_on_cpu"]) == (
        True,
        2048.0,
        3,
        True,
    )
    fp32 = summarize(recs, [_rank(False, None, 0)], warmup=1, micro_batch=2)
    assert (fp32["fp16"], fp32["loss_scale"], fp32["skipped_steps"]) == (False, None, 0)
    rows = table_rows({"runs": {"acco": fp16, "zero1": fp16}})
    assert rows[0][-2:] == ("skipped", "loss scale") and rows[1][-2:] == ("3", "2048")
    assert table_rows({"runs": {"acco": fp32}})[0][-1] == "peak MiB/rank"  # no fp16 columns without fp16
    assert table_rows({"runs": {"a": fp16, "b": fp32}})[2][-2:] == ("-", "-")


INITIAL_SCALE_POWER = (
    20  # 2^20: far above what fp16 gradients of this model hold, so the first steps overflow
)


@pytest.mark.launcher
def test_acco_train_fp16_run_skips_overflowing_steps_and_trains(tmp_path):
    """A real 2-rank fp16 run of acco, sync and zero1 (DeepSpeed's ZeRO-1 fp16), starting at loss scale 2^20: each
    skips the steps whose gradients overflow (hysteresis 2: the first overflow keeps the scale, each one after
    halves it), reports them and the final scale per run and per step, and trains (the loss falls); sync takes
    ZeRO-1's decisions step for step, with its losses within fp16 rounding."""
    options = ["--mode", "acco", "sync", "zero1", "--dtype", "fp16"]
    options += ["--initial-scale-power", str(INITIAL_SCALE_POWER), "--steps", "24", *TINY]
    proc, summary, lines = run_train(tmp_path, options, timeout=900)
    assert "fp16 (dynamic loss scale from 2^20, window 1000)" in proc.stdout
    # DeepSpeed's CPU accelerator refuses fp16 only on CPUs without mkldnn fp16 kernels (AVX512-FP16 / AMX-FP16; its
    # own probe): there the ranks lift the refusal and say so, elsewhere they leave DeepSpeed as it is
    lifts = not torch.ops.mkldnn._is_mkldnn_fp16_supported()
    assert ("fp16 on CPU ranks" in proc.stderr) == lifts, (lifts, proc.stderr[-2000:])
    header = next(line for line in proc.stdout.splitlines() if line.strip().startswith("mode"))
    assert header.split()[-3:] == ["skipped", "loss", "scale"]
    for mode in ("acco", "sync", "zero1"):
        s = summary["runs"][mode]
        mine = [x for x in lines if x["mode"] == mode]
        assert s["fp16"] and s["fp16_allowed_on_cpu"] == lifts and s["steps"] == 24
        skipped, scale = s["skipped_steps"], s["loss_scale"]
        assert 2 <= skipped < 24 - 8, (mode, skipped)  # at least one halving, and most steps applied
        assert scale < 2**INITIAL_SCALE_POWER and math.log2(scale) == int(math.log2(scale)), (mode, scale)
        assert (
            f"{mode}: val loss" in proc.stdout
            and f"{skipped} skipped steps, loss scale {scale:g}" in proc.stdout
        )
        # per step: the engine's count never falls and ends at the run's; the scale only falls (window 1000)
        counts, scales = [x["skipped_steps"] for x in mine], [x["loss_scale"] for x in mine]
        assert counts == sorted(counts) and counts[-1] <= skipped and counts[0] <= 1
        assert scales == sorted(scales, reverse=True) and scales[0] >= scale
        assert mine[-1]["loss"] < mine[0]["loss"] - 0.5, (mode, mine[0]["loss"], mine[-1]["loss"])
        assert s["val_loss"] < math.log(256) - 0.5, (mode, s["val_loss"])
    sync, zero1 = ([x for x in lines if x["mode"] == m] for m in ("sync", "zero1"))
    for key in ("skipped_steps", "loss_scale"):
        assert [x[key] for x in sync] == [x[key] for x in zero1], key
    gaps = [abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(sync, zero1)]
    assert max(gaps) <= 2e-3, gaps  # two fp16 rounding steps of the loss
