"""The ulp bounds of tests/ops/adamw_oracle.py validated on CPU: 100 AdamW steps, n = 1, 7, 4096 and 65536, many
seeds, fp32, bf16 and fp16 gradients, weight decay 0 and 0.1, for every fused AdamW we can run here (the CPU extension
through acco_ds.ops.adamw, the CUDA kernel body run by the CPU harness, the pure-torch fallback), torch's own fp32
AdamW and an emulation of torch's CUDA arithmetic (FMA, product by a reciprocal). The GPU test
(tests/gpu/test_kernels_gpu.py::test_cuda_matches_torch_adamw_100_steps) applies the same bounds to the CUDA kernel
and torch's CUDA AdamW."""

from __future__ import annotations

import zlib

import pytest
import torch

from acco_ds.ops import _build
from acco_ds.ops.adamw import adamw_step, adamw_step_cuda_body_on_cpu, adamw_step_ref
from tests.ops.adamw_oracle import ULP_BOUNDS, AdamWOracle, torch_cuda_like_step

HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)
# (n, seeds): n = 1 and 7 are where a ratio of two errors failed by chance; 65536 elements are 65536 more draws
RUNS = [(1, 48), (7, 16), (4096, 3), (65536, 1)]


def gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def backends() -> dict:
    out = {"torch_fallback": adamw_step_ref, "torch_cuda_like": torch_cuda_like_step}
    if _build.load("adamw_cpu") is not None:
        out["cpu_ext"] = adamw_step
        out["cuda_body"] = adamw_step_cuda_body_on_cpu
    return out


def run_100_steps(n, gdtype, wd, seed, fns: dict) -> tuple:
    """One 100-step run of every function in ``fns`` from the same start and gradients: (oracle, {name: state})."""
    g = gen("ulp-bounds", n, gdtype, wd, seed)
    p0 = torch.randn(n, generator=g)
    oracle = AdamWOracle(p0, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"], weight_decay=wd)
    states = {name: [p0.clone(), torch.zeros(n), torch.zeros(n)] for name in fns}
    for step in range(1, 101):
        grad = (torch.randn(n, generator=g) * 0.5).to(gdtype)
        oracle.step(grad)
        for name, fn in fns.items():
            fn(*states[name], grad, weight_decay=wd, step=step, **HP)
    return oracle, states


@pytest.mark.parametrize(
    "gdtype", [torch.float32, torch.bfloat16, torch.float16], ids=["g_fp32", "g_bf16", "g_fp16"]
)
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_ulp_bounds_hold_for_every_implementation(wd, gdtype):
    fns = backends()
    worst = {name: dict.fromkeys(ULP_BOUNDS, 0.0) for name in [*fns, "torch_fp32"]}
    for n, seeds in RUNS:
        for seed in range(seeds):
            oracle, states = run_100_steps(n, gdtype, wd, seed, fns)
            for name, errs in [(k, oracle.max_ulps(*s)) for k, s in states.items()] + [
                ("torch_fp32", oracle.max_ulps(**oracle.torch32()))
            ]:
                for k, e in errs.items():
                    worst[name][k] = max(worst[name][k], e)
            oracle.check(*states[next(iter(fns))])  # the assertion the tests use, on one of them
    print({name: {k: round(e, 2) for k, e in w.items()} for name, w in worst.items()})
    for name, w in worst.items():
        over = {k: e for k, e in w.items() if e > ULP_BOUNDS[k]}
        assert not over, (
            f"{name}: largest errors in ulps {over} over the bounds {ULP_BOUNDS} (wd {wd}, {gdtype})"
        )
        # the bounds are not so loose that they say nothing: the worst case reaches a tenth of them
        assert w["master"] >= ULP_BOUNDS["master"] / 10, (name, w)


def _no_decay_step(p, m, v, grad, *, weight_decay, **kw):
    adamw_step_ref(p, m, v, grad, weight_decay=0.0, **kw)


def _lr_off_step(p, m, v, grad, *, lr, **kw):
    adamw_step_ref(p, m, v, grad, lr=lr * 1.001, **kw)


@pytest.mark.parametrize("wrong", [_no_decay_step, _lr_off_step], ids=["no_decay", "lr_0.1%_off"])
def test_a_wrong_update_breaks_the_bounds(wrong):
    """The bounds catch small departures from AdamW, at n = 1 too: weight decay dropped, the lr 0.1% off."""
    for n in (1, 4096):
        oracle, states = run_100_steps(n, torch.float32, 0.1, 0, {"wrong": wrong})
        with pytest.raises(AssertionError):
            oracle.check(*states["wrong"])
