"""``acco_ds.ops.adamw_difference.adamw_step_difference``: the fused CPU pass and the Triton kernel (under the
interpreter) (AdamW step + quantized parameter difference + its application) give, bit for bit, the composition adamw_step -> quantize_difference ->
add_dequantized: master, both moments, the new parameters (base + dequantized difference), q and the scales, for
commit, peek and noop, fp32, bf16 and fp16 parameters and gradients, block sizes from 1 to longer than a work item,
lengths that blocks do not divide, base = out (in place), out = grad (the round job's in-place buffer), a
non-finite step (a NaN scale, base + NaN), several threads. Bad arguments are refused naming them."""

from __future__ import annotations

import os

import pytest
import torch

from acco_ds.ops import _build
from acco_ds.ops.adamw import hyper_tensor
from acco_ds.ops.adamw_difference import adamw_step_difference
from tests.ops.triton_interpreter import run_interpreted

pytestmark = pytest.mark.skipif(not _build.available("adamw_cpu"), reason="the CPU extension is not built")

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3)


def _state(n: int, pdt, gdt, seed: int, bad: bool = False):
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g)
    m, v = torch.randn(n, generator=g) * 0.01, torch.rand(n, generator=g) * 0.01
    grad = torch.randn(n, generator=g)
    if bad and n > 3:
        grad[n // 2] = float("inf")
    # what the replicas hold: the master a few steps ago, so the difference has zeros and small values
    base = (master + torch.randn(n, generator=g) * 1e-2 * (torch.rand(n, generator=g) < 0.5)).to(pdt)
    return master, m, v, grad.to(gdt), base


def _run(backend, state, pdt, bs, commit, noop, layout, **kw):
    master, m, v, grad, base = (t.clone() for t in state)
    if layout == "base_is_out":
        out = base
    elif layout == "out_is_grad":
        out = grad
    else:
        out = torch.full_like(base, 7.0)
    q, s = adamw_step_difference(
        master, m, v, grad, out, base, bs, backend=backend,
        hyper_tensor=hyper_tensor(**HYPER, device=master.device),
        scale_tensor=torch.tensor([0.5], device=master.device),
        noop_flag=torch.tensor([int(noop)], dtype=torch.int32, device=master.device), commit=commit, **kw,
    )  # fmt: skip
    return {"master": master, "exp_avg": m, "exp_avg_sq": v, "out": out, "q": q, "scales": s}


def _assert_bits(a: dict, b: dict, what) -> None:
    for k in a:
        x, y = a[k], b[k]
        assert x.dtype == y.dtype and x.shape == y.shape, (k, what)
        same = torch.equal(x.view(torch.int8), y.view(torch.int8)) if x.numel() else True
        assert same, f"{k} differs: {what}"


CASES = [(n, bs) for n in (0, 1, 7, 255, 1000) for bs in (1, 7, 256, 4096)] + [
    (70_001, 256),
    (70_001, 100_000),
]


# out is grad only where their dtypes match (the round job's in-place buffer)
DTYPES_AND_LAYOUTS = [
    (gdt, pdt, layout)
    for gdt in (F32, BF16, F16)
    for pdt in (F32, BF16, F16)
    for layout in ("separate", "base_is_out", "out_is_grad")
    if layout != "out_is_grad" or gdt == pdt
]


@pytest.mark.parametrize("mode", ["commit", "peek", "noop"])
@pytest.mark.parametrize(
    ("gdt", "pdt", "layout"),
    DTYPES_AND_LAYOUTS,
    ids=[f"g_{str(g)[6:]}-p_{str(p)[6:]}-{lay}" for g, p, lay in DTYPES_AND_LAYOUTS],
)
def test_fused_is_the_composition_bit_for_bit(gdt, pdt, layout, mode):
    for n, bs in CASES:
        for bad in (False, True):
            state = _state(n, pdt, gdt, seed=n + bs, bad=bad)
            args = (pdt, bs, mode != "peek", mode == "noop", layout)
            fused, composed = _run("fused", state, *args), _run("composed", state, *args)
            _assert_bits(fused, composed, (n, bs, bad))
            if n >= 255 and not bad:
                assert (fused["q"] != 0).any(), (n, bs)  # a difference was sent, not only zeros


def test_threads_split_on_block_boundaries():
    """Work items of whole blocks over several threads: the same bits as one thread."""
    state = _state(300_007, BF16, BF16, seed=5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run("fused", state, BF16, 384, True, False, "separate")
        torch.set_num_threads(2)
        two = _run("fused", state, BF16, 384, True, False, "separate")
    finally:
        torch.set_num_threads(before)
    _assert_bits(one, two, "threads")
    _assert_bits(one, _run("composed", state, BF16, 384, True, False, "separate"), "composed")


def test_bad_arguments_are_refused():
    master, m, v, grad, base = _state(64, BF16, F32, seed=1)
    kw = dict(hyper_tensor=hyper_tensor(**HYPER))
    out = torch.empty(64, dtype=BF16)
    with pytest.raises(ValueError, match="out .* is required"):
        adamw_step_difference(master, m, v, grad, None, base, 16, **kw)
    with pytest.raises(ValueError, match="base must have out's dtype"):
        adamw_step_difference(master, m, v, grad, out, base.float(), 16, **kw)
    with pytest.raises(ValueError, match="base overlaps master"):
        adamw_step_difference(master, m, v, grad, torch.empty(64), master, 16, **kw)
    with pytest.raises(ValueError, match="block_size"):
        adamw_step_difference(master, m, v, grad, out, base, 0, **kw)
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        adamw_step_difference(master, m, v, grad, out, base, 16, bits=2, **kw)
    with pytest.raises(ValueError, match="backend='fused' cannot run: it quantizes to 8 bits"):
        adamw_step_difference(master, m, v, grad, out, base, 16, bits=4, backend="fused", **kw)
    with pytest.raises(ValueError, match="backend must be one of"):
        adamw_step_difference(master, m, v, grad, out, base, 16, backend="cpp", **kw)
    with pytest.raises(TypeError, match="unexpected keyword argument 'lrr'"):
        adamw_step_difference(master, m, v, grad, out, base, 16, lrr=1.0)


def test_four_bits_take_the_composition():
    state = _state(1000, BF16, BF16, seed=3)
    got = _run(None, state, BF16, 256, True, False, "separate")  # auto: 8 bits only are fused
    assert got["q"].abs().max() <= 127
    master, m, v, grad, base = (t.clone() for t in state)
    out = torch.empty_like(base)
    q, _ = adamw_step_difference(
        master, m, v, grad, out, base, 256, bits=4, hyper_tensor=hyper_tensor(**HYPER)
    )
    assert q.abs().max() <= 7


# the Triton backend under the interpreter: small lengths (it runs each program in Python), blocks of 1 to 1024
INTERPRETER_CASES = [(0, 256), (1, 16), (300, 7), (1000, 256), (2100, 1024)]


def _interpret_checks() -> int:
    """The Triton kernel against the composition, bit for bit (run with TRITON_INTERPRET=1)."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    count = 0
    for gdt, pdt, layout in DTYPES_AND_LAYOUTS:
        for mode in ("commit", "peek", "noop"):
            for n, bs in INTERPRETER_CASES:
                for bits in (8, 4):
                    bad = n % 2 == 0
                    state = _state(n, pdt, gdt, seed=n + bs, bad=bad)
                    args = (pdt, bs, mode != "peek", mode == "noop", layout)
                    kw = dict(bits=bits)
                    got, want = _run("triton", state, *args, **kw), _run("composed", state, *args, **kw)
                    _assert_bits(got, want, (gdt, pdt, layout, mode, n, bs, bits, bad))
                    count += 1
    # the settings form and no gradient scale or noop flag
    master, m, v, grad, base = _state(777, BF16, BF16, seed=9)
    outs = []
    for backend in ("triton", "composed"):
        state = [t.clone() for t in (master, m, v, grad, base)]
        out = torch.empty_like(base)
        q, s = adamw_step_difference(*state[:4], out, state[4], 256, backend=backend, **HYPER)
        outs.append(
            {"master": state[0], "exp_avg": state[1], "exp_avg_sq": state[2], "out": out, "q": q, "s": s}
        )
    _assert_bits(outs[0], outs[1], "settings form")
    return count + 1


def test_triton_kernel_under_interpreter():
    """Runs :func:`_interpret_checks` in a subprocess with TRITON_INTERPRET=1 (set before triton is imported)."""
    code = "from tests.ops.test_adamw_difference import _interpret_checks as c; print('triton checks:', c())"
    out = run_interpreted(code, timeout=1800)
    want = len(DTYPES_AND_LAYOUTS) * 3 * len(INTERPRETER_CASES) * 2 + 1
    assert f"triton checks: {want}" in out, out[-2000:]


def test_triton_backend_states_why_it_cannot_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    master, m, v, grad, base = _state(64, BF16, F32, seed=1)
    out = torch.empty(64, dtype=BF16)
    with pytest.raises(ValueError, match="backend='triton' cannot run: CPU tensors need TRITON_INTERPRET=1"):
        adamw_step_difference(master, m, v, grad, out, base, 16, backend="triton", **HYPER)
    with pytest.raises(ValueError, match="blocks of at most 1024 elements, got block_size=2048"):
        adamw_step_difference(master, m, v, grad, out, base, 2048, backend="triton", **HYPER)
