"""ACCO's AdamW defaults are DeepSpeed's ``"type": "AdamW"`` defaults, so a config that changes only the optimizer's
``type`` (AdamW -> ACCO with mode sync) trains exactly as before.

DeepSpeed 0.19.8 builds ``"type": "AdamW"`` in ``DeepSpeedEngine._configure_basic_optimizer`` as FusedAdam (or
DeepSpeedCPUAdam with CPU offload) with ``adam_w_mode=True`` (decoupled weight decay, like ACCO's AdamW); the keys
it shares with ACCO take those classes' defaults. The engine test trains both on one gloo rank in this process
with only ``lr`` set and clipping acting at every step, and compares the fp32 weights, both Adam moments and the
reported gradient norm after every step."""

from __future__ import annotations

import inspect

import deepspeed
import pytest
import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.runtime.config import ADAM_W_MODE_DEFAULT
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

import acco_ds  # noqa: F401  (registers "ACCO")
from acco_ds.config import ACCOConfig
from tests.ranks import toy
from tests.ranks.inproc import ensure_single_rank_group

SHARED_KEYS = ("lr", "betas", "eps", "weight_decay")
STEPS, GAS, LR, CLIP = 6, 2, 1e-2, 0.5
TOL = 2e-6  # fp32 weights, max abs: summation order only
MOMENT_REL = 1e-4  # moments: max abs difference relative to the largest value
NORM_REL = 1e-6


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    ensure_single_rank_group()


@pytest.mark.parametrize("cls", [FusedAdam, DeepSpeedCPUAdam], ids=lambda c: c.__name__)
def test_defaults_are_deepspeeds(cls):
    defaults = ACCOConfig.from_params({})
    signature = inspect.signature(cls.__init__).parameters
    for key in SHARED_KEYS:
        want = signature[key].default
        got = getattr(defaults, key)
        assert (tuple(got) == tuple(want)) if key == "betas" else (got == want), (key, got, want)
    # what "type": "AdamW" (and "Adam" without adam_w_mode) builds: decoupled weight decay, as ACCO's AdamW
    assert ADAM_W_MODE_DEFAULT is True


def config(optimizer: dict) -> dict:
    return {
        "train_micro_batch_size_per_gpu": toy.MICRO_BATCH,
        "gradient_accumulation_steps": GAS,
        "optimizer": optimizer,
        "zero_optimization": {"stage": 1},
        "gradient_clipping": CLIP,
        "steps_per_print": 10**9,
    }


def train(optimizer: dict) -> dict:
    """Per step: the fp32 weights, both moments (DeepSpeed's public accessors) and the reported norm."""
    model = toy.build()
    engine, *_ = deepspeed.initialize(
        model=model, config=config(optimizer), model_parameters=model.parameters()
    )
    params = toy.trainable(engine.module)
    out = {"params": [], "exp_avg": [], "exp_avg_sq": [], "norms": []}
    try:
        for step in range(STEPS):
            for j in range(GAS):
                engine.backward(engine(*toy.micro_batch(0, step * GAS + j)))
                engine.step()
            out["params"].append(toy.flat(safe_get_full_fp32_param(p) for p in params))
            for key in ("exp_avg", "exp_avg_sq"):
                out[key].append(toy.flat(safe_get_full_optimizer_state(p, key) for p in params))
            out["norms"].append(float(engine.get_global_grad_norm()))
    finally:
        if hasattr(engine.optimizer, "pipeline"):
            engine.optimizer.finish()
            engine.optimizer.pipeline.close()
    return out


def max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got - want).abs().max().item() / want.abs().max().item()


@pytest.fixture(scope="module")
def adamw():
    return train({"type": "AdamW", "params": {"lr": LR}})


def test_changing_only_the_type_keeps_the_trajectory(adamw):
    acco = train({"type": "ACCO", "params": {"lr": LR, "mode": "sync"}})
    assert min(adamw["norms"]) > 2 * CLIP, adamw["norms"]  # clipping acts at every step
    for t in range(STEPS):
        diff = (acco["params"][t] - adamw["params"][t]).abs().max().item()
        assert diff <= TOL, f"step {t + 1}: weights max |diff| {diff:.3e}"
        for key in ("exp_avg", "exp_avg_sq"):
            rel = max_rel(acco[key][t], adamw[key][t])
            assert rel <= MOMENT_REL, f"step {t + 1}: {key} max rel diff {rel:.3e}"
        assert acco["norms"][t] == pytest.approx(adamw["norms"][t], rel=NORM_REL), f"step {t + 1}"


def test_the_comparison_sees_a_weight_decay_of_0_01(adamw):
    """The tolerance is far below what a different default would change (ACCO's weight_decay was 0.01)."""
    decayed = train({"type": "ACCO", "params": {"lr": LR, "mode": "sync", "weight_decay": 0.01}})
    diff = (decayed["params"][-1] - adamw["params"][-1]).abs().max().item()
    assert diff > 10 * TOL, diff
