"""acco-plan (acco_ds/plan): bad options exit 2 naming the option; each contender's equation on a
hand-computed case; the limits (fixed ACCO <= 1.5x and DPU <= 2x acco_ds sync) over a hypothesis
sweep; memory equal to bench_memory's analytic bytes and to what a real pipeline holds; the
recommendation; parameter counts from a transformers config."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from acco_ds.plan import cli, memory_model
from acco_ds.plan.model import COMPRESSED_CONTENDERS, COMPRESSION_CONFIG, CONTENDERS, PlanInputs, predict
from acco_ds.plan.recommend import recommend

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--params", "1B", "--gpus-per-node", "4", "--intra-bw", "100GB/s", "--t-micro-batch", "100ms"]


def _exit2(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,says",
    [
        (["--params=-125M"] + BASE[2:], ["--params", "must be > 0"]),
        (BASE + ["--nodes", "0"], ["--nodes", ">= 1", "got 0"]),
        (BASE + ["--gas", "-2"], ["--gas", ">= 1"]),
        (BASE[:6] + ["--t-micro-batch=-5ms"], ["--t-micro-batch", "must be > 0"]),
        (BASE + ["--tp", "3"], ["--tp 3", "--gpus-per-node 4", "allowed: 1, 2, 4"]),
        (BASE + ["--param-dtype", "fp8"], ["--param-dtype", "'fp8'", "allowed: bf16, fp16, fp32"]),
        (BASE + ["--comm-dtype", "int8"], ["--comm-dtype", "allowed: bf16, fp16, fp32"]),
        (
            BASE + ["--param-dtype", "fp16", "--comm-dtype", "bf16"],
            ["--comm-dtype bf16 with --param-dtype fp16", "do not mix", "allowed: --comm-dtype fp16 or fp32"],
        ),
        (
            BASE + ["--param-dtype", "bf16", "--comm-dtype", "fp16"],
            ["--comm-dtype fp16 with --param-dtype bf16", "allowed: --comm-dtype bf16 or fp32"],
        ),
        (BASE[:4] + ["--intra-bw", "400"] + BASE[6:], ["--intra-bw", "no unit", "Gbit/s"]),
        (BASE + ["--nodes", "2"], ["--inter-bw is needed"]),
        (BASE + ["--nodes", "2", "--inter-bw", "fast"], ["--inter-bw", "not a bandwidth"]),
        (BASE[:6], ["--t-micro-batch", "--tflops"]),
        (BASE[:6] + ["--tflops", "300"], ["--tflops needs the tokens"]),
        (BASE + ["--gpu-memory", "80 parsecs"], ["--gpu-memory", "unknown unit"]),
        (BASE + ["--block-size", "0"], ["--block-size", ">= 1", "got 0"]),
        (
            ["--model-config", "/nonexistent/config.json"] + BASE[2:],
            ["--model-config", "/nonexistent/config.json", "no such file"],
        ),
    ],
)
def test_bad_input_exits_2_naming_the_option(capsys, argv, says):
    err = _exit2(capsys, argv)
    for text in says:
        assert text in err, (text, err)


def test_bad_input_exit_status_of_the_process(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"hidden_size": 8}')  # no model_type
    cmd = [sys.executable, "-m", "acco_ds.plan.cli", "--model-config", str(bad)] + BASE[2:]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--model-config" in proc.stderr and "model_type" in proc.stderr


def test_console_script_is_declared():
    text = (ROOT / "pyproject.toml").read_text()
    scripts = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    assert 'acco-plan = "acco_ds.plan.cli:main"' in scripts.splitlines()


# -- the equations -----------------------------------------------------------------------------------
# 2 nodes x 8 GPUs, tp 2: 4 data-parallel ranks per node, W = 8; 8B parameters -> 4B per GPU, bf16:
# B = 8e9 bytes. Reduce-scatter: intra 3/4 x 8e9 / 100e9 = 0.06 s, inter (n=2) 1/2 x 8e9 / (50e9 / 2)
# = 0.16 s (the node's 2 data-parallel groups, one per tensor-parallel rank, share its network)
# -> 0.22 s; all-gather 0.22 s; all-reduce 0.44 s. Shard 4e9/8 = 5e8 parameters at 2e12 B/s:
# commit 28 B -> 7 ms, peek 16 B -> 4 ms, DeepSpeed 40 B -> 10 ms. t_mb 50 ms, GAS 4: t_c = 0.2 s.
COMM_BOUND = PlanInputs(
    params=8e9,
    t_micro_batch=0.05,
    micro_batch=2,
    gas=4,
    nodes=2,
    gpus_per_node=8,
    tp=2,
    intra_bw=100e9,
    intra_latency=0.0,
    inter_bw=50e9,
    inter_latency=0.0,
    hbm_bw=2e12,
    reduce_bucket=5e8,
)
HAND = {
    "zero1": 0.2 + 0.44 + 0.010 + 0.22,
    # 8 buckets, backward 2/3 x 50 ms: exposed max(0.44/8, 0.44 - 0.05 x 2/3 x 7/8)
    "zero1-overlap": 0.2 + (0.44 - 0.05 * 2 / 3 * 7 / 8) + 0.010 + 0.22,
    "zero2": 4 * (0.05 + 0.44 - 0.05 * 2 / 3 * 7 / 8) + 0.010 + 0.22,
    "sync": 0.2 + 0.22 + 0.007 + 0.22,
    "dpu": max(0.2, 0.447),
    "acco": max(0.1, 0.444) + max(0.1, 0.447),
    # rounds of ceil(0.444 / 0.05) = 9 and ceil(0.447 / 0.05) = 9 micro-batches
    "acco-adaptive": 18 * 0.05,
}


def test_each_contender_against_a_hand_computed_case():
    plan = predict(COMM_BOUND)
    d = plan.derived
    assert d["dp_world"] == 8 and d["params_per_gpu"] == 4e9
    assert d["rs_phases"] == pytest.approx({"intra_s": 0.06, "inter_s": 0.16})
    assert d["all_reduce_s"] == pytest.approx(0.44)
    assert d["opt_commit_s"] == pytest.approx(0.007) and d["opt_peek_s"] == pytest.approx(0.004)
    assert d["comm_compute_ratio"] == pytest.approx(0.447 / 0.2)
    for name in CONTENDERS:
        assert plan.row(name).step_s == pytest.approx(HAND[name], rel=1e-12), name
    assert plan.row("acco-adaptive").micro_batches_per_step == 18
    # adaptive never waits: samples/s is the compute-only rate W x micro-batch / t_mb
    assert plan.row("acco-adaptive").samples_per_s == pytest.approx(8 * 2 / 0.05)
    assert plan.row("acco").samples_per_s == pytest.approx(8 * 2 * 4 / HAND["acco"])


def test_the_memory_states_copies_against_a_hand_computed_case():
    """4e9 parameters per GPU over 8 data-parallel ranks: a shard of 5e8 elements. The inputs form sends the bf16
    gradient shard (2 bytes per element), the state form 12; the 8 ranks of a node share its 50 GB/s; host memory:
    4 records of 12 bytes, 3 slots of inputs of 2."""
    d = predict(COMM_BOUND).derived
    assert d["memory_state_bytes_per_step"] == pytest.approx(2 * 5e8)
    assert d["memory_state_state_bytes_per_step"] == pytest.approx(12 * 5e8)
    assert d["memory_state_inter_s"] == pytest.approx(2 * 5e8 * 8 / 50e9)
    assert d["memory_state_state_inter_s"] == pytest.approx(12 * 5e8 * 8 / 50e9)
    assert d["memory_state_host_bytes"] == pytest.approx((4 * 12 + 3 * 2) * 5e8)
    one_node = predict(dataclasses.replace(COMM_BOUND, nodes=1, gpus_per_node=16)).derived
    assert one_node["memory_state_bytes_per_step"] == one_node["memory_state_state_bytes_per_step"] == 0.0
    assert one_node["memory_state_host_bytes"] == pytest.approx(2 * 12 * one_node["params_per_gpu"] / 8)


def test_compressed_rounds_against_a_hand_computed_case():
    """COMM_BOUND with int8 rounds (blocks of 256): a collective moves 4e9 x (1 + 4/256) = 4.0625e9 bytes,
    reduce-scatter 3/4 x 4.0625e9 / 100e9 + 1/2 x 4.0625e9 / 25e9 = 0.11171875 s; the quantize passes
    stream 3 C + 1 + (W + C)/W + (2 D + 1)/W + 2 D + 1 = 13.875 bytes per parameter: 13.875 x 4e9 / 2e12
    = 0.02775 s (adaptive rounds: their jobs quantize the gradients). With fixed accumulation the round's last
    backward quantizes them: the job's passes 13.875 - (3 C + 1) = 6.875 bytes, 0.01375 s, and the compute C + 1 = 3
    bytes more per round, 0.006 s. Commit round 2 x 0.11171875 + 0.007 + 0.01375, peek 2 x 0.11171875 + 0.004 +
    0.01375 (adaptive: + 0.02775 each)."""
    plan = predict(COMM_BOUND)
    d = plan.derived
    assert d["int8_reduce_scatter_s"] == pytest.approx(0.11171875)
    assert d["quantize_s"] == pytest.approx(0.02775)
    assert d["quantize_fused_s"] == pytest.approx(0.01375)
    assert d["fold_s"] == pytest.approx(0.006)
    commit, peek = 0.2234375 + 0.007 + 0.01375, 0.2234375 + 0.004 + 0.01375
    assert d["comm_round_int8_s"] == pytest.approx(commit)
    assert d["comm_round_int8_unfused_s"] == pytest.approx(0.2234375 + 0.007 + 0.02775)
    assert plan.row("sync-int8").step_s == pytest.approx(0.2 + 0.006 + commit)
    assert plan.row("acco-int8").step_s == pytest.approx(peek + commit)
    ad = plan.row("acco-adaptive-int8")  # rounds of ceil(0.2551875 / 0.05) = 6 and ceil(0.2581875 / 0.05) = 6
    assert ad.micro_batches_per_step == 12 and ad.step_s == pytest.approx(0.6)
    # one more full buffer in the comm dtype (the residual), nothing else
    assert plan.row("acco-int8").memory_held_bytes_per_param == pytest.approx(
        plan.row("acco").memory_held_bytes_per_param + 2
    )
    assert "has run on one GPU only" in plan.row("acco-int8").note


def test_owner_sum_bytes_follow_the_round_job():
    """Up to the round job's UNSTORED_SUM_MAX_WORLD the owner's W chunks are read by two passes (2 bytes per
    parameter of the buffer); beyond, summed once into the shard ((W + C) / W)."""
    from acco_ds.core import round_job
    from acco_ds.plan import model

    assert model.UNSTORED_SUM_MAX_WORLD == round_job.UNSTORED_SUM_MAX_WORLD
    top = model.UNSTORED_SUM_MAX_WORLD
    rest = lambda W: 3 * 2 + 1 + (2 * 2 + 1) / W + 2 * 2 + 1  # noqa: E731  bf16 everywhere, the other passes
    assert model.quant_bytes_per_param(2, 2, top) == pytest.approx(rest(top) + 2)
    # the gradients quantized in the round's last backward: not the job's
    assert model.quant_bytes_per_param(2, 2, top, fused_round_end=True) == pytest.approx(rest(top) + 2 - 7)
    assert model.quant_bytes_per_param(2, 2, top + 1) == pytest.approx(
        rest(top + 1) + (top + 1 + 2) / (top + 1)
    )


def test_latency_terms_and_a_compute_bound_case():
    """One node of 4, 1B bf16 parameters, 100 GB/s, 10 us per ring step, t_mb 100 ms, GAS 4."""
    i = PlanInputs(
        params=1e9, t_micro_batch=0.1, micro_batch=1, gas=4, gpus_per_node=4, intra_bw=100e9,
        intra_latency=1e-5, hbm_bw=1e12, reduce_bucket=2.5e8,
    )  # fmt: skip
    plan = predict(i)
    rs = 3 / 4 * 2e9 / 100e9 + 3 * 1e-5
    assert plan.derived["reduce_scatter_s"] == pytest.approx(rs)
    assert plan.row("sync").step_s == pytest.approx(0.4 + 2 * rs + 28 * 2.5e8 / 1e12)
    assert plan.row("acco").step_s == pytest.approx(0.4)  # each round max(0.2, ~0.037)
    # 4 buckets: each bucket's reduction hides behind the next part of the backward but the last
    assert plan.row("zero1-overlap").step_s == pytest.approx(0.4 + 2 * rs / 4 + 40 * 2.5e8 / 1e12 + rs)
    # the CLI turns the same options into the same inputs
    inputs, _ = cli.resolve(
        BASE + ["--intra-latency", "10us", "--hbm-bw", "1TB/s", "--gas", "4", "--reduce-bucket-size", "250M"]
    )
    assert predict(inputs).row("zero1-overlap").step_s == pytest.approx(plan.row("zero1-overlap").step_s)


def test_cpu_accelerator_overlaps_nothing_in_deepspeed():
    cpu = predict(PlanInputs(**{**COMM_BOUND.__dict__, "accelerator": "cpu"}))
    assert cpu.row("zero1-overlap").step_s == pytest.approx(cpu.row("zero1").step_s)
    assert cpu.row("zero2").step_s == pytest.approx(4 * (0.05 + 0.44) + 0.23)
    assert cpu.row("acco").step_s == pytest.approx(HAND["acco"])  # acco_ds overlaps with a thread


@settings(max_examples=300, deadline=None)
@given(
    params=st.floats(1e5, 1e12),
    nodes=st.integers(1, 64),
    gpn_tp=st.sampled_from([(1, 1), (2, 1), (4, 2), (8, 1), (8, 2), (8, 8), (16, 4)]),
    bws=st.tuples(st.floats(1e6, 1e12), st.floats(1e6, 1e12), st.floats(1e9, 1e13)),
    lats=st.tuples(st.floats(0, 1e-3), st.floats(0, 1e-3)),
    t_mb=st.floats(1e-5, 30.0),
    gas=st.integers(1, 64),
    dtypes=st.sampled_from([("bf16", "bf16"), ("fp32", "fp32"), ("bf16", "fp32"), ("fp32", "bf16")]),
    bucket=st.floats(1e4, 1e10),
    accel=st.sampled_from(["gpu", "cpu"]),
)
def test_limits_hold_in_every_predicted_case(
    params, nodes, gpn_tp, bws, lats, t_mb, gas, dtypes, bucket, accel
):
    gpn, tp = gpn_tp
    i = PlanInputs(
        params=params, t_micro_batch=t_mb, micro_batch=1, gas=gas, nodes=nodes, gpus_per_node=gpn, tp=tp,
        param_dtype=dtypes[0], comm_dtype=dtypes[1], intra_bw=bws[0], intra_latency=lats[0],
        inter_bw=bws[1], inter_latency=lats[1], hbm_bw=bws[2], accelerator=accel, reduce_bucket=bucket,
    )  # fmt: skip
    plan = predict(i)
    t_c = gas * t_mb
    sync, dpu = plan.row("sync").step_s, plan.row("dpu").step_s
    assert sync / dpu <= 2 + 1e-9
    for r in plan.rows:
        if r.step_s is not None:
            assert r.step_s >= t_c * (1 - 1e-12), r.contender  # nothing beats the compute alone
            assert r.memory_bytes > 0
    assert plan.row("zero1-overlap").step_s <= plan.row("zero1").step_s * (1 + 1e-12)
    if gas % 2:
        assert plan.row("acco").step_s is None and plan.row("acco-adaptive").step_s is None
        return
    acco = plan.row("acco").step_s
    assert sync / acco <= 1.5 + 1e-9
    assert acco >= dpu * (1 - 1e-12)  # two communications per step cannot beat one
    ad = plan.row("acco-adaptive")
    assert ad.samples_per_s == pytest.approx(plan.derived["dp_world"] / t_mb)
    assert ad.micro_batches_per_step >= gas


# -- memory ----------------------------------------------------------------------------------------
def test_memory_is_bench_memorys_analytic_bytes_per_parameter():
    bench_mm = memory_model  # what the memory benchmark (benchmarks.memory) prints

    for pd, cd, D, C in (("bf16", "bf16", 2, 2), ("fp32", "fp32", 4, 4), ("bf16", "fp32", 2, 4)):
        i = PlanInputs(**{**COMM_BOUND.__dict__, "param_dtype": pd, "comm_dtype": cd, "largest_frac": 0.05})
        plan = predict(i)
        W = plan.derived["dp_world"]  # 8: nodes x GPUs / tp
        for row in plan.rows:
            name = row.contender.replace("acco-adaptive", "acco")
            frac = plan.derived["bucket_frac"] if name.startswith("zero") else None
            bufs = bench_mm.buffers(name, D, W, 0.05, C, bucket_frac=frac)
            assert row.memory_bytes_per_param == bench_mm.peak(bufs, cpu=False)
            assert row.memory_bytes == pytest.approx(bench_mm.peak(bufs, cpu=False) * 4e9)
        held = {r.contender: r.memory_held_bytes_per_param for r in plan.rows}
        # buffers.py's docstring: same dtype acco/dpu 3 D + 12/W (+ D/W acco), sync 2 D + 12/W;
        # mixed bf16/fp32: 2*2 + 2*4 + 12/W (+ 4/W acco), sync 2 + 4 + 12/W
        if D == C:
            want = {"acco": 3 * D + 12 / W + D / W, "dpu": 3 * D + 12 / W, "sync": 2 * D + 12 / W}
        else:
            want = {
                "acco": 2 * 2 + 2 * 4 + 12 / W + 4 / W,
                "dpu": 2 * 2 + 2 * 4 + 12 / W,
                "sync": 2 + 4 + 12 / W,
            }
        for name, v in want.items():
            assert held[name] == pytest.approx(v), (pd, cd, name)
        assert held["acco-adaptive"] == held["acco"]
        for name in (
            "sync",
            "acco",
            "acco-adaptive",
        ):  # the error-feedback residual: one full buffer, comm dtype
            assert held[name + "-int8"] == pytest.approx(held[name] + C)
            peak = {r.contender: r.memory_bytes_per_param for r in plan.rows}
            # while a round exchanges: the buffer's int8 values and scales sent, the W chunks of a shard received
            assert peak[name + "-int8"] == pytest.approx(peak[name] + C + 2 * (1 + 4 / 256))
    # the bench's ZeRO configs (one bucket of the model for zero1, a quarter for zero2) are the defaults
    assert bench_mm.buffers("zero1", 2, 2) == memory_model.buffers("zero1", 2, 2, bucket_frac=1.0)
    assert bench_mm.buffers("zero2", 2, 2) == memory_model.buffers("zero2", 2, 2, bucket_frac=0.25)


def _real_pipeline_held(mode: str, param_dtype: torch.dtype, comm: str, **pipeline_kw):
    """A one-rank pipeline over a small model in ``param_dtype`` (``pipeline_kw``: its further settings): the bytes
    its GroupBuffers hold, the elements they pad to, the model's parameter count and the plan's row at W = 1."""
    from acco_ds.config import ACCOConfig
    from acco_ds.core.pipeline import ACCOPipeline
    from acco_ds.core.round_job import Hyper
    from tests.ranks.inproc import ensure_single_rank_group

    ensure_single_rank_group()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.LayerNorm(96), torch.nn.Linear(96, 48))
    model.to(param_dtype)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    pipe = ACCOPipeline(
        [params],
        lambda: [Hyper(1e-3, 0.9, 0.999, 1e-8, 0.0)],
        ACCOConfig(mode=mode, comm_dtype=comm),
        2,
        0.0,
        **pipeline_kw,
    )
    try:
        held = sum(sum(g.held_bytes().values()) for g in pipe.groups)
        padded = sum(g.layout.padded_numel for g in pipe.groups)
    finally:
        pipe.close()
    i = PlanInputs(
        params=n,
        t_micro_batch=0.1,
        micro_batch=1,
        gas=2,
        gpus_per_node=1,
        param_dtype={torch.bfloat16: "bf16", torch.float16: "fp16"}[param_dtype],
        comm_dtype=comm,
    )
    return held, padded, n, predict(i).row(mode)


@pytest.mark.parametrize("mode", ["sync", "dpu", "acco"])
@pytest.mark.parametrize("param_dtype,comm", [(torch.bfloat16, "bf16"), (torch.bfloat16, "fp32")])
def test_held_memory_is_what_a_real_pipeline_holds(mode, param_dtype, comm):
    """GroupBuffers.held_bytes() of a one-rank pipeline over a small model, per parameter, is the
    plan's held bytes per parameter at W = 1 (within the padding to a multiple of 16 elements)."""
    held, padded, n, row = _real_pipeline_held(mode, param_dtype, comm)
    assert held == pytest.approx(row.memory_held_bytes_per_param * padded)
    assert held / n == pytest.approx(row.memory_held_bytes_per_param, rel=16 / n)


# -- the recommendation ----------------------------------------------------------------------------
def _rec(**kw):
    i = PlanInputs(**{**COMM_BOUND.__dict__, **kw})
    return recommend(predict(i), i)


def test_recommendation_follows_the_rules():
    r = _rec(t_micro_batch=0.5)  # round's comm 0.447 s < half of 2 s: fixed ACCO hides it
    assert (r["mode"], r["accumulation"], r["gas"]) == ("acco", "fixed", 4) and "fits in half" in r["reason"]
    r = _rec()  # comm 0.447 s > 0.1 s: adaptive, fixed alternative with the GAS that covers the round
    assert (r["mode"], r["accumulation"]) == ("acco", "adaptive")
    assert "--gas 18" in r["alternative"]  # 2 x ceil(0.447 / 0.05)
    r = _rec(t_micro_batch=50.0)  # communication negligible
    assert r["mode"].startswith("zero1") and "below the 5%" in r["reason"]
    r = _rec(gpu_memory=10 * 2**30)  # ACCO's model states (4e9 x ~8 B) do not fit
    assert r["mode"].startswith("zero1") and "--gpu-memory" in r["reason"]
    r = _rec(gas=3)
    assert r["mode"].startswith("zero1") and "--gas 4" in r["reason"]
    assert r["compression"] is None


def test_recommendation_of_compression():
    """Compression only where the round does not fit in half a step, and only on CPU ranks (acco_ds's GPU
    compression has run on one GPU only); on GPUs the reason gives the figure and says why not."""
    assert (
        _rec(t_micro_batch=0.5, accelerator="cpu")["compression"] is None
    )  # the round fits: nothing to gain
    # the exact round (0.447 s) misses half a step of 0.6 s / 2, the int8 one (0.244 s, its gradients quantized in
    # the round's last backward) fits: fixed + int8
    r = _rec(t_micro_batch=0.15, accelerator="cpu")
    assert (r["mode"], r["accumulation"], r["compression"]) == ("acco", "fixed", COMPRESSION_CONFIG)
    gpu = _rec(t_micro_batch=0.15)
    assert (gpu["accumulation"], gpu["compression"]) == ("adaptive", None)
    assert "has run on one GPU only" in gpu["reason"] and "244.2 ms" in gpu["reason"]
    # neither fits: adaptive, whose steps shrink from 18 to 12 micro-batches with int8
    r = _rec(accelerator="cpu")
    assert (r["accumulation"], r["compression"]) == ("adaptive", COMPRESSION_CONFIG)
    assert "about 12 micro-batches" in r["reason"]
    assert cli.render(predict(COMM_BOUND), r).count('"compression": {"commit": "int8"') == 1


def test_json_output(capsys, tmp_path):
    assert cli.main(BASE + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["contender"] for r in doc["rows"]] == list(CONTENDERS + COMPRESSED_CONTENDERS)
    assert doc["recommendation"]["mode"] and doc["derived"]["dp_world"] == 4
    out = tmp_path / "plan.json"
    assert cli.main(BASE + ["--json", str(out)]) == 0
    assert "recommendation:" in capsys.readouterr().out
    assert json.loads(out.read_text())["rows"] == doc["rows"]


# -- fp16 ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("comm", ["half", "fp32"])
def test_fp16_plans_as_bf16(comm, capsys):
    """fp16 parameters (with loss scaling) move and hold the bytes bf16 does: every row's step time and memory,
    and every derived figure, are bf16's; the CLI takes --param-dtype fp16 and says it."""
    got = predict(
        dataclasses.replace(COMM_BOUND, param_dtype="fp16", comm_dtype="fp16" if comm == "half" else "fp32")
    )
    want = predict(
        dataclasses.replace(COMM_BOUND, param_dtype="bf16", comm_dtype="bf16" if comm == "half" else "fp32")
    )
    assert got.derived == want.derived
    assert [dataclasses.asdict(r) for r in got.rows] == [dataclasses.asdict(r) for r in want.rows]
    assert memory_model.DTYPE_SIZE["fp16"] == memory_model.DTYPE_SIZE["bf16"] == 2
    assert cli.main(BASE + ["--param-dtype", "fp16", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["inputs"]["param_dtype"], doc["inputs"]["comm_dtype"]) == ("fp16", "fp16")
    assert cli.main(BASE + ["--param-dtype", "bf16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == doc["rows"]


def test_plan_inputs_refuse_fp16_with_bf16():
    for pd, cd in (("fp16", "bf16"), ("bf16", "fp16")):
        with pytest.raises(ValueError, match=f"comm_dtype='{cd}'.*fp16 and bf16 do not mix"):
            dataclasses.replace(COMM_BOUND, param_dtype=pd, comm_dtype=cd)


@pytest.mark.parametrize("mode", ["sync", "acco"])
@pytest.mark.parametrize("comm", ["fp16", "fp32"])
def test_fp16_held_memory_is_what_a_real_pipeline_holds(mode, comm):
    """GroupBuffers.held_bytes() of a one-rank fp16 pipeline (with its loss scaler) is the plan's fp16 held bytes
    per parameter at W = 1 (within the padding to a multiple of 16 elements)."""
    from acco_ds.core.loss_scale import LossScaleSpec

    loss_scale = LossScaleSpec(dynamic=True, init_scale=2.0**16)
    held, padded, _, row = _real_pipeline_held(mode, torch.float16, comm, loss_scale=loss_scale)
    assert held == pytest.approx(row.memory_held_bytes_per_param * padded)


# -- model configs ---------------------------------------------------------------------------------
def test_params_from_a_transformers_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=1000, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    folder = tmp_path / "model"
    cfg.save_pretrained(folder)
    want = sum(p.numel() for p in transformers.GPT2LMHeadModel(cfg).parameters())  # tied head once
    for source in (folder, folder / "config.json"):
        inputs, _ = cli.resolve(["--model-config", str(source)] + BASE[2:])
        assert inputs.params == want
        assert inputs.largest_frac == pytest.approx(1000 * 32 / want)
    # --tflops without tokens takes the config's context: 6 N T / (TFLOP/s) with T = 2 x 64
    inputs, _ = cli.resolve(
        ["--model-config", str(folder), "--micro-batch", "2", "--tflops", "1"] + BASE[2:6]
    )
    assert inputs.t_micro_batch == pytest.approx(6 * want * 128 / 1e12)
    assert math.isclose(inputs.tokens_per_micro_batch, 128)


def test_plan_inputs_refuse_out_of_range_values():
    for bad, says in (
        ({"intra_bw": 0.0}, "intra_bw"),
        ({"nodes": 2}, "inter_bw"),
        ({"tp": 3}, "divisor"),
        ({"gas": 0}, "gas"),
        ({"comm_dtype": "fp8"}, "comm_dtype"),
        ({"intra_latency": -1e-6}, "intra_latency"),
    ):
        with pytest.raises(ValueError, match=says):
            PlanInputs(**{"params": 1e9, "t_micro_batch": 0.1, "micro_batch": 1, "gas": 2, "gpus_per_node": 4,
                          "intra_bw": 1e11, **bad})  # fmt: skip


def test_the_plan_models_the_configs_compression():
    """acco-plan stands alone (it imports nothing of acco_ds's implementation), so its copies of the compression
    defaults are checked here: the block size of the plan, of its memory model and of the config agree, and the
    config the plan recommends is one the optimizer accepts."""
    from acco_ds.config import CompressionConfig
    from acco_ds.plan import memory_model

    default = CompressionConfig().block_size
    plan_default = next(f.default for f in dataclasses.fields(PlanInputs) if f.name == "block_size")
    assert plan_default == memory_model.COMPRESSION_BLOCK == default
    assert CompressionConfig(**COMPRESSION_CONFIG).enabled
