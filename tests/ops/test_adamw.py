"""Fused AdamW (acco_ds.ops.adamw) on CPU: the CPU extension and the CUDA kernel body run by the CPU harness.

Oracles: torch.optim.AdamW (fp32 and fp64, 100 steps, element-wise) and adamw_step_ref. Outputs are poisoned
with NaN first so an unwritten element fails; inputs are fresh random values, never zeros.
"""

from __future__ import annotations

import logging
import shutil
import zlib

import pytest
import torch

from acco_ds.ops import _build
from acco_ds.ops.adamw import adamw_step, adamw_step_cuda_body_on_cpu, adamw_step_ref
from tests.ops.adamw_oracle import AdamWOracle, ulp_atol

HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)
SIZES = [1, 7, 4096, 278011]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HALF_TOL = {torch.bfloat16: dict(rtol=8e-3, atol=0.0), torch.float16: dict(rtol=1e-3, atol=2.0**-24)}


def require_cpu_ext():
    """The CPU extension must be there when a C++ compiler is (then a missing module is a failed build)."""
    if _build.load("adamw_cpu") is None:
        if shutil.which("g++") or shutil.which("c++"):
            pytest.fail(
                f"a C++ compiler is present but the CPU extension is missing: {_build.why_missing('adamw_cpu')}"
            )
        pytest.skip(f"no C++ compiler: {_build.why_missing('adamw_cpu')}")


def harness(grid_dim: int = 0):
    def run(*args, **kw):
        adamw_step_cuda_body_on_cpu(*args, grid_dim=grid_dim, **kw)

    return run


BACKENDS = {"cpu_ext": adamw_step, "cuda_body": harness(), "cuda_body_grid3": harness(3)}


@pytest.fixture(params=list(BACKENDS))
def step_fn(request):
    require_cpu_ext()
    return BACKENDS[request.param]


def gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def rand_state(n: int, g: torch.Generator):
    master = torch.randn(n, generator=g)
    m = torch.randn(n, generator=g) * 0.1
    v = torch.rand(n, generator=g) * 0.01 + 1e-4
    return master, m, v


def poisoned(n: int, dtype) -> torch.Tensor:
    return torch.full((n,), float("nan"), dtype=dtype)


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("gdtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_matches_torch_adamw_100_steps(step_fn, n, gdtype, wd):
    g = gen("adamw100", n, gdtype, wd)
    p0 = torch.randn(n, generator=g)
    master, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    oracle = AdamWOracle(p0, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"], weight_decay=wd)
    for step in range(1, 101):
        grad = (torch.randn(n, generator=g) * 0.5).to(gdtype)
        oracle.step(grad)
        out = poisoned(n, torch.bfloat16)
        step_fn(master, m, v, grad, out, weight_decay=wd, step=step, **HP)
        assert torch.equal(out, master.to(torch.bfloat16)), f"bf16 out != cast(master) at step {step}"
    oracle.check(master, m, v)


@pytest.mark.parametrize("odtype", DTYPES)
@pytest.mark.parametrize("gdtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 4099, 278011])
def test_single_step_vs_ref_with_scales(step_fn, n, gdtype, odtype):
    g = gen("vsref", n, gdtype, odtype)
    master, m, v = rand_state(n, g)
    grad = torch.randn(n, generator=g).to(gdtype)
    scale = torch.tensor([0.37])
    kw = dict(weight_decay=0.05, step=7, grad_scale=0.25, scale_tensor=scale, **HP)
    ref = [t.clone() for t in (master, m, v)]
    ref_out = poisoned(n, odtype)
    adamw_step_ref(*ref, grad, ref_out, **kw)
    out = poisoned(n, odtype)
    step_fn(master, m, v, grad, out, **kw)
    for ours, r in zip((master, m, v), ref):
        torch.testing.assert_close(ours, r, rtol=2e-6, atol=ulp_atol(r))
    assert torch.equal(out, master.to(odtype))
    # fp32: within an ulp of the largest value (as the state); bf16 / fp16: the same, rounded (1 ulp apart at most)
    tol = HALF_TOL.get(odtype) or dict(rtol=2e-6, atol=ulp_atol(ref[0]))
    torch.testing.assert_close(out.float(), ref_out.float(), **tol)


@pytest.mark.parametrize("odtype", DTYPES)
@pytest.mark.parametrize("gdtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 4096, 278011])
def test_peek_equals_commit_on_copy_and_leaves_state(step_fn, n, gdtype, odtype):
    g = gen("peek", n, gdtype, odtype)
    state = rand_state(n, g)
    grad = torch.randn(n, generator=g).to(gdtype)
    kw = dict(weight_decay=0.1, step=12, grad_scale=0.5, **HP)
    before = [t.clone() for t in state]
    peek_out = poisoned(n, odtype)
    step_fn(*state, grad, peek_out, commit=False, **kw)
    for t, b in zip(state, before):
        assert torch.equal(t, b), "peek modified the state"
    copy = [t.clone() for t in state]
    commit_out = poisoned(n, odtype)
    step_fn(*copy, grad, commit_out, commit=True, **kw)
    assert torch.equal(peek_out, commit_out), "peek != commit on a copy"
    assert not torch.equal(copy[0], before[0]), "the commit did not move the parameters"


@pytest.mark.parametrize("odtype", DTYPES)
def test_noop_flag(step_fn, odtype):
    n = 4099
    g = gen("noop", odtype)
    state = rand_state(n, g)
    grad = torch.randn(n, generator=g)
    before = [t.clone() for t in state]
    for commit in (True, False):
        out = poisoned(n, odtype)
        step_fn(*state, grad, out, step=3, weight_decay=0.1, noop_flag=torch.ones(1, dtype=torch.int32),
                commit=commit, **HP)  # fmt: skip
        for t, b in zip(state, before):
            assert torch.equal(t, b), "a noop step modified the state"
        assert torch.equal(out, before[0].to(odtype)), "noop out != cast(master)"
    # a zero flag is an ordinary step
    a, b = [t.clone() for t in state], [t.clone() for t in state]
    out_a, out_b = poisoned(n, odtype), poisoned(n, odtype)
    step_fn(*a, grad, out_a, step=3, weight_decay=0.1, noop_flag=torch.zeros(1, dtype=torch.int32), **HP)
    step_fn(*b, grad, out_b, step=3, weight_decay=0.1, **HP)
    assert torch.equal(out_a, out_b) and all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], before[0])


def test_scale_tensor_equals_grad_scale(step_fn):
    n = 1027
    g = gen("scale")
    state = rand_state(n, g)
    grad = torch.randn(n, generator=g).to(torch.bfloat16)
    a, b, c = ([t.clone() for t in state] for _ in range(3))
    step_fn(*a, grad, step=5, weight_decay=0.0, scale_tensor=torch.tensor([0.125]), **HP)
    step_fn(*b, grad, step=5, weight_decay=0.0, grad_scale=0.125, **HP)
    step_fn(*c, grad, step=5, weight_decay=0.0, **HP)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[1], c[1]), "the scale had no effect"


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_misaligned_slices_use_scalar_path(step_fn, half):
    """Shards at odd offsets of larger buffers (no vector alignment) give the same result as aligned ones."""
    n = 1031
    g = gen("misaligned", half)
    base = [torch.empty(n + 3) for _ in range(3)]
    aligned = rand_state(n, g)
    odd = [b[1 : n + 1] for b in base]
    for o, a in zip(odd, aligned):
        o.copy_(a)
    grad_buf = torch.empty(n + 1, dtype=half)
    grad_buf[1:] = torch.randn(n, generator=g)
    grad = grad_buf[1:]
    out_buf = poisoned(n + 1, half)
    out_a = poisoned(n, half)
    step_fn(*aligned, grad.clone(), out_a, step=2, weight_decay=0.1, **HP)
    step_fn(*odd, grad, out_buf[1:], step=2, weight_decay=0.1, **HP)
    assert torch.equal(out_buf[1:], out_a) and out_buf[0].isnan()
    assert all(torch.equal(o, a) for o, a in zip(odd, aligned))


def test_cpu_threads_do_not_change_results():
    require_cpu_ext()
    n = 300_007
    g = gen("threads")
    state = rand_state(n, g)
    grad = torch.randn(n, generator=g).to(torch.bfloat16)
    results = []
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            s = [t.clone() for t in state]
            out = poisoned(n, torch.bfloat16)
            adamw_step(*s, grad, out, step=4, weight_decay=0.1, **HP)
            results.append((s, out))
    finally:
        torch.set_num_threads(old)
    assert torch.equal(results[0][1], results[1][1])
    assert all(torch.equal(x, y) for x, y in zip(results[0][0], results[1][0]))


def test_ref_is_torch_adamw_single_step():
    """The reference itself: one step from zero state equals torch.optim.AdamW (same fp32 ops)."""
    n = 4096
    g = gen("ref")
    p0, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)
    p = torch.nn.Parameter(p0.clone())
    p.grad = grad.clone()
    torch.optim.AdamW([p], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"], weight_decay=0.1,
                      foreach=False).step()  # fmt: skip
    master, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    adamw_step_ref(master, m, v, grad, step=1, weight_decay=0.1, **HP)
    torch.testing.assert_close(master, p.detach(), rtol=1e-6, atol=ulp_atol(p0))


def test_fallback_when_extension_disabled(monkeypatch, caplog):
    monkeypatch.setenv(_build.DISABLE_ENV, "1")
    _build.reset_cache()
    monkeypatch.setattr("acco_ds.ops.adamw._logged_backends", set())
    try:
        n = 33
        g = gen("fallback")
        a = rand_state(n, g)
        b = [t.clone() for t in a]
        grad = torch.randn(n, generator=g)
        with caplog.at_level(logging.INFO, logger="acco_ds.ops.adamw"):
            adamw_step(*a, grad, step=1, weight_decay=0.0, **HP)
            adamw_step(*a, grad, step=2, weight_decay=0.0, **HP)
        adamw_step_ref(*b, grad, step=1, weight_decay=0.0, **HP)
        adamw_step_ref(*b, grad, step=2, weight_decay=0.0, **HP)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        msgs = [r.getMessage() for r in caplog.records if "torch reference" in r.getMessage()]
        assert len(msgs) == 1 and _build.DISABLE_ENV in msgs[0], msgs
    finally:
        monkeypatch.delenv(_build.DISABLE_ENV)
        _build.reset_cache()


# -- bad inputs --------------------------------------------------------------------------------------------
def _good(n=16):
    return dict(master=torch.randn(n), exp_avg=torch.randn(n), exp_avg_sq=torch.rand(n), grad=torch.randn(n),
                out=torch.empty(n, dtype=torch.bfloat16))  # fmt: skip


def _misaligned_fp32(n):
    raw = bytearray(4 * n + 4)
    return torch.frombuffer(raw, dtype=torch.float32, offset=1, count=n)


BAD = [
    ("master", lambda n: torch.randn(2 * n)[::2], ValueError, "master is not contiguous"),
    ("grad", lambda n: torch.randn(2 * n)[::2], ValueError, "grad is not contiguous"),
    ("exp_avg", lambda n: torch.randn(n, dtype=torch.float64), TypeError, "exp_avg has dtype torch.float64"),
    (
        "grad",
        lambda n: torch.randn(n, dtype=torch.float64),
        TypeError,
        "grad has dtype torch.float64; allowed: torch.float32, torch.bfloat16 or torch.float16",
    ),
    ("out", lambda n: torch.empty(n, dtype=torch.int16), TypeError, "out has dtype torch.int16"),
    ("exp_avg_sq", lambda n: torch.rand(n + 1), ValueError, "exp_avg_sq has 17 elements but master has 16"),
    ("grad", lambda n: torch.randn(n, device="meta"), ValueError, "grad is on meta but master is on cpu"),
    ("master", lambda n: torch.randn(n, 1), ValueError, "master must be 1-D"),
    ("grad", lambda n: [0.0] * n, TypeError, "grad must be a torch.Tensor"),
    ("exp_avg", _misaligned_fp32, ValueError, "exp_avg data pointer .* is not aligned"),
]


@pytest.mark.parametrize("fn", [adamw_step, adamw_step_ref])
@pytest.mark.parametrize("arg,make,exc,msg", BAD)
def test_bad_tensor_arguments(fn, arg, make, exc, msg):
    t = _good()
    t[arg] = make(16)
    with pytest.raises(exc, match=msg):
        fn(**t, step=1, weight_decay=0.0, **HP)


@pytest.mark.parametrize("fn", [adamw_step, adamw_step_ref])
@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(step=0), "step must be an int >= 1"),
        (dict(step=1.0), "step must be an int >= 1"),
        (dict(step=1, beta1=1.0), "beta1 must be in"),
        (dict(step=1, lr=float("nan")), "lr must be finite"),
        (dict(step=1, scale_tensor=torch.ones(2)), "scale_tensor must have exactly 1 element"),
        (dict(step=1, noop_flag=torch.zeros(1)), "noop_flag has dtype torch.float32"),
        (dict(step=1, out=None, commit=False), "out must be a tensor"),
    ],
)
def test_bad_scalar_arguments(fn, kw, msg):
    t = _good()
    hp = {**HP, "weight_decay": 0.0}
    if "out" in kw:
        t.pop("out")
    hp.update(kw)
    with pytest.raises(ValueError if "dtype" not in msg else TypeError, match=msg):
        fn(**t, **hp)


@pytest.mark.parametrize("commit", [True, False])
def test_buffers_must_not_overlap(commit):
    t = _good()
    t["out"] = t["exp_avg"]
    with pytest.raises(ValueError, match="exp_avg and out overlap"):
        adamw_step(**t, step=1, weight_decay=0.0, commit=commit, **HP)
    t = _good()
    big = torch.randn(40)
    t["master"], t["grad"] = big[:16], big[10:26]
    with pytest.raises(ValueError, match="master and grad overlap"):
        adamw_step(**t, step=1, weight_decay=0.0, commit=commit, **HP)


@pytest.mark.parametrize("odtype", DTYPES)
@pytest.mark.parametrize("gdtype", DTYPES)
def test_cpu_ext_and_cuda_body_are_bit_identical(gdtype, odtype):
    """Both compile adamw_math.h without FMA contraction: the same fp32 operations, the same bits."""
    require_cpu_ext()
    n = 278011
    g = gen("bitident", gdtype, odtype)
    state = rand_state(n, g)
    grad = torch.randn(n, generator=g).to(gdtype)
    kw = dict(step=9, weight_decay=0.1, grad_scale=0.5, scale_tensor=torch.tensor([0.3]), **HP)
    a, b = [t.clone() for t in state], [t.clone() for t in state]
    out_a, out_b = poisoned(n, odtype), poisoned(n, odtype)
    adamw_step(*a, grad, out_a, **kw)
    adamw_step_cuda_body_on_cpu(*b, grad, out_b, **kw)
    assert torch.equal(out_a, out_b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("odtype", DTYPES)
def test_large_shard_streaming_out(odtype):
    """n * out element size >= 16 MiB: the CPU launcher writes `out` with non-temporal stores."""
    require_cpu_ext()
    n = 8_388_619  # 16 MiB of bf16 and then some, odd
    g = gen("large", odtype)
    state = rand_state(n, g)
    grad = torch.randn(n, generator=g).to(torch.bfloat16)
    kw = dict(step=5, weight_decay=0.1, **HP)
    peek = poisoned(n, odtype)
    adamw_step(*state, grad, peek, commit=False, **kw)
    ref = [t.clone() for t in state]
    adamw_step_ref(*ref, grad, **kw)
    out = poisoned(n, odtype)
    adamw_step(*state, grad, out, **kw)
    assert torch.equal(out, state[0].to(odtype)) and torch.equal(peek, out)
    for ours, r in zip(state, ref):
        torch.testing.assert_close(ours, r, rtol=2e-6, atol=ulp_atol(r))


_ISA_SCRIPT = """
import sys, torch
import acco_ds._adamw_cpu as ext
from acco_ds.ops.accumulate import accumulate_grads, copy_flat
from acco_ds.ops.adamw import adamw_step

torch.set_num_threads(1)
g = torch.Generator().manual_seed(1234)
n = 100_003
res = {"isa": ext.ISA}
for gdt in (torch.float32, torch.bfloat16, torch.float16):
    for odt in (torch.float32, torch.bfloat16, torch.float16):
        for commit in (True, False):
            st = [torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1, torch.rand(n, generator=g) * 0.01]
            grad = torch.randn(n, generator=g).to(gdt)
            out = torch.full((n,), float("nan"), dtype=odt)
            adamw_step(*st, grad, out, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=7,
                       grad_scale=0.5, commit=commit)
            res[(gdt, odt, commit)] = (*st, out)
for bdt in (torch.float32, torch.bfloat16, torch.float16):
    buf = torch.randn(n, generator=g).to(bdt)
    accumulate_grads(buf, [torch.randn(n - 5, generator=g).to(torch.bfloat16)], [3], 0.37)
    accumulate_grads(buf, [torch.randn(n - 9, generator=g).to(torch.float16)], [7], 0.37)
    dst = torch.empty(n, dtype=bdt)
    copy_flat(dst, torch.randn(n, generator=g), 0.37)
    res[("acc", bdt)] = (buf, dst)
torch.save(res, sys.argv[1])
"""


def test_every_cpu_isa_variant_gives_the_same_bits(tmp_path):
    """The AVX-512, AVX2 and baseline loops (ACCO_DS_CPU_ISA picks a lower one) compute the same bits."""
    require_cpu_ext()
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = tmp_path / "isa.py"
    script.write_text(_ISA_SCRIPT)
    results = {}
    for isa in ("default", "avx2", "base"):
        env = {k: v for k, v in os.environ.items() if k != "ACCO_DS_CPU_ISA"}
        if isa != "default":
            env["ACCO_DS_CPU_ISA"] = isa
        env["PYTHONPATH"] = os.pathsep.join(x for x in (str(root), env.get("PYTHONPATH", "")) if x)
        path = tmp_path / f"{isa}.pt"
        r = subprocess.run([sys.executable, str(script), str(path)], env=env, cwd=root, capture_output=True,
                           text=True, timeout=300)  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        results[isa] = torch.load(path, weights_only=False)
    assert results["base"]["isa"] == "base"
    ref = results.pop("default")
    for res in results.values():
        for key, tensors in ref.items():
            if key == "isa":
                continue
            for a, b in zip(tensors, res[key]):
                assert torch.equal(a, b), f"{res['isa']} differs from {ref['isa']} for {key}"


# -- the torch fallback decides the noop flag on the device ------------------------------------------------
_HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


def _forbid_host_reads(monkeypatch):
    """Any host read of a tensor value (the syncs on CUDA) raises while the fallback runs."""

    def refuse(name):
        def read(self, *a, **k):
            raise AssertionError(f"the fallback read a tensor on the host (Tensor.{name})")

        return read

    for name in _HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, refuse(name))


@pytest.mark.parametrize("grad_nan", [False, True])
@pytest.mark.parametrize("flag", [0, 1])
@pytest.mark.parametrize("commit", [True, False])
@pytest.mark.parametrize("odtype", [None, *DTYPES])
@pytest.mark.parametrize("gdtype", DTYPES)
def test_fallback_noop_on_device_is_bit_identical_to_ref(monkeypatch, gdtype, odtype, commit, flag, grad_nan):
    from acco_ds.ops import adamw as adamw_mod

    if odtype is None and not commit:
        pytest.skip("a peek needs out")
    n = 1031
    g = gen("fallback-device", gdtype, odtype, commit, flag, grad_nan)
    state = rand_state(n, g)
    grad = torch.randn(n, generator=g).to(gdtype)
    if grad_nan:
        grad[5] = float("nan")
    kw = dict(step=7, weight_decay=0.1, grad_scale=0.5, commit=commit, **HP)
    kw["scale_tensor"] = torch.tensor([0.75])
    kw["noop_flag"] = torch.tensor([flag], dtype=torch.int32)
    ref = [t.clone() for t in state]
    out_ref = None if odtype is None else poisoned(n, odtype)
    adamw_step_ref(*ref, grad, out_ref, **kw)
    ours = [t.clone() for t in state]
    out = None if odtype is None else poisoned(n, odtype)
    a = adamw_mod._Step(*ours, grad, out, kw["lr"], kw["beta1"], kw["beta2"], kw["eps"], kw["weight_decay"],
                        kw["step"], kw["grad_scale"], kw["scale_tensor"], kw["noop_flag"], commit)  # fmt: skip
    with monkeypatch.context() as m:
        _forbid_host_reads(m)
        adamw_mod._adamw_torch(a)
    for x, y in zip(ours, ref):
        assert torch.equal(x.view(torch.int32), y.view(torch.int32))  # bits, NaN payloads included
    if out is not None:
        raw = torch.int32 if odtype == torch.float32 else torch.int16
        assert torch.equal(out.view(raw), out_ref.view(raw))
    if flag:
        assert all(torch.equal(x, s) for x, s in zip(ours, state)), "a noop step changed the state"


def test_ref_reads_the_flag_on_the_host(monkeypatch):
    """The guard of the test above is real: the host-reading oracle trips it."""
    n = 8
    state = rand_state(n, gen("guard"))
    with monkeypatch.context() as m:
        _forbid_host_reads(m)
        with pytest.raises(AssertionError, match="read a tensor on the host"):
            adamw_step_ref(*state, torch.randn(n), step=1, weight_decay=0.0,
                           noop_flag=torch.zeros(1, dtype=torch.int32), **HP)  # fmt: skip


def test_cuda_fallback_warns_loudly_once(monkeypatch, caplog):
    from acco_ds.ops import adamw as adamw_mod

    monkeypatch.setattr(adamw_mod, "_logged_backends", set())
    with caplog.at_level(logging.WARNING, logger="acco_ds.ops.adamw"):
        with pytest.warns(RuntimeWarning, match="CUDA extension is missing"):
            adamw_mod._log_backend_once("cuda", "the torch reference", "no module")
        adamw_mod._log_backend_once("cuda", "the torch reference", "no module")
    msgs = [r.getMessage() for r in caplog.records if "CUDA tensors take" in r.getMessage()]
    assert len(msgs) == 1 and "build_ext" in msgs[0]


def test_no_kernel_for_the_gpu_takes_the_torch_form_once_warned(monkeypatch, caplog):
    """A CUDA module built without this GPU's architecture (a V100 and a CUDA 13 nvcc, which cannot target sm_70)
    refuses the launch with cudaErrorNoKernelImageForDevice: the step runs in torch (the reference's bits), with
    one warning for the device, and later calls on it go straight to torch; any other launch error propagates.
    The launch is a stand-in and the tensors CPU ones: no GPU is touched."""
    from acco_ds.ops import adamw as adamw_mod

    monkeypatch.setattr(adamw_mod, "_no_kernel_image", set())
    gpu = torch.device("cuda", 0)
    calls = []

    def refused():
        calls.append(1)
        raise RuntimeError("acco_ds adamw_cuda launch failed: cudaErrorNoKernelImageForDevice: no kernel image is "
                           "available for execution on the device")  # fmt: skip

    n = 1031
    g = gen("no-image")
    state = rand_state(n, g)
    grad = torch.randn(n, generator=g).to(torch.float16)
    kw = dict(step=3, weight_decay=0.1, **HP)
    ref = [t.clone() for t in state]
    out_ref = poisoned(n, torch.float16)
    adamw_step_ref(*ref, grad, out_ref, **kw)
    ours = [t.clone() for t in state]
    out = poisoned(n, torch.float16)
    a = adamw_mod._bind("adamw_step", *ours, grad, out, kw)
    with caplog.at_level(logging.WARNING), pytest.warns(RuntimeWarning, match="no kernel for this GPU"):
        adamw_mod._launch_or_torch(gpu, refused, a)
    assert calls == [1] and all(torch.equal(x, y) for x, y in zip(ours, ref)) and torch.equal(out, out_ref)
    adamw_mod._launch_or_torch(gpu, refused, adamw_mod._bind("adamw_step", *ours, grad, out, kw))
    assert calls == [1], "a second launch on the device"
    assert sum("no kernel for this GPU" in r.getMessage() for r in caplog.records) == 1

    def broken():
        raise RuntimeError("acco_ds adamw_cuda launch failed: cudaErrorInvalidValue: invalid argument")

    with pytest.raises(RuntimeError, match="cudaErrorInvalidValue"):
        adamw_mod._launch_or_torch(torch.device("cuda", 1), broken, a)
