"""The global gradient norm an engine reports (``engine.get_global_grad_norm()``) on a gradient where an fp32
accumulator fails: 3.2M values of ~1e-5 and 8k of ~1e-2 (the rarely used rows of a large embedding beside the
used ones). ACCO (mode sync, fp32 and bf16) and DeepSpeed's own ZeRO-1 AdamW are within 1e-7 (relative) of the
fp64 norm, so clipping acts the same in both. One gloo rank in this process; the model's loss is linear in its
one parameter, so the gradient is exactly the chosen vector."""

from __future__ import annotations

import deepspeed
import pytest
import torch

import acco_ds  # noqa: F401  (registers "ACCO")
from tests.ops.test_norm import swamping_shard
from tests.ranks.inproc import ensure_single_rank_group

N, N_LARGE = 3_200_000, 8192
REL = 1e-7


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    ensure_single_rank_group()


class Linear(torch.nn.Module):
    """loss = <w, coef>: d loss / d w = coef."""

    def __init__(self, n: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(n))

    def forward(self, coef: torch.Tensor) -> torch.Tensor:
        return (self.w * coef).sum()


def reported_norm(optimizer: dict, dtype: torch.dtype, coef: torch.Tensor) -> float:
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": optimizer,
        "zero_optimization": {"stage": 1},
        "gradient_clipping": 1.0,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "steps_per_print": 10**9,
    }
    model = Linear(coef.numel()).to(dtype)
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    try:
        engine.backward(engine(coef.to(dtype)))
        engine.step()
        return float(engine.get_global_grad_norm())
    finally:
        if hasattr(engine.optimizer, "pipeline"):
            engine.optimizer.finish()
            engine.optimizer.pipeline.close()


@pytest.mark.parametrize(
    ("optimizer", "dtype"),
    [
        ({"type": "ACCO", "params": {"mode": "sync"}}, torch.float32),
        ({"type": "ACCO", "params": {"mode": "sync"}}, torch.bfloat16),
        ({"type": "AdamW", "params": {}}, torch.float32),
    ],
    ids=["acco-fp32", "acco-bf16", "zero1-fp32"],
)
def test_reported_norm_is_the_fp64_norm(optimizer, dtype):
    coef = swamping_shard(N, N_LARGE, dtype)
    want = coef.double().norm().item()
    got = reported_norm(optimizer, dtype, coef)
    assert got == pytest.approx(want, rel=REL), f"relative error {abs(got - want) / want:.2e}"
