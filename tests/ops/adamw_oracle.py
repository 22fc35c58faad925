"""The torch.optim.AdamW oracle shared by the fused AdamW tests (CPU extension, hyper tensor, CUDA)."""

from __future__ import annotations

import torch


def ulp_atol(x: torch.Tensor) -> float:
    """One fp32 ulp of the largest magnitude in ``x``."""
    return float(x.abs().max()) * 2.0**-23


def assert_matches_torch_adamw(master, m, v, opt32, p32, opt64, p64) -> None:
    """Our ``master``, ``m``, ``v`` after the run against torch's AdamW run in fp32 (``opt32`` on ``p32``) and
    fp64 (``opt64`` on ``p64``): element-wise close to fp32 torch (rtol 2e-5, atol 1e-6), and our error against
    fp64 at most 2x torch's own fp32 error (+1 ulp of slack)."""
    st32, st64 = opt32.state[p32], opt64.state[p64]
    for ours, t32, t64 in ((master, p32.detach(), p64.detach()), (m, st32["exp_avg"], st64["exp_avg"]),
                           (v, st32["exp_avg_sq"], st64["exp_avg_sq"])):  # fmt: skip
        # element-wise against torch in fp32 ...
        torch.testing.assert_close(ours, t32, rtol=2e-5, atol=1e-6)
        # ... and our error at most 2x torch's own fp32 error against fp64 (+1 ulp of slack).
        err_ours = (ours.double() - t64).abs().max().item()
        err_torch = (t32.double() - t64).abs().max().item()
        assert err_ours <= 2 * err_torch + ulp_atol(t64), (err_ours, err_torch)
