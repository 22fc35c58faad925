"""AdamW scalars read from memory (``hyper_tensor``): ACCO's side-stream job selects them on the device.

Every backend given ``hyper_tensor=hyper_tensor(lr, ...)`` instead of the host settings computes the same step:
the CPU extension and the CUDA kernel body (CPU harness, launcher grid and an odd grid) bit for bit, for commit
and peek, noop 0/1, fp32/bf16/fp16 grads and outs, separate and in-place ``out``. The torch reference (and the
fallback, which shares its math) uses tensor arithmetic instead of Python numbers: the contract allows an ulp of
difference there, so it is checked within 1 ulp of the largest value (rtol 2e-6, atol max|x| * 2**-23); with
torch 2.13 on CPU it is in fact bit-identical. The host scalars are not even passed to the kernels (NaN in their
place), so a kernel that ignores the tensor fails every comparison. 100 steps under an LR schedule, each step's
scalars a row of a table (rows at an offset in memory), follow torch.optim.AdamW.
"""

from __future__ import annotations

import math

import pytest
import torch

from acco_ds.ops import adamw as adamw_mod
from acco_ds.ops.adamw import (
    adamw_step,
    adamw_step_cuda_body_on_cpu,
    adamw_step_ref,
    hyper_scalars,
    hyper_tensor,
)
from tests.ops.adamw_oracle import AdamWOracle, ulp_atol
from tests.ops.test_adamw import _forbid_host_reads, gen, poisoned, rand_state, require_cpu_ext

SETTINGS = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=7)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def harness(grid_dim: int):
    def run(*args, **kw):
        adamw_step_cuda_body_on_cpu(*args, grid_dim=grid_dim, **kw)

    return run


BACKENDS = {
    "cpu_ext": adamw_step,
    "cuda_body": harness(0),
    "cuda_body_grid3": harness(3),
    "ref": adamw_step_ref,
}
EXACT = {"cpu_ext", "cuda_body", "cuda_body_grid3"}


def odd_offset(h: torch.Tensor) -> torch.Tensor:
    """``h`` copied into a larger buffer at element offset 9: 4-byte aligned only, NaN around it."""
    buf = torch.full((24,), float("nan"))
    buf[9:17] = h
    return buf[9:17]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def test_hyper_tensor_is_hyper_scalars_in_fp32():
    for kw in (SETTINGS, dict(lr=3e-4, beta1=0.0, beta2=0.95, eps=1e-6, weight_decay=0.0, step=1),
               dict(lr=1.0, beta1=0.99, beta2=0.9999, eps=0.0, weight_decay=0.5, step=100_000)):  # fmt: skip
        h = hyper_tensor(**kw)
        assert h.dtype == torch.float32 and h.shape == (8,) and h.is_contiguous() and h.device.type == "cpu"
        want = torch.tensor(hyper_scalars(**kw), dtype=torch.float64).float()
        assert torch.equal(bits(h), bits(want))
        assert [float(x) for x in h] == [
            float(torch.tensor(x, dtype=torch.float32)) for x in hyper_scalars(**kw)
        ]
    assert hyper_tensor(**SETTINGS, device="meta").device.type == "meta"


@pytest.mark.parametrize(
    "change,msg",
    [
        (dict(step=0), "hyper_tensor: step must be an int >= 1"),
        (dict(step=2.0), "hyper_tensor: step must be an int >= 1"),
        (dict(beta2=1.0), r"hyper_tensor: beta2 must be in \[0, 1\)"),
        (dict(lr=-1.0), "hyper_tensor: lr must be finite and >= 0"),
        (dict(eps=math.inf), "hyper_tensor: eps must be finite and >= 0"),
        (dict(weight_decay=math.nan), "hyper_tensor: weight_decay must be finite and >= 0"),
    ],
)
def test_hyper_tensor_rejects_bad_settings(change, msg):
    with pytest.raises(ValueError, match=msg):
        hyper_tensor(**{**SETTINGS, **change})


OUTS = [  # (grad dtype, out dtype or None, out is grad)
    (torch.float32, torch.float32, False),
    (torch.float32, torch.bfloat16, False),
    (torch.bfloat16, torch.float32, False),
    (torch.bfloat16, torch.bfloat16, False),
    (torch.float32, torch.float32, True),
    (torch.bfloat16, torch.bfloat16, True),
    (torch.bfloat16, None, False),
    (torch.float32, torch.float16, False),
    (torch.float16, torch.float32, False),
    (torch.float16, torch.float16, True),
    (torch.float16, None, False),
]


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("n", [1, 7, 4099, 278011])
@pytest.mark.parametrize("gdtype,odtype,in_place", OUTS)
@pytest.mark.parametrize("commit", [True, False])
@pytest.mark.parametrize("noop", [0, 1])
def test_hyper_tensor_equals_host_scalars(backend, n, gdtype, odtype, in_place, commit, noop):
    if backend != "ref":
        require_cpu_ext()
    if odtype is None and not commit:
        pytest.skip("a peek needs out")
    fn = BACKENDS[backend]
    g = gen("hyper", n, gdtype, odtype, in_place, commit, noop)
    state = rand_state(n, g)
    grad = (torch.randn(n, generator=g) * 2).to(gdtype)
    common = dict(grad_scale=0.5, scale_tensor=torch.tensor([0.37]), commit=commit,
                  noop_flag=torch.tensor([noop], dtype=torch.int32))  # fmt: skip

    def call(**hp):
        st = [t.clone() for t in state]
        gr = grad.clone()
        out = gr if in_place else (None if odtype is None else poisoned(n, odtype))
        fn(*st, gr, out, **hp, **common)
        return st, out

    host_state, host_out = call(**SETTINGS)
    h = odd_offset(hyper_tensor(**SETTINGS))
    h_before = h.clone()
    dev_state, dev_out = call(hyper_tensor=h)
    assert torch.equal(bits(h), bits(h_before)), "hyper_tensor was written"
    if backend in EXACT:
        for a, b in zip(dev_state, host_state):
            assert torch.equal(bits(a), bits(b))
        if odtype is not None:
            assert torch.equal(bits(dev_out), bits(host_out))
    else:
        for a, b in zip(dev_state, host_state):
            torch.testing.assert_close(a, b, rtol=2e-6, atol=ulp_atol(b))
        if odtype is not None:
            tol = dict(rtol=2e-6, atol=ulp_atol(host_state[0]))
            tol = {
                torch.bfloat16: dict(rtol=8e-3, atol=0.0),
                torch.float16: dict(rtol=1e-3, atol=2.0**-24),
            }.get(odtype, tol)
            torch.testing.assert_close(dev_out.float(), host_out.float(), **tol)
    if noop or not commit:  # the state was not written
        for a, b in zip(dev_state, state):
            assert torch.equal(a, b)
    else:
        assert not torch.equal(dev_state[0], state[0]), "the commit did not move the parameters"


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("gdtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 4096, 278011])
def test_hyper_tensor_100_steps_match_torch_adamw(backend, n, gdtype):
    """A decaying LR; each step's scalars are row ``step - 1`` of one table (rows at 32-byte offsets)."""
    if backend != "ref":
        require_cpu_ext()
    elif n > 4096:
        pytest.skip("the reference is slow at this size; the compiled backends cover it")
    fn = BACKENDS[backend]
    wd, steps = 0.1, 100
    lrs = [1e-2 * (1.0 - s / (2 * steps)) for s in range(1, steps + 1)]
    table = torch.stack([hyper_tensor(lr, 0.9, 0.999, 1e-8, wd, s) for s, lr in enumerate(lrs, start=1)])
    g = gen("hyper100", n, gdtype)
    p0 = torch.randn(n, generator=g)
    master, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    oracle = AdamWOracle(p0, lr=lrs[0], betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    for step, lr in enumerate(lrs, start=1):
        grad = (torch.randn(n, generator=g) * 0.5).to(gdtype)
        oracle.step(grad, lr=lr)
        out = poisoned(n, torch.bfloat16)
        fn(master, m, v, grad, out, hyper_tensor=table[step - 1])
        assert torch.equal(out, master.to(torch.bfloat16)), f"bf16 out != cast(master) at step {step}"
    oracle.check(master, m, v)


def test_the_scalars_come_from_the_tensor():
    """Another tensor, another step: the result of the host call with those settings, not of any other."""
    require_cpu_ext()
    n = 1031
    state = rand_state(n, gen("which"))
    grad = torch.randn(n, generator=gen("which-g"))
    other = {**SETTINGS, "lr": 3e-3, "step": 2}
    for fn in (adamw_step, harness(0)):
        a, b, c = ([t.clone() for t in state] for _ in range(3))
        fn(*a, grad, hyper_tensor=hyper_tensor(**other))
        fn(*b, grad, **other)
        fn(*c, grad, **SETTINGS)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert not torch.equal(a[0], c[0])


@pytest.mark.parametrize("odtype", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("flag", [0, 1])
@pytest.mark.parametrize("commit", [True, False])
def test_fallback_never_reads_hyper_tensor_on_the_host(monkeypatch, odtype, flag, commit):
    """The torch fallback (CUDA tensors without the extension) validates and computes with hyper_tensor, noop
    flag and scale without one host read of a tensor value, and stays within an ulp of the host-scalar
    reference."""
    if odtype is None and not commit:
        pytest.skip("a peek needs out")
    n = 1031
    g = gen("hyper-fallback", odtype, flag, commit)
    state = rand_state(n, g)
    grad = torch.randn(n, generator=g).to(torch.bfloat16)
    common = dict(grad_scale=0.5, scale_tensor=torch.tensor([0.75]), commit=commit,
                  noop_flag=torch.tensor([flag], dtype=torch.int32))  # fmt: skip
    ref = [t.clone() for t in state]
    out_ref = None if odtype is None else poisoned(n, odtype)
    adamw_step_ref(*ref, grad, out_ref, **SETTINGS, **common)
    ours = [t.clone() for t in state]
    out = None if odtype is None else poisoned(n, odtype)
    h = hyper_tensor(**SETTINGS)
    a = adamw_mod._Step(*ours, grad, out, None, None, None, None, None, None, common["grad_scale"],
                        common["scale_tensor"], common["noop_flag"], commit, h)  # fmt: skip
    with monkeypatch.context() as mp:
        _forbid_host_reads(mp)
        adamw_mod._validate(a)
        adamw_mod._adamw_torch(a)
    for x, y in zip(ours, ref):
        torch.testing.assert_close(x, y, rtol=2e-6, atol=ulp_atol(y))
    if out is not None:  # one bf16 / fp16 rounding apart at most
        torch.testing.assert_close(out.float(), out_ref.float(), rtol=8e-3, atol=2.0**-24)
