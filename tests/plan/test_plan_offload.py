"""acco-plan --offload (acco_ds/plan/offload.py, recommend_offload.py, joined by planner.py): each offload
contender's step time on a hand-computed case; fixed ACCO's 1.5x limit over the same host work run serially,
reached where that work is half a step's compute; adaptive ACCO at the compute-only rate; the GPU and host memory
(the optimizer state moved, nothing else); the recommendation (offload or not, which mode) and its reason; the
CLI's options, output and errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from acco_ds.plan import cli, memory_model, model, offload
from acco_ds.plan import recommend as base_recommend
from acco_ds.plan.model import PlanInputs
from acco_ds.plan.planner import predict, recommend
from tests.plan.test_plan import _exit2

GIB = 2**30
BASE = ["--params", "1B", "--gpus-per-node", "1", "--t-micro-batch", "250ms", "--gas", "8"]

# One GPU (W = 1: no collectives), 1e9 bf16 parameters, PCIe 20 GB/s, host AdamW 40 GB/s, DeepSpeedCPUAdam 50 GB/s.
# A round's job: the gradient shard down 2e9 / 20e9 = 0.1 s, the host pass (commit 28 B: 0.7 s; peek 16 B: 0.4 s),
# the parameters up 0.1 s: commit job 0.9 s, peek job 0.6 s. ZeRO-Offload: fp32 gradients down 4e9 / 20e9 = 0.2 s,
# DeepSpeedCPUAdam + the copy into the bf16 buffer 34e9 / 50e9 = 0.68 s, the parameters up 0.1 s: 0.98 s.
ONE_GPU = PlanInputs(
    params=1e9,
    t_micro_batch=0.1,
    micro_batch=1,
    gas=4,
    gpus_per_node=1,
    offload=True,
    pcie_bw=20e9,
    host_adam_bw=40e9,
    host_adam_bw_deepspeed=50e9,
)


def test_each_offload_contender_against_a_hand_computed_case():
    plan = predict(ONE_GPU)
    d = plan.derived
    assert d["offload_to_host_s"] == pytest.approx(0.1) and d["offload_to_device_s"] == pytest.approx(0.1)
    assert d["offload_host_commit_s"] == pytest.approx(0.7) and d["offload_host_peek_s"] == pytest.approx(0.4)
    assert d["offload_job_commit_s"] == pytest.approx(0.9) and d["offload_job_peek_s"] == pytest.approx(0.6)
    assert d["offload_deepspeed_serial_s"] == pytest.approx(0.2 + 0.68 + 0.1)
    t_c = 0.4
    want = {
        "zero1-offload": t_c + 0.98,  # serial after the compute
        "sync-offload": t_c + 0.9,  # one host pass, waited for
        "acco-offload": max(t_c / 2, 0.6)
        + max(t_c / 2, 0.9),  # two host passes, each behind GAS/2 micro-batches
        "acco-adaptive-offload": (6 + 9) * 0.1,  # rounds of ceil(0.6 / 0.1) + ceil(0.9 / 0.1) micro-batches
    }
    for name, step in want.items():
        assert plan.row(name).step_s == pytest.approx(step, rel=1e-12), name
    ad = plan.row("acco-adaptive-offload")
    assert ad.micro_batches_per_step == 15 and ad.samples_per_s == pytest.approx(1 / 0.1)
    assert plan.row("acco-offload").exposed_comm_s == pytest.approx(1.5 - t_c)
    # the offload rows follow the others only with --offload
    assert [r.contender for r in plan.rows][-4:] == list(offload.CONTENDERS)
    plain = predict(dataclasses.replace(ONE_GPU, offload=False))
    assert not any(r.contender.endswith("-offload") for r in plain.rows)
    assert not any(k.startswith("offload_") for k in plain.derived)


def test_the_base_modules_leave_offload_to_the_planner():
    """model.predict and recommend.recommend answer without offload whatever inputs.offload says; planner.predict is
    their plan followed by the offload rows (x_zero1 over the same ZeRO-1 row), planner.recommend their answer
    passed through recommend_offload.with_offload."""
    base = model.predict(ONE_GPU)
    assert [r.contender for r in base.rows] == list(model.CONTENDERS + model.COMPRESSED_CONTENDERS)
    assert base_recommend.recommend(base, ONE_GPU)["offload"] is None
    full = predict(ONE_GPU)
    assert full.rows[: len(base.rows)] == base.rows
    zero1 = full.row("zero1").samples_per_s
    for r in full.rows[len(base.rows) :]:
        assert r.x_zero1 == pytest.approx(r.samples_per_s / zero1) and r.host_memory_bytes > 0
    assert "No optimizer offload" in recommend(full, ONE_GPU)["reason"]  # no --gpu-memory: rule 1
    small = dataclasses.replace(ONE_GPU, gpu_memory=8 * GIB)  # fits only offloaded
    assert base_recommend.recommend(model.predict(small), small)["offload"] is None
    assert recommend(predict(small), small)["offload"] == offload.OFFLOAD_CONFIG


def test_the_jobs_hold_the_collectives_and_the_shard():
    """8 ranks on a node at 100 GB/s: every copy and host pass moves this rank's shard (1e9 / 8 parameters) and the
    job holds the reduce-scatter and the all-gather; ZeRO-Offload all-reduces."""
    i = dataclasses.replace(ONE_GPU, gpus_per_node=8, intra_bw=100e9, intra_latency=0.0)
    d = predict(i).derived
    rs = 7 / 8 * 2e9 / 100e9
    assert d["reduce_scatter_s"] == pytest.approx(rs)
    assert d["offload_to_host_s"] == pytest.approx(0.1 / 8)
    assert d["offload_job_commit_s"] == pytest.approx(rs + (0.1 + 0.7 + 0.1) / 8 + rs)
    assert d["offload_deepspeed_serial_s"] == pytest.approx(2 * rs + 0.98 / 8 + rs)


def test_fixed_acco_reaches_1_5x_where_the_host_work_is_half_a_step():
    """1e8 parameters on one GPU, PCIe 4 GB/s (each copy 0.05 s), host AdamW 28 GB/s (commit 0.1 s, peek 0.057 s):
    the commit's job is 0.2 s, half of t_c = 0.4 s. Run serially once per step (sync-offload; ZeRO-Offload where its
    own work is the same 0.2 s: DeepSpeedCPUAdam at 68 GB/s) the step is 0.6 s; fixed ACCO hides both host passes:
    0.4 s, 1.5x. Either side of that point the ratio is lower."""
    i = PlanInputs(
        params=1e8, t_micro_batch=0.2, micro_batch=1, gas=2, gpus_per_node=1, offload=True, pcie_bw=4e9,
        host_adam_bw=28e9, host_adam_bw_deepspeed=68e9,
    )  # fmt: skip
    plan = predict(i)
    assert plan.derived["offload_job_commit_s"] == pytest.approx(0.2)
    assert plan.derived["offload_deepspeed_serial_s"] == pytest.approx(0.2)
    acco = plan.row("acco-offload")
    assert acco.step_s == pytest.approx(0.4)
    assert acco.samples_per_s / plan.row("sync-offload").samples_per_s == pytest.approx(1.5)
    assert acco.samples_per_s / plan.row("zero1-offload").samples_per_s == pytest.approx(1.5)
    for host in (7e9, 14e9, 21e9, 35e9, 56e9, 112e9):
        p = predict(dataclasses.replace(i, host_adam_bw=host))
        ratio = p.row("acco-offload").samples_per_s / p.row("sync-offload").samples_per_s
        assert ratio < 1.5 - 1e-3, host
    # far beyond: two host passes per step against one, fixed ACCO is slower than the serial step
    slow = predict(dataclasses.replace(i, host_adam_bw=0.28e9, host_adam_bw_deepspeed=0.34e9))
    assert slow.row("acco-offload").samples_per_s < slow.row("zero1-offload").samples_per_s
    assert slow.row("acco-adaptive-offload").samples_per_s == pytest.approx(1 / 0.2)


@settings(max_examples=200, deadline=None)
@given(
    params=st.floats(1e6, 1e11),
    gpn=st.sampled_from([1, 2, 8]),
    t_mb=st.floats(1e-4, 10.0),
    gas=st.integers(1, 32),
    bws=st.tuples(st.floats(1e9, 1e12), st.floats(1e9, 1e11), st.floats(1e9, 1e11), st.floats(1e9, 1e12)),
    dtypes=st.sampled_from([("bf16", "bf16"), ("fp32", "fp32"), ("bf16", "fp32")]),
)
def test_offload_limits_hold_in_every_predicted_case(params, gpn, t_mb, gas, bws, dtypes):
    i = PlanInputs(
        params=params, t_micro_batch=t_mb, micro_batch=1, gas=gas, gpus_per_node=gpn, intra_bw=bws[0],
        param_dtype=dtypes[0], comm_dtype=dtypes[1], offload=True, pcie_bw=bws[1], host_adam_bw=bws[2],
        host_adam_bw_deepspeed=bws[3],
    )  # fmt: skip
    plan = predict(i)
    for name in ("sync", "acco", "acco-adaptive"):  # offload adds to the job, takes nothing off
        a, b = plan.row(name), plan.row(name + "-offload")
        if a.step_s is not None:
            assert b.step_s >= a.step_s * (1 - 1e-12), name
            assert b.micro_batches_per_step >= a.micro_batches_per_step
        # on the GPU, exactly the fp32 master and moments less: 12 bytes per parameter of the shard
        assert b.memory_bytes_per_param == pytest.approx(a.memory_bytes_per_param - 12 / gpn)
    if gas % 2:
        assert plan.row("acco-offload").step_s is None
        return
    sync, acco = plan.row("sync-offload"), plan.row("acco-offload")
    assert acco.samples_per_s / sync.samples_per_s <= 1.5 + 1e-9
    assert acco.step_s >= gas * t_mb * (1 - 1e-12)
    ad = plan.row("acco-adaptive-offload")
    assert ad.samples_per_s == pytest.approx(gpn / t_mb)  # the GPU never waits
    k = plan.derived["offload_job_commit_s"] / t_mb
    assert ad.micro_batches_per_step >= min(k, gas / 2) + gas / 2 - 1e-9


def test_gpu_and_host_memory():
    """Per parameter of the GPU, W = 8, largest tensor 5% of the parameters, bf16: ACCO keeps 3 full buffers and
    the g~ shard on the GPU (3 D + D/W) and holds the state (12/W) and its staging (C/W + D/W) on the host;
    ZeRO-Offload keeps the parameters, its buckets and a staging buffer of the largest parameter (D L) on the GPU,
    and the state, the fp32 gradient partition (4/W), a bf16 copy of the partition (D/W) and a host buffer of the
    largest parameter (D L) on the host."""
    i = dataclasses.replace(
        ONE_GPU, gpus_per_node=8, intra_bw=100e9, largest_frac=0.05, reduce_bucket=1e9, gpu_memory=7 * GIB
    )
    plan = predict(i)
    W, N = 8, 1e9
    acco = plan.row("acco-offload")
    assert acco.memory_held_bytes_per_param == pytest.approx(3 * 2 + 2 / W)
    assert acco.memory_bytes_per_param == pytest.approx(3 * 2 + 2 / W + 2 / W + 2 * 0.05)
    assert acco.host_memory_bytes == pytest.approx((12 + 2 + 2) / W * N)
    assert plan.row("acco-adaptive-offload").memory_bytes == acco.memory_bytes
    assert plan.row("sync-offload").memory_held_bytes_per_param == pytest.approx(2 * 2)
    zo = plan.row("zero1-offload")
    # the flat parameters, the reduce bucket (the whole model here) and its flattened copy, the staging buffer
    assert zo.memory_bytes_per_param == pytest.approx(2 + 2 + 2 + 2 * 0.05)
    assert zo.host_memory_bytes == pytest.approx(((12 + 4 + 2) / W + 2 * 0.05) * N)
    assert plan.row("zero1").memory_bytes_per_param - zo.memory_bytes_per_param == pytest.approx(12 / W - 0.1)
    assert zo.fits and acco.fits and plan.row("acco").fits is False  # 7 GiB: ACCO fits only with offload
    # the split is memory_model's, for each offloadable contender: the state moved, nothing else
    for name in memory_model.OFFLOADABLE:
        every = memory_model.buffers(name, 2, W, 0.05, 2)
        gpu, host = memory_model.offloaded(name, 2, W, 0.05, 2)
        moved = [b for b in every if b not in gpu]
        assert sum(b.bytes_per_param for b in moved) == pytest.approx(12 / W), name
        assert all(b in host for b in moved)
    with pytest.raises(ValueError, match="no offload model for 'zero2'; choose from zero1, sync, dpu, acco"):
        memory_model.offloaded("zero2", 2, W)


# -- the recommendation ----------------------------------------------------------------------------
# One GPU, 1e9 bf16 parameters, the defaults (PCIe 25 GB/s, host AdamW 49 / 47 GB/s): without offload ZeRO-1
# holds 17 B per parameter (15.8 GiB), ACCO 22 B; with offload ACCO 10 B (9.3 GiB: 3 full buffers, the g~ shard and
# the reduce-scatter's receive shard), ZeRO-Offload 5 B (4.7 GiB). The commit's job: 0.08 + 28e9 / 49e9 + 0.08 =
# 0.08 + 0.5714 + 0.08 = 0.731 s, the peek's 0.08 + 16e9 / 49e9 + 0.08 = 0.08 + 0.3265 + 0.08 = 0.487 s.
# ZeRO-Offload's serial part: 4e9 / 25e9 + 34e9 / 47e9 + 0.08 = 0.16 + 0.7234 + 0.08 = 0.963 s.
def _rec(**kw):
    i = PlanInputs(
        **{"params": 1e9, "t_micro_batch": 0.25, "micro_batch": 1, "gas": 8, "gpus_per_node": 1, "offload": True,
           "reduce_bucket": 5e8, **kw}
    )  # fmt: skip
    return recommend(predict(i), i)


def test_no_offload_where_the_model_states_fit():
    r = _rec(gpu_memory=80 * GIB)  # compute-bound: neither ACCO nor ACCO with offload gains 5% over ZeRO-1
    # t_c = 8 x 0.25 = 2 s; fixed ACCO with offload hides both jobs (0.487, 0.731 s <= 1 s): 2.0 s a step, against
    # ZeRO-1's 2.02 s (its 20 ms exposed, which the host figures do not touch): 2.02 / 2.0 = 1.010, a 1.0% gain
    assert r["offload"] is None and r["mode"].startswith("zero1")
    assert "No optimizer offload: the model states fit without offload (zero1: 15.8 GiB" in r["reason"]
    assert "the best with offload, acco-offload, would gain 1.0% samples/s, below the 5%" in r["reason"]
    # ACCO fits and hides its round; offload only costs: adaptive rounds of ceil(0.487 / 0.01) + ceil(0.731 / 0.01)
    # = ceil(48.65) + ceil(73.14) = 49 + 74 = 123 micro-batches, at 1 / 0.01 = 100 samples/s as without offload
    r = _rec(gpu_memory=80 * GIB, t_micro_batch=0.01)
    assert (r["mode"], r["offload"]) == ("acco", None)
    assert "offload only adds the copies and the host passes" in r["reason"]
    assert (
        "acco-adaptive-offload, 100.0 samples/s: 1.00x, with steps of about 123 micro-batches" in r["reason"]
    )
    r = _rec()  # no --gpu-memory: nothing to decide on, so no offload, and the reason says why
    assert r["offload"] is None and "without --gpu-memory the plan cannot tell" in r["reason"]


def test_offload_with_fixed_acco_where_a_round_hides_the_host_work():
    r = _rec(gpu_memory=10 * GIB)  # the commit's job 0.731 s <= half of t_c = 2 s
    assert (r["mode"], r["accumulation"], r["gas"]) == ("acco", "fixed", 8)
    assert r["offload"] == {"device": "cpu", "pin_memory": True}
    assert "Without offload zero1 needs 15.8 GiB per GPU, more than --gpu-memory 10.0 GiB" in r["reason"]
    assert "fits in half a step's compute (1000.0 ms)" in r["reason"]
    assert "1.48x ZeRO-Offload's" in r["reason"]  # (2 + 0.963) / 2 = 1.4817


def test_offload_with_adaptive_acco_where_the_host_step_outlasts_the_compute():
    r = _rec(gpu_memory=10 * GIB, t_micro_batch=0.05)  # t_c = 0.4 s against a 0.731 s job
    assert (r["mode"], r["accumulation"]) == ("acco", "adaptive") and r["offload"]
    assert "is longer than half a step's compute (200.0 ms)" in r["reason"]
    # rounds of ceil(0.487 / 0.05) + ceil(0.731 / 0.05) = ceil(9.73) + ceil(14.63) = 10 + 15 micro-batches
    assert "steps of about 25 micro-batches per GPU instead of 8" in r["reason"]
    assert "--gas 30" in r["alternative"]  # 2 x ceil(0.731 / 0.05) = 2 x 15


def test_offload_with_zero1_where_acco_does_not_pay_or_does_not_fit():
    r = _rec(gpu_memory=10 * GIB, t_micro_batch=20.0)  # the host work is 0.6% of a step: 0.963 / 160.963
    assert (r["mode"], r["accumulation"]) == ("zero1", None) and r["offload"]
    assert "below the 5% worth a switch" in r["reason"]
    r = _rec(gpu_memory=6 * GIB)  # ZeRO-Offload (4.7 GiB) fits, ACCO with offload (9.3 GiB) does not
    assert r["mode"] == "zero1" and r["offload"] and "ACCO with offload needs 9.3 GiB per GPU" in r["reason"]
    r = _rec(gpu_memory=10 * GIB, gas=7)
    assert r["mode"] == "zero1" and r["offload"] and "--gas 8" in r["reason"]


def test_nothing_fits_even_offloaded():
    r = _rec(gpu_memory=2 * GIB)
    assert r["reason"].startswith("Nothing fits in --gpu-memory 2.0 GiB, even with the optimizer offloaded")
    assert "zero1-offload, needs 4.7 GiB" in r["reason"]


def test_acco_with_offload_over_a_fitting_deepspeed_whose_communication_is_exposed():
    """8 ranks at 10 GB/s, a bucket of the whole model: ZeRO-1 (7.5 B per parameter, 7.0 GiB) fits in 7.2 GiB and
    waits 0.53 s a step for its collectives; ACCO does not fit (8 B), ACCO with offload does (6.5 B) and hides its
    job behind half a step (0.5 s): each collective 7/8 x 2e9 / 10e9 = 0.175 s, the copies 2 x 1.25e8 / 25e9 =
    0.01 s each, the commit 28 x 1.25e8 / 49e9 = 0.071 s: 0.175 + 0.01 + 0.071 + 0.01 + 0.175 = 0.44 s."""
    r = _rec(gpus_per_node=8, intra_bw=10e9, gas=4, reduce_bucket=1e9, gpu_memory=7.2 * GIB)
    assert (r["mode"], r["accumulation"]) == ("acco", "fixed") and r["offload"]
    assert r["reason"].startswith("zero1 fits (7.0 GiB per GPU) but waits for its communication")


# -- the CLI ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv,says",
    [
        (BASE + ["--pcie-bw", "25GB/s"], ["--pcie-bw 25GB/s: only with --offload"]),
        (BASE + ["--host-adam-bw", "40GB/s"], ["--host-adam-bw 40GB/s: only with --offload"]),
        (BASE + ["--offload", "--pcie-bw", "25"], ["--pcie-bw", "no unit", "GB/s"]),
        (BASE + ["--offload", "--host-adam-bw", "0GB/s"], ["--host-adam-bw", "must be > 0"]),
        (
            BASE + ["--offload", "--host-adam-bw-deepspeed", "fast"],
            ["--host-adam-bw-deepspeed", "not a bandwidth"],
        ),
        (
            BASE + ["--offload", "--accelerator", "cpu"],
            [
                "--offload with --accelerator cpu",
                "host memory already",
                "allowed: --offload with --accelerator gpu",
            ],
        ),
    ],
)
def test_bad_offload_options_exit_2_naming_the_option(capsys, argv, says):
    err = _exit2(capsys, argv)
    for text in says:
        assert text in err, (text, err)


def test_cli_output_and_json(capsys, tmp_path):
    out = tmp_path / "plan.json"
    argv = BASE + ["--gpu-memory", "10GiB", "--offload", "--pcie-bw", "20GB/s", "--json", str(out)]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert (
        "offload (*-offload rows): PCIe 20 GB/s, host AdamW 49 GB/s (acco_ds) / 47 GB/s (DeepSpeedCPUAdam)"
        in text
    )
    # t_c = 8 x 0.25 = 2 s; the commit's job 2e9 / 20e9 + 28e9 / 49e9 + 2e9 / 20e9 = 0.1 + 0.571 + 0.1 = 0.771 s <=
    # 1 s: fixed ACCO's step is the compute's; host memory (12 + 2 + 2) x 1e9 B / 2^30 = 14.90 GiB
    assert "| acco-offload | 2000.0 |" in text and "host memory 14.90 GiB |" in text
    assert "recommendation: acco, fixed accumulation, GAS 8, optimizer offloaded to the host" in text
    assert 'add to zero_optimization: "offload_optimizer": {"device": "cpu", "pin_memory": true}' in text
    doc = json.loads(out.read_text())
    assert doc["contenders"][-4:] == list(offload.CONTENDERS)
    assert [r["contender"] for r in doc["rows"]] == doc["contenders"]
    assert doc["recommendation"]["offload"] == offload.OFFLOAD_CONFIG
    assert doc["inputs"]["pcie_bw"] == 20e9 and doc["derived"]["offload_job_commit_s"] > 0
    assert cli.main(BASE + ["--json"]) == 0  # without --offload: no offload rows, offload None
    doc = json.loads(capsys.readouterr().out)
    assert doc["recommendation"]["offload"] is None
    assert not any(r["contender"].endswith("-offload") for r in doc["rows"])


def test_defaults_are_the_offload_modules_and_inputs_are_checked():
    fields = {f.name: f.default for f in dataclasses.fields(PlanInputs)}
    assert fields["pcie_bw"] == offload.PCIE_BW
    assert fields["host_adam_bw"] == offload.HOST_ADAM_BW
    assert fields["host_adam_bw_deepspeed"] == offload.HOST_ADAM_BW_DEEPSPEED
    assert (
        offload.host_bytes_per_param("commit", 2, 2) == 28
        and offload.host_bytes_per_param("peek", 2, 2) == 16
    )
    assert offload.host_bytes_per_param("deepspeed", 2, 2) == 34
    with pytest.raises(ValueError, match="PlanInputs.offload=True: must be False with accelerator='cpu'"):
        dataclasses.replace(ONE_GPU, accelerator="cpu")
    with pytest.raises(ValueError, match="PlanInputs.pcie_bw=0.0: must be > 0"):
        dataclasses.replace(ONE_GPU, pcie_bw=0.0)
