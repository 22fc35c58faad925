"""Optimizer offload's staged host step (``core.host_step``) on one CPU rank: the path a GPU rank runs.

With ``OffloadSpec(staged=True)`` a round's job copies every group's step inputs into host staging buffers on a copy
thread, then per group waits for them, steps the state with the CPU kernels and copies the new parameters back before
its all-gather (the order itself: ``tests/core/test_host_step_order.py``). The
CPU and CUDA kernels share one math, so offload must not change a bit: every mode, dtype and exchange ends with the
parameters, master shards, moments and gradient norms of the same run without offload. A copy thread that delays
every copy makes a step that does not wait for its inputs read stale staging buffers (the test with the delay)."""

from __future__ import annotations

import pytest
import torch

from acco_ds.core.host_step import HostStep, OffloadSpec, ThreadCopies
from tests.ranks.inproc import ensure_single_rank_group

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
EXCHANGES = {
    "none": {},
    "int8": {"commit": "int8", "peek": "int8"},
    "int4-gather": {"commit": "int4", "peek": "int8", "all_gather": "int8"},
}


@pytest.fixture(scope="module", autouse=True)
def group():
    from acco_ds.deepspeed.cpu_fp16 import allow_fp16_on_cpu

    allow_fp16_on_cpu()
    ensure_single_rank_group()


def build(mode, dtype, exchange, offload, accumulation="fixed", comm_dtype="auto", **more):
    from acco_ds.config import ACCOConfig
    from acco_ds.core.loss_scale import LossScaleSpec
    from acco_ds.core.pipeline import ACCOPipeline
    from acco_ds.models import GPTConfig, TinyGPT
    from acco_ds.ops.adamw_settings import AdamWSettings

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(context=16, n_layer=2, d_model=40)).to(DTYPES[dtype])
    params = list(model.parameters())
    groups = [params[0::2], params[1::2]]
    comp = dict(EXCHANGES[exchange])
    if comp and mode != "acco":
        comp.pop("peek")
    cfg = ACCOConfig(
        mode=mode,
        accumulation=accumulation,
        comm_dtype=comm_dtype,
        **more,
        **({"compression": comp} if comp else {}),
    )
    scale = LossScaleSpec(True, 2.0**8) if dtype == "fp16" else None
    hypers = [AdamWSettings(1e-3, 0.9, 0.999, 1e-8, 0.01), AdamWSettings(2e-3, 0.9, 0.95, 1e-8, 0.0)]
    pipe = ACCOPipeline(groups, lambda: hypers, cfg, 2, 1.0, loss_scale=scale, offload=offload)
    return model, pipe


def train(model, pipe, micro_batches=10, gas=2):
    g = torch.Generator().manual_seed(1)
    norms = []
    for i in range(micro_batches):
        boundary = (i + 1) % gas == 0
        x = torch.randint(0, 256, (3, 16), generator=g)
        pipe.on_backward_start(boundary=boundary)
        pipe.scale_loss(model(x, x)).backward()
        pipe.on_micro_batch_end(boundary=boundary)
        if boundary:
            pipe.end_step()
            pipe.on_engine_step()
            if pipe.last_grad_norm is not None:
                norms.append(pipe.last_grad_norm.clone())
    pipe.finish()
    return norms


def outcome(mode, dtype, exchange, offload, copies=None, **kw):
    model, pipe = build(mode, dtype, exchange, offload, **kw)
    if copies is not None:
        pipe.host_step.copies.close()
        pipe.host_step.copies = copies
    try:
        norms = train(model, pipe)
        state = [(b.master.clone(), b.exp_avg.clone(), b.exp_avg_sq.clone()) for b in pipe.groups]
        params = [p.detach().clone() for p in model.parameters()]
        return dict(norms=norms, state=state, params=params, stats=pipe.stats, pipe=pipe)
    finally:
        pipe.close()


def assert_same_bits(a, b):
    assert len(a["norms"]) == len(b["norms"]) > 0
    for x, y in zip(a["norms"], b["norms"]):
        assert torch.equal(x, y)
    for x, y in zip(a["params"], b["params"]):
        assert torch.equal(x, y)
    for sa, sb in zip(a["state"], b["state"]):
        for x, y in zip(sa, sb):
            assert torch.equal(x, y)
    for key in ("skipped_steps", "skipped_peeks", "micro_batches_committed", "rounds"):
        assert getattr(a["stats"], key) == getattr(b["stats"], key), key


@pytest.mark.parametrize("exchange", list(EXCHANGES))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mode", ["sync", "dpu", "acco"])
def test_the_staged_host_step_gives_the_bits_of_the_step_without_offload(mode, dtype, exchange):
    plain = outcome(mode, dtype, exchange, None)
    staged = outcome(mode, dtype, exchange, OffloadSpec(staged=True))
    assert staged["pipe"].host_step is not None and plain["pipe"].host_step is None
    assert staged["stats"].job_to_host_s > 0.0 and staged["stats"].job_to_device_s > 0.0
    assert plain["stats"].job_to_host_s == 0.0
    assert_same_bits(plain, staged)


@pytest.mark.parametrize("mode", ["acco", "dpu"])
def test_adaptive_accumulation_and_mixed_dtypes_with_the_staged_host_step(mode):
    # adaptive rounds end where timing says unless capped at their share: capped, the same rounds in both runs (the
    # adaptive job still all-gathers each rank's count)
    share = 1 if mode == "acco" else 2
    for kw in ({"accumulation": "adaptive", "max_micro_batches_per_round": share}, {"comm_dtype": "fp32"}):
        plain = outcome(mode, "bf16", "none", None, **kw)
        staged = outcome(mode, "bf16", "none", OffloadSpec(staged=True), **kw)
        assert_same_bits(plain, staged)


@pytest.mark.parametrize("exchange", ["none", "int4-gather"])
def test_a_step_waits_for_its_inputs_copies(exchange):
    """Every copy 20 ms late: a host step that read its staging buffers before the copy finished would step on
    the previous round's gradient (or zeros) and leave the run of the step without offload."""
    plain = outcome("acco", "bf16", exchange, None)
    late = outcome("acco", "bf16", exchange, OffloadSpec(staged=True), copies=ThreadCopies(delay_s=0.02))
    assert_same_bits(plain, late)


def test_the_state_lives_on_the_host_and_the_staging_buffers_are_reused():
    model, pipe = build("acco", "bf16", "none", OffloadSpec(staged=True))
    try:
        staging = []
        for _ in range(2):
            train(model, pipe, micro_batches=4)
            staging.append(pipe.host_step.staging_bytes())
        held = [b.held_bytes() for b in pipe.groups]
        for b in pipe.groups:
            assert b.master.device.type == b.exp_avg.device.type == b.exp_avg_sq.device.type == "cpu"
    finally:
        pipe.close()
    assert staging[0] == staging[1] > 0  # one set of buffers per group, made once
    # on a CPU rank the state device is the parameters' device: nothing counts as moved away; the staging does
    assert all(h["host_shards"] == 0 for h in held)
    assert sum(h["host_staging"] for h in held) == staging[0]


def test_host_step_run_copies_an_aliased_base_once_and_returns_device_tensors():
    """``base`` is the target itself: its old values reach the host once, the step reads them before it writes."""
    host = HostStep(1, torch.device("cpu"), OffloadSpec(staged=True))
    seen = {}

    def fn(master, exp_avg, exp_avg_sq, *, out, grad, base):
        seen["aliased"] = out.data_ptr() == base.data_ptr()
        seen["base"] = base.clone()
        out.copy_(base + grad)
        return (out.clone(), grad.clone())

    target = torch.arange(8.0)
    grad = torch.ones(8)
    state = (torch.zeros(8), torch.zeros(8), torch.zeros(8))
    try:
        result = host.run(0, fn, state, dict(grad=grad, base=target), target)
    finally:
        host.close()
    assert seen["aliased"] and torch.equal(seen["base"], torch.arange(8.0))
    assert torch.equal(target, torch.arange(8.0) + 1)
    assert torch.equal(result[0], target) and result[0].data_ptr() != target.data_ptr()


def test_the_spec_stages_on_cpu_only_when_asked(monkeypatch):
    from acco_ds.core.host_step import STAGING_ENV

    monkeypatch.delenv(STAGING_ENV, raising=False)
    assert not OffloadSpec.for_device(torch.device("cpu"), True).staged
    assert OffloadSpec.for_device(torch.device("cuda", 0), False).staged
    monkeypatch.setenv(STAGING_ENV, "1")
    assert OffloadSpec.for_device(torch.device("cpu"), False).staged
