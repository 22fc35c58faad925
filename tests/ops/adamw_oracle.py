"""The torch.optim.AdamW oracle shared by the fused AdamW tests (CPU extension, hyper tensor, CUDA).

:class:`AdamWOracle` runs ``torch.optim.AdamW`` in fp32 and in fp64 on the same start and gradients. The fp64 run
is the reference; an fp32 result (ours, or torch's own fp32 run) is judged by its error against it **in ulps**,
element by element: ``|x - x64| / ulp32(S)``, where ``S`` is the element's scale, the largest magnitude that the
element's value and the values it is computed from reached during the run in the fp64 reference (the parameter:
itself and each step's update ``p*(1 - lr*wd) - p_next``; ``exp_avg``: itself and the gradient; ``exp_avg_sq``:
itself), and ``ulp32(S)`` the fp32 spacing at ``S``. Rounding errors are made at that scale, so the measure does
not blow up where a value ends near zero by cancellation (``exp_avg`` at n = 1), which a ratio of two fp32 errors
(ours <= 2x torch's) did: it failed by chance at n = 1.

The bounds (:data:`ULP_BOUNDS`, the same for ours and for torch's fp32 AdamW, on CPU or CUDA) are fixed numbers for
100 steps of lr 1e-2, betas (0.9, 0.999), eps 1e-8, weight decay 0 or 0.1, gradients ~ N(0, 0.5^2) (fp32 or bf16):

- an envelope from the arithmetic: each step adds at most about 1.5 ulps of new rounding error to the parameter
  (the decay product, with the decay factor itself rounded to fp32: a systematic error of up to 0.5 ulp per step,
  most of the 35 below; the update's rounding; the subtraction) and to ``exp_avg_sq`` (the ``beta2`` product, the
  ``(1-beta2) g^2`` term, the sum), carried almost undamped over 100 steps (150 ulps at most), and at most
  0.75 ulp to ``exp_avg`` (``g - m``, the ``(1-beta1)`` product, the sum), damped by ``beta1`` each step
  (7.5 ulps at most). Fused multiply-adds (torch's CUDA lerp/addcmul/addcdiv) and products by a reciprocal
  (torch's CUDA division by a scalar) remove or move single roundings and stay inside it;
- the largest errors measured on CPU over about 10^5 elements (n = 1, 7, 4096 and 65536, many seeds, fp32 and
  bf16 gradients, both decays) for the CPU extension, the CUDA kernel body run by the CPU harness, the pure-torch
  fallback, torch's fp32 AdamW and an emulation of torch's CUDA arithmetic (:func:`torch_cuda_like_step`):
  parameter 35 ulps, ``exp_avg`` 0.7, ``exp_avg_sq`` 25.

The bounds sit about 2x above the measured maxima (a bound met by chance only would fail by chance elsewhere) and
below the envelope: parameter 64, ``exp_avg`` 2, ``exp_avg_sq`` 64. ``tests/ops/test_adamw_ulp_bounds.py`` validates
them on CPU; a wrong update (a dropped weight decay, an lr 0.1% off:
``test_a_wrong_update_breaks_the_bounds``) is far outside them.
"""

from __future__ import annotations

import math

import torch

ULP_BOUNDS = {"master": 64.0, "exp_avg": 2.0, "exp_avg_sq": 64.0}
NAMES = tuple(ULP_BOUNDS)


def ulp_atol(x: torch.Tensor) -> float:
    """One fp32 ulp of the largest magnitude in ``x``."""
    return float(x.abs().max()) * 2.0**-23


def ulp32(scale: torch.Tensor) -> torch.Tensor:
    """The fp32 spacing at each element of ``scale`` (fp64; the smallest normal's spacing below it)."""
    _, exp = torch.frexp(scale.double().clamp_min(2.0**-126))
    return torch.ldexp(torch.ones_like(scale, dtype=torch.float64), exp - 24)


def ulp_errors(x: torch.Tensor, ref64: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``|x - ref64|`` in fp32 ulps of ``scale``, element by element (fp64)."""
    return (x.double() - ref64).abs() / ulp32(scale)


class AdamWOracle:
    """torch.optim.AdamW in fp32 and fp64 from ``p0`` (fp32, any device), with each element's scale tracked in the
    fp64 run. Call :meth:`step` with each step's gradient (any float dtype; used as fp32 and fp64), then
    :meth:`check` on the result under test."""

    def __init__(self, p0: torch.Tensor, *, lr: float, betas, eps: float, weight_decay: float):
        self.p32 = torch.nn.Parameter(p0.detach().clone().float())
        self.p64 = torch.nn.Parameter(p0.detach().double())
        kw = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, foreach=False)
        self.opt32 = torch.optim.AdamW([self.p32], **kw)
        self.opt64 = torch.optim.AdamW([self.p64], **kw)
        zeros = torch.zeros_like(self.p64)
        self.scale = {"master": self.p64.detach().abs(), "exp_avg": zeros, "exp_avg_sq": zeros}

    def step(self, grad: torch.Tensor, lr: float | None = None) -> None:
        if lr is not None:
            for opt in (self.opt32, self.opt64):
                opt.param_groups[0]["lr"] = lr
        g = self.opt64.param_groups[0]
        self.p32.grad, self.p64.grad = (
            grad.float().reshape(self.p32.shape),
            grad.double().reshape(self.p64.shape),
        )
        before = self.p64.detach().clone()
        self.opt32.step()
        self.opt64.step()
        p, st = self.p64.detach(), self.opt64.state[self.p64]
        update = (before * (1.0 - g["lr"] * g["weight_decay"]) - p).abs()
        sc = self.scale
        sc["master"] = torch.maximum(sc["master"], torch.maximum(p.abs(), update))
        sc["exp_avg"] = torch.maximum(sc["exp_avg"], torch.maximum(st["exp_avg"].abs(), self.p64.grad.abs()))
        sc["exp_avg_sq"] = torch.maximum(sc["exp_avg_sq"], st["exp_avg_sq"])

    def reference(self) -> dict:
        st = self.opt64.state[self.p64]
        return {"master": self.p64.detach(), "exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"]}

    def torch32(self) -> dict:
        st = self.opt32.state[self.p32]
        return {"master": self.p32.detach(), "exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"]}

    def max_ulps(self, master, exp_avg, exp_avg_sq) -> dict:
        """The largest error in ulps per state tensor (:func:`ulp_errors` against the fp64 run)."""
        ref, ours = self.reference(), dict(master=master, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
        return {k: float(ulp_errors(ours[k].reshape(-1), ref[k].reshape(-1), self.scale[k].reshape(-1)).max())
                for k in NAMES}  # fmt: skip

    def check(self, master, exp_avg, exp_avg_sq, who: str = "ours") -> None:
        """``master``/``exp_avg``/``exp_avg_sq`` and torch's own fp32 run each within :data:`ULP_BOUNDS` of the fp64
        run, and element-wise close to torch's fp32 run (rtol 2e-5, atol 1e-6)."""
        t32 = self.torch32()
        for name, x in zip(NAMES, (master, exp_avg, exp_avg_sq)):
            torch.testing.assert_close(x.reshape(-1), t32[name].reshape(-1), rtol=2e-5, atol=1e-6)
        for label, got in (
            (who, self.max_ulps(master, exp_avg, exp_avg_sq)),
            ("torch fp32", self.max_ulps(**t32)),
        ):
            over = {k: e for k, e in got.items() if e > ULP_BOUNDS[k]}
            assert not over, f"{label}: error against fp64 in ulps {over} over the bounds {ULP_BOUNDS}"


def torch_cuda_like_step(p, m, v, grad, *, lr, beta1, beta2, eps, weight_decay, step) -> None:
    """torch's single-tensor CUDA AdamW arithmetic emulated on fp32 CPU tensors, in place: the decay product; lerp
    as ``fma(1-beta1, g - m, m)``; ``v*beta2`` then addcmul as ``fma((1-beta2)*g, g, v)``; the division by
    ``sqrt(bc2)`` as a product by its fp32 reciprocal; addcdiv as ``fma(-step_size, m / denom, p)``. An FMA is
    computed exactly in fp64 (an fp32 product is exact there) and rounded to fp32 once more (a double rounding that
    differs from a true FMA in rare ties only)."""

    def f32(x: float) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.float32)

    def fma(a, b, c):
        return (a.double() * b.double() + c.double()).float()

    g = grad.float()
    p.copy_(p * f32(1.0 - lr * weight_decay))
    m.copy_(fma(f32(1.0 - beta1).expand_as(m), g - m, m))
    v.copy_(v * f32(beta2))
    v.copy_(fma(f32(1.0 - beta2) * g, g, v))
    bc1, bc2 = 1.0 - beta1**step, 1.0 - beta2**step
    denom = v.sqrt() * f32(1.0 / math.sqrt(bc2)) + f32(eps)
    p.copy_(fma(f32(-(lr / bc1)).expand_as(p), m / denom, p))
