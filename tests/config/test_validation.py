"""Every invalid ACCO option and every DeepSpeed combination ACCO cannot run fails before any
training, with one ACCOConfigError whose message names the key, the value and what is allowed.

Option-level rows go through ``ACCOConfig.from_params``; engine-level rows through
``deepspeed.initialize`` on a one-rank gloo group inside this process (a few go through both). A
hypothesis test feeds random option dictionaries (and random gradient_accumulation_steps /
gradient_clipping): each either trains one optimizer step (the parameters move when a commit was
applied and stay bit for bit when none was) or raises ACCOConfigError and leaves the model as it was.
"""

from __future__ import annotations

import logging
import math
import re
import types

import deepspeed
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import acco_ds  # noqa: F401  (registers "ACCO")
from acco_ds.config import ALLOWED, ACCOConfig, ACCOConfigError
from acco_ds.deepspeed.validate import check_engine_config
from acco_ds.deepspeed.version import ALLOW_UNTESTED_ENV, check_deepspeed_version
from tests.ranks import toy
from tests.ranks.inproc import ensure_single_rank_group

# -- option level: (params, key, value text, allowed text) -------------------------------------------
BAD_PARAMS = [
    ({"lr": -1e-3}, "lr", "-0.001", ALLOWED["lr"]),
    ({"lr": float("nan")}, "lr", "nan", ALLOWED["lr"]),
    ({"lr": float("inf")}, "lr", "inf", ALLOWED["lr"]),
    ({"lr": "fast"}, "lr", "'fast'", ALLOWED["lr"]),
    ({"lr": True}, "lr", "True", ALLOWED["lr"]),
    ({"lr": None}, "lr", "None", ALLOWED["lr"]),
    ({"betas": [0.9, 1.0]}, "betas", "[0.9, 1.0]", ALLOWED["betas"]),
    ({"betas": [-0.1, 0.999]}, "betas", "[-0.1, 0.999]", ALLOWED["betas"]),
    ({"betas": [0.9]}, "betas", "[0.9]", ALLOWED["betas"]),
    ({"betas": [0.9, 0.99, 0.5]}, "betas", "[0.9, 0.99, 0.5]", ALLOWED["betas"]),
    ({"betas": "0.9,0.999"}, "betas", "'0.9,0.999'", ALLOWED["betas"]),
    ({"betas": [0.9, "x"]}, "betas", "[0.9, 'x']", ALLOWED["betas"]),
    ({"eps": 0.0}, "eps", "0.0", ALLOWED["eps"]),
    ({"eps": -1e-8}, "eps", "-1e-08", ALLOWED["eps"]),
    ({"weight_decay": -0.1}, "weight_decay", "-0.1", ALLOWED["weight_decay"]),
    ({"weight_decay": float("inf")}, "weight_decay", "inf", ALLOWED["weight_decay"]),
    ({"mode": "zero1"}, "mode", "'zero1'", ALLOWED["mode"]),
    ({"mode": "ACCO"}, "mode", "'ACCO'", ALLOWED["mode"]),
    ({"mode": 1}, "mode", "1", ALLOWED["mode"]),
    ({"accumulation": "dynamic"}, "accumulation", "'dynamic'", ALLOWED["accumulation"]),
    ({"comm_dtype": "fp8"}, "comm_dtype", "'fp8'", ALLOWED["comm_dtype"]),
    ({"comm_dtype": "float32"}, "comm_dtype", "'float32'", ALLOWED["comm_dtype"]),
    ({"comm_timeout_s": 0}, "comm_timeout_s", "0", ALLOWED["comm_timeout_s"]),
    ({"comm_timeout_s": 0.01}, "comm_timeout_s", "0.01", ALLOWED["comm_timeout_s"]),
    ({"comm_timeout_s": float("inf")}, "comm_timeout_s", "inf", ALLOWED["comm_timeout_s"]),
    ({"comm_timeout_s": 1e9}, "comm_timeout_s", "1000000000.0", ALLOWED["comm_timeout_s"]),
    (
        {"accumulation": "adaptive", "max_micro_batches_per_round": 0},
        "max_micro_batches_per_round",
        "0",
        ALLOWED["max_micro_batches_per_round"],
    ),
    (
        {"accumulation": "adaptive", "max_micro_batches_per_round": 2.5},
        "max_micro_batches_per_round",
        "2.5",
        ALLOWED["max_micro_batches_per_round"],
    ),
    ({"max_micro_batches_per_round": 4}, "max_micro_batches_per_round", "4", "accumulation='adaptive'"),
    (
        {"accumulation": "adaptive", "max_micro_batches_per_round": float("inf")},
        "max_micro_batches_per_round",
        "inf",
        ALLOWED["max_micro_batches_per_round"],
    ),
    ({"mode": "sync", "accumulation": "adaptive"}, "accumulation", "'adaptive'", "'fixed' with mode='sync'"),
    ({"compression": {"commit": "fp8"}}, "compression.commit", "'fp8'", ALLOWED["compression.commit"]),
    ({"compression": {"commit": True}}, "compression.commit", "True", ALLOWED["compression.commit"]),
    ({"compression": {"peek": "int2"}}, "compression.peek", "'int2'", ALLOWED["compression.peek"]),
    ({"compression": {"block_size": 0}}, "compression.block_size", "0", ALLOWED["compression.block_size"]),
    (
        {"compression": {"block_size": 2.5}},
        "compression.block_size",
        "2.5",
        ALLOWED["compression.block_size"],
    ),
    (
        {"compression": {"block_size": True}},
        "compression.block_size",
        "True",
        ALLOWED["compression.block_size"],
    ),
    (
        {"compression": {"error_feedback": "yes"}},
        "compression.error_feedback",
        "'yes'",
        ALLOWED["compression.error_feedback"],
    ),
    (
        {"compression": {"all_gather": "fp8"}},
        "compression.all_gather",
        "'fp8'",
        ALLOWED["compression.all_gather"],
    ),
    ({"compression": {"foo": 1}}, "compression.foo", "1", "Allowed keys: all_gather, block_size, commit"),
    ({"compression": "int8"}, "compression", "'int8'", ALLOWED["compression"]),
    (
        {"mode": "sync", "compression": {"peek": "int8"}},
        "compression.peek",
        "'int8'",
        "'int4' with mode='acco'",
    ),
    (
        {"mode": "dpu", "compression": {"peek": "int8"}},
        "compression.peek",
        "'int8'",
        "'int4' with mode='acco'",
    ),
    ({"peek_lr_scale": 0}, "peek_lr_scale", "0", ALLOWED["peek_lr_scale"]),
    ({"peek_lr_scale": 4.5}, "peek_lr_scale", "4.5", ALLOWED["peek_lr_scale"]),
    ({"peek_lr_scale": float("nan")}, "peek_lr_scale", "nan", ALLOWED["peek_lr_scale"]),
    ({"peek_lr_scale": "fast"}, "peek_lr_scale", "'fast'", ALLOWED["peek_lr_scale"]),
    ({"mode": "sync", "peek_lr_scale": 1.5}, "peek_lr_scale", "1.5", "any value in (0, 4] with mode='acco'"),
    ({"mode": "dpu", "peek_lr_scale": 2}, "peek_lr_scale", "2", "1.0 with mode='dpu' or 'sync'"),
    ({"memory_state": {"enabled": 1}}, "memory_state.enabled", "1", ALLOWED["memory_state.enabled"]),
    ({"memory_state": {"dir": "shm"}}, "memory_state.dir", "'shm'", ALLOWED["memory_state.dir"]),
    (
        {"memory_state": {"peer_copy": "no"}},
        "memory_state.peer_copy",
        "'no'",
        ALLOWED["memory_state.peer_copy"],
    ),
    ({"memory_state": {"run_id": " "}}, "memory_state.run_id", "' '", ALLOWED["memory_state.run_id"]),
    (
        {"memory_state": {"peer_copy_form": "diff"}},
        "memory_state.peer_copy_form",
        "'diff'",
        ALLOWED["memory_state.peer_copy_form"],
    ),
    (
        {"memory_state": {"peer": 1}},
        "memory_state.peer",
        "1",
        "Allowed keys: dir, enabled, peer_copy, peer_copy_form, run_id",
    ),
    ({"memory_state": True}, "memory_state", "True", ALLOWED["memory_state"]),
    ({"momentum": 0.9}, "momentum", "0.9", "Allowed keys: accumulation, betas"),
    ({"adam_w_mode": True}, "adam_w_mode", "True", "Allowed keys: accumulation, betas"),
]


@pytest.mark.parametrize("params,key,value,allowed", BAD_PARAMS, ids=lambda x: None)
def test_bad_option_message(params, key, value, allowed):
    with pytest.raises(ACCOConfigError) as info:
        ACCOConfig.from_params(params)
    msg = str(info.value)
    assert f"optimizer.params.{key}={value}" in msg, msg
    assert allowed in msg, msg
    assert len(msg.splitlines()) == 2, msg  # one problem, one line under the header


@pytest.mark.parametrize("params", [[("lr", 1.0)], "lr=1", 3])
def test_params_not_a_dict(params):
    with pytest.raises(ACCOConfigError, match=r"optimizer\.params=.*must be a JSON object"):
        ACCOConfig.from_params(params)


def test_every_problem_in_one_message():
    with pytest.raises(ACCOConfigError) as info:
        ACCOConfig.from_params({"lr": -1, "eps": 0, "mode": "x", "foo": 1})
    msg = str(info.value)
    for key in ("lr=-1", "eps=0", "mode='x'", "foo=1"):
        assert f"optimizer.params.{key}" in msg, msg


def test_valid_options_pass():
    cfg = ACCOConfig.from_params(
        {
            "lr": "3e-4",
            "betas": [0, 0.95],
            "mode": "dpu",
            "accumulation": "adaptive",
            "max_micro_batches_per_round": 8.0,
        }
    )
    assert cfg.lr == 3e-4 and cfg.betas == (0.0, 0.95) and cfg.max_micro_batches_per_round == 8
    assert cfg.peek_lr_scale == 1.0
    assert ACCOConfig.from_params({"peek_lr_scale": "1.5"}).peek_lr_scale == 1.5
    assert ACCOConfig.from_params({"mode": "sync", "peek_lr_scale": 1}).peek_lr_scale == 1.0


def test_compression_defaults_off_and_valid_values_pass():
    off = ACCOConfig.from_params({}).compression
    assert (off.commit, off.peek, off.block_size, off.error_feedback, off.all_gather) == (
        "none",
        "none",
        256,
        True,
        "none",
    )
    assert not off.enabled
    on = ACCOConfig.from_params(
        {"compression": {"commit": "int8", "peek": "int8", "block_size": 64.0, "error_feedback": False}}
    ).compression
    assert on.enabled and on.block_size == 64 and on.error_feedback is False
    assert ACCOConfig.from_params({"mode": "sync", "compression": {"commit": "int8"}}).compression.enabled
    params_only = ACCOConfig.from_params({"mode": "dpu", "compression": {"all_gather": "int8"}}).compression
    assert params_only.enabled and not params_only.compresses_gradients and params_only.all_gather == "int8"
    assert on.compresses_gradients and not off.compresses_gradients


# -- DeepSpeed version range -------------------------------------------------------------------------
@pytest.mark.parametrize("version", ["0.19.7", "0.20.0", "0.18.5+cu121", "1.0.0"])
def test_deepspeed_version_outside_range(version, monkeypatch):
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(ACCOConfigError) as info:
        check_deepspeed_version(version)
    msg = str(info.value)
    assert f"deepspeed=={version}:" in msg and "Allowed: pip install 'deepspeed>=0.19.8,<0.20.0'" in msg, msg


# on both sides of both bounds of the tested range [0.19.8, 0.20.0)
INSIDE = ["0.19.8", "0.19.8+abc", "0.19.12", "0.19.99"]
OUTSIDE = ["0.19.7", "0.20.0", "0.20.0+cu121", "0.21.0"]


@pytest.mark.parametrize("version", INSIDE)
def test_deepspeed_version_inside_range(version, monkeypatch):
    """Inside the tested range, without the override: accepted (returns, no error)."""
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    assert check_deepspeed_version(version) is None


@pytest.mark.parametrize("version", OUTSIDE)
def test_deepspeed_version_override(version, monkeypatch):
    """Outside the range: refused without the override, accepted with ACCO_DS_ALLOW_UNTESTED_DEEPSPEED=1
    (only "1" overrides)."""
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(ACCOConfigError, match=f"deepspeed=={re.escape(version)}:"):
        check_deepspeed_version(version)
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "0")
    with pytest.raises(ACCOConfigError):
        check_deepspeed_version(version)
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    assert check_deepspeed_version(version) is None


# -- engine level, through deepspeed.initialize on one rank --------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def one_rank():
    ensure_single_rank_group()


def ds_config(params=None, **top):
    cfg = {
        "train_micro_batch_size_per_gpu": toy.MICRO_BATCH,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "ACCO", "params": dict(params or {})},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
    }
    cfg.update(top)
    return cfg


def initialize(cfg, model=None, **kw):
    model = model if model is not None else toy.build()
    return deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters(), **kw)


class _PipeModel:
    @staticmethod
    def build():
        from deepspeed.pipe import PipelineModule

        return PipelineModule(
            layers=[torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)], num_stages=1, loss_fn=torch.nn.MSELoss()
        )


class _MoEModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.moe = MoE(hidden_size=8, expert=torch.nn.Linear(8, 8), num_experts=2, ep_size=1)


def _fp16_supported(monkeypatch):
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: True)


def _autocast_state_restored(monkeypatch):
    """DeepSpeed's engine records torch_autocast in module globals of deepspeed.runtime.torch_autocast
    before the optimizer is configured (so before ACCO refuses the config) and never resets them: every later
    ZeRO engine in this process would then scale its loss as fp16 autocast does. Restore them after the test."""
    from deepspeed.runtime import torch_autocast

    for name in ("TORCH_AUTOCAST_INITIALIZED", "TORCH_AUTOCAST_DTYPE"):
        monkeypatch.setattr(torch_autocast, name, getattr(torch_autocast, name))


# name: (config, model factory, extra initialize kwargs, setup, [substrings of the message])
ENGINE_ROWS = {
    "zero_stage_0": (
        {k: v for k, v in ds_config().items() if k != "zero_optimization"},
        None,
        {},
        None,
        ["zero_optimization.stage=0", '"stage": 1'],
    ),
    "zero_stage_2": (ds_config(zero_optimization={"stage": 2}), None, {}, None, ["stage=2", '"stage": 1']),
    "zero_stage_3": (ds_config(zero_optimization={"stage": 3}), None, {}, None, ["stage=3", '"stage": 1']),
    "fp16_master_weights_and_grads": (
        ds_config(fp16={"enabled": True, "fp16_master_weights_and_grads": True}),
        None,
        {},
        _fp16_supported,
        ["fp16.fp16_master_weights_and_grads=true", "fp32 master", "false"],
    ),
    "fp16_hysteresis_zero": (
        ds_config(fp16={"enabled": True, "hysteresis": 0}),
        None,
        {},
        _fp16_supported,
        ["fp16.hysteresis=0", ">= 1"],
    ),
    "offload_optimizer_nvme": (
        ds_config(
            zero_optimization={"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}
        ),
        None,
        {},
        None,
        ["zero_optimization.offload_optimizer.device=nvme", 'Allowed: "cpu", or "none"'],
    ),
    "offload_optimizer_super_offload": (
        ds_config(
            zero_optimization={"stage": 1, "offload_optimizer": {"device": "cpu", "super_offload": True}}
        ),
        None,
        {},
        None,
        ["zero_optimization.offload_optimizer.super_offload=true", "super_offload false"],
    ),
    "offload_param": (
        ds_config(zero_optimization={"stage": 1, "offload_param": {"device": "cpu"}}),
        None,
        {},
        None,
        ["zero_optimization.offload_param.device=cpu"],
    ),
    "pipeline_parallelism": (ds_config(), _PipeModel.build, {}, None, ["pipeline parallelism", "nn.Module"]),
    "moe": (ds_config(), _MoEModel, {}, None, ["MoE", "Allowed"]),
    "client_optimizer_and_acco": (
        ds_config(),
        None,
        {"optimizer": "sgd"},
        None,
        ['optimizer.type="ACCO"', "optimizer=SGD", "one or the other"],
    ),
    "acco_odd_gas": (
        ds_config(gradient_accumulation_steps=3),
        None,
        {},
        None,
        ["gradient_accumulation_steps=3", "Allowed: an even number >= 2 (e.g. 4"],
    ),
    "acco_gas_1": (
        ds_config(gradient_accumulation_steps=1),
        None,
        {},
        None,
        ["gradient_accumulation_steps=1"],
    ),
    "cap_below_share": (
        ds_config(
            {"accumulation": "adaptive", "max_micro_batches_per_round": 1}, gradient_accumulation_steps=4
        ),
        None,
        {},
        None,
        ["max_micro_batches_per_round=1", "at least 2 micro-batches", "integer >= 2"],
    ),
    "negative_clipping": (
        ds_config(gradient_clipping=-1.0),
        None,
        {},
        None,
        ["gradient_clipping=-1.0", ">= 0"],
    ),
    "communication_data_type": (
        ds_config(communication_data_type="fp16"),
        None,
        {},
        None,
        ["communication_data_type=torch.float16", "optimizer.params.comm_dtype"],
    ),
    "fp16_autocast": (
        ds_config(torch_autocast={"enabled": True, "dtype": "torch.float16"}),
        None,
        {},
        _autocast_state_restored,
        ["torch_autocast.dtype=torch.float16", "bfloat16"],
    ),
    "zenflow": (
        ds_config(zero_optimization={"stage": 1, "zenflow": {"topk_ratio": 0.1}}),
        None,
        {},
        None,
        ["zero_optimization.zenflow"],
    ),
    "float64_model": (
        ds_config(),
        lambda: toy.build().double(),
        {},
        None,
        ["torch.float64", "float32, bfloat16 or float16"],
    ),
    "option_lr_through_initialize": (
        ds_config({"lr": -1}),
        None,
        {},
        None,
        ["optimizer.params.lr=-1", ">= 0"],
    ),
    "option_mode_through_initialize": (
        ds_config({"mode": "pipesgd"}),
        None,
        {},
        None,
        ["optimizer.params.mode='pipesgd'", "'acco', 'dpu' or 'sync'"],
    ),
    "option_unknown_key_through_initialize": (
        ds_config({"torch_adam": True}),
        None,
        {},
        None,
        ["optimizer.params.torch_adam=True", "unknown option"],
    ),
}


@pytest.mark.parametrize("name", list(ENGINE_ROWS))
def test_engine_config_rejected_before_training(name, monkeypatch):
    cfg, factory, kw, setup, expected = ENGINE_ROWS[name]
    if setup is not None:
        setup(monkeypatch)
    model = factory() if factory is not None else toy.build()
    if kw.get("optimizer") == "sgd":
        kw = {**kw, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    with pytest.raises(ACCOConfigError) as info:
        initialize(cfg, model, **kw)
    msg = str(info.value)
    for part in expected:
        assert part in msg, f"{name}: {part!r} not in: {msg}"


def test_half_model_without_fp16_section_is_loss_scaled_as_zero1():
    """As DeepSpeed's ZeRO-1, a model cast to fp16 with no fp16 section trains with dynamic loss scaling from the
    fp16 section's defaults (2 ** 16), and fp16 communication."""
    engine, *_ = initialize(ds_config(), toy.build().half())
    try:
        assert engine.optimizer.pipeline.groups[0].comm_dtype == torch.float16
        assert engine.optimizer.cur_scale == 2.0**16 and engine.optimizer.dynamic_loss_scale
        _train_step(engine)
        assert engine.optimizer.stats()["committed_steps"] == 1
    finally:
        _close(engine)


def test_optimizer_offload_on_a_cpu_rank_is_accepted_and_said(caplog):
    """offload_optimizer device "cpu" (pinned or not) on a CPU rank: accepted, the log says the state is in host
    memory already, and it trains as without the key (tests/deepspeed/test_offload.py compares the trajectories)."""
    for pin in (True, False):
        off = {"stage": 1, "offload_optimizer": {"device": "cpu", "pin_memory": pin}}
        with caplog.at_level(logging.INFO, logger="acco_ds"):
            engine, *_ = initialize(ds_config(zero_optimization=off))
        try:
            assert (
                "optimizer state (fp32 master shard, exp_avg, exp_avg_sq) is in host memory already"
                in caplog.text
            )
            _train_step(engine)
            assert engine.optimizer.stats()["committed_steps"] == 1
        finally:
            _close(engine)
        caplog.clear()


def test_optimizer_offload_on_a_gpu_rank_is_accepted_staged(monkeypatch):
    """On a CUDA rank the section is accepted and the pipeline gets a staged host step with the section's
    pin_memory (checked without a GPU: the engine's device is what the check and the spec read); on a CPU rank it
    steps in place unless ACCO_DS_HOST_STEP_STAGING=1."""
    from acco_ds.core.host_step import STAGING_ENV
    from acco_ds.deepspeed.validate import check_offload_config, offload_spec

    monkeypatch.delenv(STAGING_ENV, raising=False)

    class _Off:
        device, ratio, super_offload, pin_memory = "cpu", 1.0, False, True

    engine = types.SimpleNamespace(
        device=torch.device("cuda", 0), zero_offload_optimizer=lambda: _Off(), zero_offload_param=lambda: None
    )
    check_offload_config(engine)
    spec = offload_spec(engine)
    assert spec.staged and spec.pin_memory
    engine.device = torch.device("cpu")
    check_offload_config(engine)
    assert not offload_spec(engine).staged
    monkeypatch.setenv(STAGING_ENV, "1")
    assert offload_spec(engine).staged
    engine.zero_offload_optimizer = lambda: None
    assert offload_spec(engine) is None


def test_deepspeed_version_through_initialize(monkeypatch):
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    monkeypatch.setattr(deepspeed, "__version__", "0.18.0")
    with pytest.raises(ACCOConfigError, match=r"deepspeed==0\.18\.0: .*Allowed"):
        initialize(ds_config())
    # the override reaches the engine: the same version then builds an engine that trains
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    engine, *_ = initialize(ds_config())
    try:
        _train_step(engine)
        assert engine.optimizer.stats()["committed_steps"] == 1
    finally:
        _close(engine)


def test_comm_dtype_the_backend_cannot_reduce(monkeypatch):
    """The probe at set-up: a backend whose reduce-scatter rejects bf16 (gloo on this torch sums bf16,
    see test_gloo_reduces_bf16, so the rejection is simulated) fails with the option named."""
    name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    real = getattr(dist, name)

    def no_bf16(out, inp, *a, **k):
        if inp.dtype == torch.bfloat16:
            raise RuntimeError("Unsupported dtype BFloat16 for reduce_scatter")
        return real(out, inp, *a, **k)

    monkeypatch.setattr(dist, name, no_bf16)
    with pytest.raises(ACCOConfigError) as info:
        initialize(ds_config({"comm_dtype": "bf16"}))
    msg = str(info.value)
    assert "optimizer.params.comm_dtype='bf16'" in msg and "gloo" in msg and "'fp32'" in msg, msg


def test_gloo_reduces_bf16():
    """Recorded fact: this torch's gloo reduce-scatters and all-gathers bf16, so comm_dtype='bf16'
    trains on CPU (the probe passes)."""
    engine, *_ = initialize(ds_config({"comm_dtype": "bf16"}))
    try:
        assert engine.optimizer.pipeline.groups[0].comm_dtype == torch.bfloat16
        _train_step(engine)
    finally:
        _close(engine)


class _Engine:
    """The attributes check_engine_config reads, for the multi-rank layouts one process cannot build."""

    def __init__(self, **kw):
        self.__dict__.update(dict(mp_world_size=1, dp_world_size=1, seq_dp_world_size=1), **kw)
        self._config = type("C", (), {"communication_data_type": None, "zero_config": object()})()

    zero_optimization_stage = staticmethod(lambda: 1)
    fp16_enabled = staticmethod(lambda: False)
    zero_offload_optimizer = staticmethod(lambda: None)
    zero_offload_param = staticmethod(lambda: None)
    gradient_clipping = staticmethod(lambda: 1.0)
    torch_autocast_enabled = staticmethod(lambda: False)
    gradient_accumulation_steps = staticmethod(lambda: 2)


@pytest.mark.parametrize(
    "engine,expected",
    [
        (
            _Engine(mp_world_size=3, world_size=4),
            ["autotp_size (model-parallel world size) = 3 does not divide the 4 ranks", "[1, 2, 4]"],
        ),
        (
            _Engine(mp_world_size=2, world_size=4, mpu=object()),
            ["model-parallel world size 2", "get_model_parallel_group()", "AutoTP"],
        ),
        (
            _Engine(dp_world_size=2, seq_dp_world_size=4),
            ["sequence_parallel_size=2", "sequence_parallel_size=1"],
        ),
    ],
    ids=["model_parallel_3_of_4", "mpu_without_groups", "sequence_parallel_2"],
)
def test_world_layouts_acco_cannot_use(engine, expected):
    with pytest.raises(ACCOConfigError) as info:
        check_engine_config(engine, None, ACCOConfig())
    for part in expected:
        assert part in str(info.value)


def test_nothing_ran_before_the_error():
    """A rejected config builds no pipeline: no communication thread or heartbeat is left running."""
    import threading

    before = {t.name for t in threading.enumerate()}
    for cfg in (ds_config({"lr": -1}), ds_config(gradient_accumulation_steps=3)):
        with pytest.raises(ACCOConfigError):
            initialize(cfg)
    with pytest.raises(ACCOConfigError):
        initialize(ds_config(), toy.build().double())
    after = [t.name for t in threading.enumerate() if t.name not in before]
    assert not [n for n in after if n.startswith("acco-")], after


# -- property: random options either train a step or raise ACCOConfigError ------------------------------
def _train_step(engine):
    gas = engine.gradient_accumulation_steps()
    for j in range(gas):
        loss = engine(*toy.micro_batch(0, j))
        engine.backward(loss)
        engine.step()
    engine.optimizer.finish()


def _close(engine):
    engine.optimizer.pipeline.close()


KEYS = sorted(ACCOConfig.model_fields) + ["momentum", "Lr", ""]
_numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=64),
    st.floats(min_value=0, max_value=1, exclude_max=True),
    st.integers(min_value=-3, max_value=10**7),
)
_values = st.one_of(
    _numbers,
    st.booleans(),
    st.none(),
    st.sampled_from(["acco", "dpu", "sync", "fixed", "adaptive", "auto", "bf16", "fp32", "fp16", "", "1e-3"]),
    st.text(max_size=5),
    st.lists(_numbers, min_size=0, max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
_options = st.dictionaries(st.sampled_from(KEYS), _values, max_size=5)
# valid-looking dictionaries too (most of them valid), so that many examples get as far as training
_plausible = st.fixed_dictionaries(
    {},
    optional={
        "lr": st.floats(min_value=0, max_value=1),
        "betas": st.tuples(st.floats(0, 0.999), st.floats(0, 0.9999)),
        "eps": st.floats(min_value=1e-12, max_value=1.0),
        "weight_decay": st.floats(min_value=0, max_value=1),
        "mode": st.sampled_from(["acco", "dpu", "sync"]),
        "accumulation": st.sampled_from(["fixed", "fixed", "adaptive"]),
        "comm_dtype": st.sampled_from(["auto", "bf16", "fp32"]),
        "max_micro_batches_per_round": st.one_of(st.none(), st.none(), st.integers(-1, 6)),
        # a valid timeout short enough to expire on a loaded machine would fail the run for real: the
        # short timeouts' behaviour is tested in tests/reliability/test_peer_loss.py
        "comm_timeout_s": st.floats(min_value=60.0, max_value=1e4),
    },
)


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    options=st.one_of(_plausible, _plausible, _plausible, _options),
    gas=st.sampled_from([2, 4, 2, 4, 1, 3]),
    clip=st.sampled_from([0.0, 1.0, 0.5, 0.0, 1.0, -1.0, math.inf]),
    bf16=st.booleans(),
)
def test_random_options_train_or_raise_config_error(options, gas, clip, bf16):
    cfg = ds_config(options, gradient_accumulation_steps=gas, gradient_clipping=clip, bf16={"enabled": bf16})
    model = toy.build()
    initial = [p.detach().clone() for p in model.parameters()]
    try:
        engine, *_ = initialize(cfg, model)
    except ACCOConfigError as err:
        assert "Allowed" in str(err), str(err)
        # refused: nothing written into the model (DeepSpeed casts the module to bf16 before the check)
        for p, p0 in zip(model.parameters(), initial):
            assert torch.equal(p.detach(), p0.to(p.dtype)), "a refused config changed the model's parameters"
        event("rejected")
        return
    try:
        named = list(engine.module.named_parameters())
        before = [p.detach().clone() for _, p in named]
        _train_step(engine)
        stats = engine.optimizer.stats()
        if stats["accumulation"] == "fixed":
            assert stats["committed_steps"] == 1, stats
        else:  # adaptive: the first round may take every micro-batch of the step (then nothing commits)
            assert stats["committed_steps"] <= 1, stats
        assert (
            stats["micro_batches_local"]
            == stats["micro_batches_committed"] + stats["micro_batches_discarded"]
        )
        after = [p.detach() for _, p in named]
        assert len(after) == len(before)
        moved = {n for (n, p), a, b in zip(named, after, before) if not torch.equal(a, b)}
        trainable = {n for n, p in named if p.requires_grad}
        assert not moved - trainable, f"a frozen parameter changed: {moved - trainable}"
        if stats["applied_steps"] == 0:
            # no commit applied: the model holds the initial parameters bit for bit (no estimate left in it)
            assert not moved, f"parameters changed although no step was applied: {sorted(moved)}"
            event("nothing applied: parameters unchanged")
        else:
            assert all(torch.isfinite(a).all() for a in after)
            if _step_visible(engine.optimizer.cfg, bf16):
                assert moved == trainable, f"an applied step left {sorted(trainable - moved)} unchanged"
                event("applied: every trainable parameter moved")
        event(f"trained mode={engine.optimizer.cfg.mode} accumulation={engine.optimizer.cfg.accumulation}")
    finally:
        _close(engine)


def _step_visible(cfg, bf16: bool) -> bool:
    """A first AdamW step moves each element by about lr * g / (|g| + eps) (+ lr * wd * p): every
    trainable tensor of the toy model has gradient elements well above 1e-4, so with eps <= 1e-4 each
    moves by lr / 2 or more somewhere, which its dtype can show when lr is at least 1e-4 (fp32) or 0.05
    (bf16, 8 bits of mantissa on values up to ~3)."""
    return cfg.eps <= 1e-4 and cfg.lr >= (0.05 if bf16 else 1e-4)
