"""GPU checks of the kernels (CUDA AdamW extension, Triton accumulate); skipped without a CUDA GPU.

The same checks as the CPU tests on CUDA tensors, plus: the CUDA result is bit-identical to the CPU harness
of the same kernel body (both compiled without FMA contraction), the kernel runs on the current stream, the
noop flag and the scale are read on the device. ``torch.cuda.is_available()`` does not initialise CUDA, so
collecting this file on a CPU machine touches no GPU state.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from acco_ds.ops import _build
from acco_ds.ops.accumulate import accumulate_grads, accumulate_grads_ref, copy_flat, copy_flat_ref
from acco_ds.ops.adamw import adamw_step, adamw_step_cuda_body_on_cpu, adamw_step_ref, hyper_tensor
from tests.ops.adamw_oracle import AdamWOracle, ulp_atol

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [1, 7, 4096, 278011, 10_000_019]


def gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def cuda_ext():
    ext = _build.load("cuda")
    if ext is None:
        pytest.fail(f"a GPU is present but the CUDA extension is missing: {_build.why_missing('cuda')}")
    return ext


def rand_state(n, g, device="cuda"):
    master = torch.randn(n, generator=g)
    m = torch.randn(n, generator=g) * 0.1
    v = torch.rand(n, generator=g) * 0.01 + 1e-4
    return [t.to(device) for t in (master, m, v)]


def poisoned(n, dtype, device="cuda"):
    return torch.full((n,), float("nan"), dtype=dtype, device=device)


@pytest.mark.parametrize("hyper", [False, True])
@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("gdtype", DTYPES)
@pytest.mark.parametrize("n", SIZES[:4])
def test_cuda_matches_torch_adamw_100_steps(n, gdtype, wd, hyper):
    """Ours and torch's CUDA AdamW each within fixed ulp bounds of torch's fp64 AdamW after 100 steps
    (tests/ops/adamw_oracle.py; the bounds are validated on CPU by tests/ops/test_adamw_ulp_bounds.py).
    hyper=True: each step's scalars from a device tensor (hyper_tensor) instead of the host settings."""
    cuda_ext()
    g = gen("gpu100", n, gdtype, wd)
    p0 = torch.randn(n, generator=g).cuda()
    master, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    oracle = AdamWOracle(p0, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"], weight_decay=wd)
    for step in range(1, 101):
        grad = (torch.randn(n, generator=g) * 0.5).to(gdtype).cuda()
        oracle.step(grad)  # torch's CUDA AdamW (fp32 and fp64) on the same gradients
        out = poisoned(n, torch.bfloat16)
        if hyper:
            h = hyper_tensor(weight_decay=wd, step=step, device="cuda", **HP)
            adamw_step(master, m, v, grad, out, hyper_tensor=h)
        else:
            adamw_step(master, m, v, grad, out, weight_decay=wd, step=step, **HP)
        assert torch.equal(out, master.to(torch.bfloat16))
    oracle.check(master, m, v)


@pytest.mark.parametrize("commit", [True, False])
@pytest.mark.parametrize("odtype", DTYPES)
@pytest.mark.parametrize("gdtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_cuda_bit_identical_to_cpu_harness(n, gdtype, odtype, commit):
    cuda_ext()
    g = gen("gpu-harness", n, gdtype, odtype)
    cpu_state = rand_state(n, g, "cpu")
    grad = torch.randn(n, generator=g).to(gdtype)
    kw = dict(step=11, weight_decay=0.1, grad_scale=0.5, commit=commit, **HP)
    gpu_state = [t.cuda() for t in cpu_state]
    out_gpu = poisoned(n, odtype)
    adamw_step(*gpu_state, grad.cuda(), out_gpu, scale_tensor=torch.tensor([0.3], device="cuda"), **kw)
    out_cpu = poisoned(n, odtype, "cpu")
    if n <= 278011:
        adamw_step_cuda_body_on_cpu(*cpu_state, grad, out_cpu, scale_tensor=torch.tensor([0.3]), **kw)
    else:  # the single-threaded harness is slow at 10M; the CPU extension gives the same bits (CPU tests)
        adamw_step(*cpu_state, grad, out_cpu, scale_tensor=torch.tensor([0.3]), **kw)
    assert torch.equal(out_gpu.cpu(), out_cpu)
    assert all(torch.equal(x.cpu(), y) for x, y in zip(gpu_state, cpu_state))


@pytest.mark.parametrize("odtype", DTYPES)
@pytest.mark.parametrize("n", [7, 278011])
def test_cuda_peek_equals_commit_and_leaves_state(n, odtype):
    cuda_ext()
    g = gen("gpu-peek", n, odtype)
    state = rand_state(n, g)
    grad = torch.randn(n, generator=g).to(torch.bfloat16).cuda()
    before = [t.clone() for t in state]
    peek = poisoned(n, odtype)
    adamw_step(*state, grad, peek, step=4, weight_decay=0.1, commit=False, **HP)
    assert all(torch.equal(t, b) for t, b in zip(state, before))
    commit = poisoned(n, odtype)
    adamw_step(*state, grad, commit, step=4, weight_decay=0.1, **HP)
    assert torch.equal(peek, commit)


def test_cuda_noop_and_scale_read_on_device():
    cuda_ext()
    n = 4099
    g = gen("gpu-noop")
    state = rand_state(n, g)
    grad = torch.randn(n, generator=g).cuda()
    before = [t.clone() for t in state]
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    flag.fill_(1)  # set on the device, never read by the host
    out = poisoned(n, torch.bfloat16)
    adamw_step(*state, grad, out, step=2, weight_decay=0.1, noop_flag=flag, **HP)
    assert all(torch.equal(t, b) for t, b in zip(state, before))
    assert torch.equal(out, before[0].to(torch.bfloat16))
    a = [t.clone() for t in state]
    b = [t.clone() for t in state]
    adamw_step(*a, grad, step=2, weight_decay=0.0, scale_tensor=torch.full((1,), 0.25, device="cuda"), **HP)
    adamw_step(*b, grad, step=2, weight_decay=0.0, grad_scale=0.25, **HP)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_cuda_kernel_runs_on_the_current_stream():
    """On a side stream: sleep, then write master, then step. Run on any other stream, the kernel would read
    master before the write and the result would differ from the reference."""
    cuda_ext()
    n = 1 << 20
    g = gen("gpu-stream")
    state = rand_state(n, g)
    new_master = torch.randn(n, generator=g).cuda()
    grad = torch.randn(n, generator=g).cuda()
    ref = [new_master.clone(), state[1].clone(), state[2].clone()]
    adamw_step_ref(*ref, grad, step=3, weight_decay=0.1, **HP)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    out = poisoned(n, torch.float32)
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on this stream only
        state[0].copy_(new_master)
        adamw_step(*state, grad, out, step=3, weight_decay=0.1, **HP)
    side.synchronize()
    torch.testing.assert_close(state[0], ref[0], rtol=2e-6, atol=ulp_atol(ref[0]))
    assert torch.equal(out, state[0])


def test_cuda_misaligned_shards_use_the_scalar_path():
    cuda_ext()
    n = 100_003
    g = gen("gpu-misaligned")
    aligned = rand_state(n, g)
    odd = [torch.empty(n + 1, device="cuda")[1:] for _ in range(3)]
    for o, a in zip(odd, aligned):
        o.copy_(a)
    grad = torch.randn(n, generator=g).to(torch.bfloat16).cuda()
    gbuf = torch.empty(n + 1, dtype=torch.bfloat16, device="cuda")
    gbuf[1:] = grad
    out_a, obuf = poisoned(n, torch.bfloat16), poisoned(n + 1, torch.bfloat16)
    adamw_step(*aligned, grad, out_a, step=2, weight_decay=0.1, **HP)
    adamw_step(*odd, gbuf[1:], obuf[1:], step=2, weight_decay=0.1, **HP)
    assert torch.equal(obuf[1:], out_a) and all(torch.equal(o, a) for o, a in zip(odd, aligned))


SETTINGS = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


def _selected_hyper(step: int) -> torch.Tensor:
    """The scalars of ``step`` picked on the device from a table of candidates (steps 1..5), as ACCO's job does:
    the index is a device tensor, the row a device view at an offset."""
    table = torch.stack([hyper_tensor(**SETTINGS, step=s) for s in range(1, 6)]).cuda()
    index = torch.zeros(1, dtype=torch.int64, device="cuda")
    index.fill_(step - 1)  # set on the device
    return table.index_select(0, index)[0]


@pytest.mark.parametrize("noop", [0, 1])
@pytest.mark.parametrize("commit", [True, False])
@pytest.mark.parametrize("odtype", DTYPES)
@pytest.mark.parametrize("gdtype", DTYPES)
@pytest.mark.parametrize("n", [7, 278011])
def test_cuda_hyper_tensor_bit_identical_to_host_scalars_and_harness(n, gdtype, odtype, commit, noop):
    """hyper_tensor read on the device: the bits of the host-scalar launch and of the CPU harness given the same
    tensor; the launch does not synchronise the host."""
    cuda_ext()
    g = gen("gpu-hyper", n, gdtype, odtype, commit, noop)
    cpu_state = rand_state(n, g, "cpu")
    grad = torch.randn(n, generator=g).to(gdtype)
    kw = dict(grad_scale=0.5, commit=commit)
    flag = torch.full((1,), noop, dtype=torch.int32)
    scale = torch.tensor([0.3])
    host_state = [t.cuda() for t in cpu_state]
    out_host = poisoned(n, odtype)
    adamw_step(*host_state, grad.cuda(), out_host, step=4, scale_tensor=scale.cuda(), noop_flag=flag.cuda(),
               **SETTINGS, **kw)  # fmt: skip
    dev_state = [t.cuda() for t in cpu_state]
    out_dev, grad_dev, scale_dev, flag_dev = poisoned(n, odtype), grad.cuda(), scale.cuda(), flag.cuda()
    h = _selected_hyper(4)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        adamw_step(
            *dev_state, grad_dev, out_dev, hyper_tensor=h, scale_tensor=scale_dev, noop_flag=flag_dev, **kw
        )
    finally:
        torch.cuda.set_sync_debug_mode(0)
    out_cpu = poisoned(n, odtype, "cpu")
    adamw_step_cuda_body_on_cpu(*cpu_state, grad, out_cpu, hyper_tensor=h.cpu(), scale_tensor=scale,
                                noop_flag=flag, **kw)  # fmt: skip
    assert torch.equal(out_dev, out_host) and all(torch.equal(x, y) for x, y in zip(dev_state, host_state))
    assert torch.equal(out_dev.cpu(), out_cpu) and all(
        torch.equal(x.cpu(), y) for x, y in zip(dev_state, cpu_state)
    )


def test_cuda_hyper_tensor_fallback_no_host_sync(monkeypatch):
    """Without the CUDA extension, hyper_tensor on the device: tensor arithmetic, no host sync, within an ulp of
    the host-scalar reference (torch's CUDA addcdiv rounds value * (t1 / t2))."""
    from acco_ds.ops import adamw as adamw_mod

    monkeypatch.setenv(_build.DISABLE_ENV, "1")
    monkeypatch.setattr(adamw_mod, "_logged_backends", set())
    _build.reset_cache()
    try:
        n = 40_001
        g = gen("gpu-hyper-fallback")
        state = rand_state(n, g)
        grad = torch.randn(n, generator=g).to(torch.bfloat16).cuda()
        with pytest.warns(RuntimeWarning, match="CUDA extension is missing"):
            adamw_step(*[t.clone() for t in state], grad, step=1, **SETTINGS)
        ours, ref = [t.clone() for t in state], [t.clone() for t in state]
        out, out_ref = poisoned(n, torch.bfloat16), poisoned(n, torch.bfloat16)
        flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        h = _selected_hyper(3)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            adamw_step(*ours, grad, out, hyper_tensor=h, noop_flag=flag)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        adamw_step_ref(*ref, grad, out_ref, step=3, noop_flag=flag, **SETTINGS)
        for x, y in zip(ours, ref):
            torch.testing.assert_close(x, y, rtol=2e-6, atol=ulp_atol(y))
        torch.testing.assert_close(out.float(), out_ref.float(), rtol=8e-3, atol=0.0)
    finally:
        monkeypatch.delenv(_build.DISABLE_ENV)
        _build.reset_cache()


@pytest.mark.parametrize("scale", [1.0, 0.37])
@pytest.mark.parametrize("gdtype", DTYPES)
@pytest.mark.parametrize("bdtype", DTYPES)
@pytest.mark.parametrize("aligned", [True, False])
def test_triton_accumulate_on_gpu(bdtype, gdtype, scale, aligned):
    pytest.importorskip("triton")
    g = gen("gpu-acc", bdtype, gdtype, scale, aligned)
    sizes = [1, 7, 278011, 64, 1_000_003, 16384 * 3]
    offsets, off = [], 0 if aligned else 5
    for s in sizes:
        offsets.append(off)
        off += (s + 7) // 8 * 8 if aligned else s + 3
    buffer = (torch.rand(off, generator=g) * 0.2 - 0.1).to(bdtype).cuda()
    grads = [(torch.rand(s, generator=g) + 0.5).to(gdtype).cuda() for s in sizes]
    ref, ours = buffer.clone(), buffer.clone()
    accumulate_grads_ref(ref, grads, offsets, scale)
    accumulate_grads(ours, grads, offsets, scale)  # default backend on CUDA: triton
    # launched with enable_fp_fusion=False: x + g*scale rounds twice, as the reference: the same bits
    assert torch.equal(ours, ref)
    dst, dst_ref = poisoned(grads[2].numel(), bdtype), poisoned(grads[2].numel(), bdtype)
    copy_flat(dst, grads[2], scale)
    copy_flat_ref(dst_ref, grads[2], scale)
    assert torch.equal(dst, dst_ref)


def _to_cuda_keep_alignment(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the GPU at the same address residue mod 16 (a misaligned CPU slice stays misaligned)."""
    shift = (t.data_ptr() % 16) // t.element_size()
    base = torch.empty(t.numel() + shift, dtype=t.dtype, device="cuda")
    base[shift:] = t.cuda()
    return base[shift:]


def test_triton_mixed_alignment_no_host_sync():
    """Aligned and unaligned gradients in one call: the same bits as the reference; the first call (chunk tables
    built and uploaded) does not synchronise the host, and the tables' host copies are pinned."""
    pytest.importorskip("triton")
    from acco_ds.ops import accumulate
    from tests.ops.test_accumulate import mixed_alignment_case

    def case(seed):
        buffer, grads, offsets, vector = mixed_alignment_case(gen("gpu-mixed", seed))
        return buffer.cuda(), [_to_cuda_keep_alignment(g) for g in grads], offsets, vector

    buffer, grads, offsets, vector = case(0)
    assert {i for _, a, ids in accumulate.launch_plan(buffer, grads, offsets) if a for i in ids} == vector
    warm = case(1)
    accumulate_grads(warm[0], warm[1], warm[2], 0.37)  # compiles the kernel variants
    ref, ours = buffer.clone(), buffer.clone()
    accumulate_grads_ref(ref, grads, offsets, 0.37)
    accumulate._clear_table_cache()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        accumulate_grads(ours, grads, offsets, 0.37)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(ours, ref)
    entries = list(accumulate._table_cache.values())
    assert len(entries) == 4 and all(host.is_pinned() and dev.is_cuda for host, dev in entries)


def test_triton_table_cache_is_per_stream():
    pytest.importorskip("triton")
    from acco_ds.ops import accumulate

    g = gen("gpu-stream-table")
    buffer = torch.zeros(4096, device="cuda")
    grad = torch.randn(4096, generator=g).cuda()
    accumulate._clear_table_cache()
    accumulate_grads(buffer, [grad], [0], 1.0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        accumulate_grads(buffer, [grad], [0], 1.0)
    torch.cuda.current_stream().wait_stream(side)
    assert len(accumulate._table_cache) == 2
    torch.testing.assert_close(buffer, 2 * grad, rtol=0, atol=0)


def test_cuda_fallback_decides_noop_on_device(monkeypatch):
    """Without the CUDA extension: a loud warning once, the reference's bits, and no host sync (noop flag set
    on the device, decided there)."""
    from acco_ds.ops import adamw as adamw_mod

    monkeypatch.setenv(_build.DISABLE_ENV, "1")
    monkeypatch.setattr(adamw_mod, "_logged_backends", set())
    _build.reset_cache()
    try:
        n = 40_001
        g = gen("gpu-fallback")
        state = rand_state(n, g)
        grad = torch.randn(n, generator=g).to(torch.bfloat16).cuda()
        with pytest.warns(RuntimeWarning, match="CUDA extension is missing"):
            adamw_step(*[t.clone() for t in state], grad, step=1, weight_decay=0.1, **HP)
        for flag_value in (0, 1):
            flag = torch.zeros(1, dtype=torch.int32, device="cuda")
            flag.fill_(flag_value)
            ours, ref = [t.clone() for t in state], [t.clone() for t in state]
            out, out_ref = poisoned(n, torch.bfloat16), poisoned(n, torch.bfloat16)
            kw = dict(
                step=5, weight_decay=0.1, noop_flag=flag, scale_tensor=torch.full((1,), 0.5, device="cuda")
            )
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                adamw_step(*ours, grad, out, **kw, **HP)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            adamw_step_ref(*ref, grad, out_ref, **kw, **HP)
            assert torch.equal(out, out_ref) and all(torch.equal(x, y) for x, y in zip(ours, ref))
    finally:
        monkeypatch.delenv(_build.DISABLE_ENV)
        _build.reset_cache()


def test_fp16_conversions_on_gpu_have_torch_cpu_bits():
    """The Triton cast (copy_flat's kernel) and the CUDA AdamW's (its noop step stores cast(master)) turn every probe
    of tests/ops/test_fp16_conversion.py into torch's CPU fp16 bits on the GPU too (NaN payloads included: integer
    operations, not the device's cvt), and fp16 -> fp32 back exactly."""
    from tests.ops.test_fp16_conversion import all_fp16, assert_bits, edge_values, fp16_to_f32_expected

    pytest.importorskip("triton")
    x = edge_values()
    want = x.to(torch.float16)
    half = poisoned(x.numel(), torch.float16)
    copy_flat(half, x.cuda(), 1.0, backend="triton")
    assert_bits(half.cpu(), want, x, "triton fp32 -> fp16 on the GPU")
    h = all_fp16()
    single = poisoned(h.numel(), torch.float32)
    copy_flat(single, h.cuda(), 1.0, backend="triton")
    assert_bits(
        single.cpu(), fp16_to_f32_expected(h).view(torch.float32), h, "triton fp16 -> fp32 on the GPU"
    )
    cuda_ext()
    zeros = torch.zeros(x.numel(), device="cuda")
    out = poisoned(x.numel(), torch.float16)
    adamw_step(x.cuda(), zeros.clone(), zeros.clone(), torch.zeros(x.numel(), dtype=torch.float16, device="cuda"),
               out, step=1, weight_decay=0.0, noop_flag=torch.ones(1, dtype=torch.int32, device="cuda"), **HP)  # fmt: skip
    assert_bits(out.cpu(), want, x, "CUDA AdamW fp32 -> fp16")
