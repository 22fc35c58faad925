"""Bad inputs to the kernels' Python entry points raise a clear error before any launch, never a
crash or silent corruption.

Each row of the tables breaks one argument of an otherwise valid call (non-contiguous, misaligned,
wrong dtype, wrong device, size mismatch, overlapping buffers, bad scalars; a bad ``hyper_tensor``, or the
AdamW settings and ``hyper_tensor`` both or neither given). The test checks the
exception type, that the message names the argument, and that no buffer was written: every tensor
the call could write is compared bit for bit with its copy taken before the call (``out`` is
poisoned first). Entry points: ``adamw_step`` (the CPU extension when built, else the torch
reference), ``adamw_step_ref``, the CPU harness of the CUDA kernel body when built, and
``accumulate_grads`` / ``accumulate_flat`` / ``copy_flat`` on the ``ref`` and ``cpp`` backends.
Inputs that are legal but awkward for vector code (slices at odd element offsets, odd sizes) must
give the reference's result and leave the neighbouring memory untouched.
"""

from __future__ import annotations

import math

import pytest
import torch

from acco_ds.ops import _build, adamw
from acco_ds.ops import accumulate as acc

N = 1001  # odd: no vector width divides it
POISON = 12345.0

ADAMW_FNS = {"adamw_step": adamw.adamw_step, "adamw_step_ref": adamw.adamw_step_ref}
if _build.available("adamw_cpu") and hasattr(adamw, "adamw_step_cuda_body_on_cpu"):
    ADAMW_FNS["cuda_body_on_cpu"] = adamw.adamw_step_cuda_body_on_cpu
ACC_BACKENDS = ["ref"] + (["cpp"] if _build.available("accumulate_cpu") else [])


def misaligned(n: int, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor whose data pointer is one byte off its element alignment."""
    size = torch.empty((), dtype=dtype).element_size()
    t = torch.frombuffer(bytearray(size * (n + 1)), dtype=dtype, count=n, offset=1)
    assert t.data_ptr() % size == 1 % size
    return t


def strided(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(2 * n).to(dtype)[::2]


def adamw_args() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "master": torch.randn(N, generator=g),
        "exp_avg": torch.randn(N, generator=g) * 0.1,
        "exp_avg_sq": torch.rand(N, generator=g) * 0.1,
        "grad": torch.randn(N, generator=g),
        "out": torch.full((N,), POISON),
        "lr": 1e-3,
        "beta1": 0.9,
        "beta2": 0.999,
        "eps": 1e-8,
        "weight_decay": 0.01,
        "step": 3,
        "scale_tensor": torch.tensor([0.5]),
        "noop_flag": torch.zeros(1, dtype=torch.int32),
        "commit": True,
    }


def _set(key, value):
    def change(a):
        a[key] = value(a) if callable(value) else value

    return change


# name: (change, exception type, text the message must contain)
ADAMW_ROWS = {
    "master_non_contiguous": (
        _set("master", lambda a: strided(N, torch.float32)),
        ValueError,
        "master is not contiguous",
    ),
    "grad_non_contiguous": (
        _set("grad", lambda a: strided(N, torch.float32)),
        ValueError,
        "grad is not contiguous",
    ),
    "out_non_contiguous": (
        _set("out", lambda a: strided(N, torch.bfloat16)),
        ValueError,
        "out is not contiguous",
    ),
    "exp_avg_misaligned": (
        _set("exp_avg", lambda a: misaligned(N, torch.float32)),
        ValueError,
        "exp_avg data pointer",
    ),
    "grad_misaligned_bf16": (
        _set("grad", lambda a: misaligned(N, torch.bfloat16)),
        ValueError,
        "grad data pointer",
    ),
    "out_misaligned": (_set("out", lambda a: misaligned(N, torch.float32)), ValueError, "out data pointer"),
    "master_bf16": (
        _set("master", lambda a: a["master"].bfloat16()),
        TypeError,
        "master has dtype torch.bfloat16",
    ),
    "exp_avg_sq_float64": (
        _set("exp_avg_sq", lambda a: a["exp_avg_sq"].double()),
        TypeError,
        "exp_avg_sq has dtype torch.float64",
    ),
    "grad_float64": (
        _set("grad", lambda a: a["grad"].double()),
        TypeError,
        "grad has dtype torch.float64; allowed: torch.float32, torch.bfloat16 or torch.float16",
    ),
    "out_int32": (
        _set("out", lambda a: torch.zeros(N, dtype=torch.int32)),
        TypeError,
        "out has dtype torch.int32",
    ),
    "grad_on_meta": (_set("grad", lambda a: torch.empty(N, device="meta")), ValueError, "grad is on meta"),
    "master_on_meta": (
        _set("master", lambda a: torch.empty(N, device="meta")),
        ValueError,
        "master is on meta",
    ),
    "exp_avg_short": (
        _set("exp_avg", lambda a: a["exp_avg"][:-1].clone()),
        ValueError,
        "exp_avg has 1000 elements",
    ),
    "grad_long": (_set("grad", lambda a: torch.randn(N + 1)), ValueError, "grad has 1002 elements"),
    "out_short": (_set("out", lambda a: torch.zeros(N - 7)), ValueError, "out has 994 elements"),
    "master_2d": (
        _set("master", lambda a: a["master"][:1000].reshape(10, 100)),
        ValueError,
        "master must be 1-D",
    ),
    "out_aliases_master": (_set("out", lambda a: a["master"]), ValueError, "overlap"),
    "grad_aliases_exp_avg": (_set("grad", lambda a: a["exp_avg"]), ValueError, "overlap"),
    "noop_flag_float": (_set("noop_flag", torch.zeros(1)), TypeError, "noop_flag has dtype torch.float32"),
    "noop_flag_two_elements": (
        _set("noop_flag", torch.zeros(2, dtype=torch.int32)),
        ValueError,
        "noop_flag must have exactly 1 element",
    ),
    "scale_tensor_float64": (
        _set("scale_tensor", torch.ones(1, dtype=torch.float64)),
        TypeError,
        "scale_tensor has dtype torch.float64",
    ),
    "peek_without_out": (lambda a: a.update(out=None, commit=False), ValueError, "out must be a tensor"),
    "grad_not_a_tensor": (_set("grad", [0.0] * N), TypeError, "grad must be a torch.Tensor"),
    "step_zero": (_set("step", 0), ValueError, "step must be an int >= 1"),
    "step_bool": (_set("step", True), ValueError, "step must be an int >= 1"),
    "beta1_one": (_set("beta1", 1.0), ValueError, "beta1 must be in [0, 1)"),
    "lr_nan": (_set("lr", math.nan), ValueError, "lr must be finite"),
    "eps_negative": (_set("eps", -1e-8), ValueError, "eps must be finite and >= 0"),
}

SETTINGS = ("lr", "beta1", "beta2", "eps", "weight_decay", "step")


def _hyper(value, keep=()):
    """The AdamW scalars as ``hyper_tensor`` (``value(a)``) instead of the settings, but those in ``keep``."""

    def change(a):
        h = adamw.hyper_tensor(*(a[k] for k in SETTINGS))
        for k in SETTINGS:
            if k not in keep:
                del a[k]
        a["hyper_tensor"] = value(a, h) if callable(value) else value

    return change


def _drop(*keys):
    def change(a):
        for k in keys:
            del a[k]

    return change


ADAMW_ROWS.update(
    {
        "hyper_tensor_float64": (
            _hyper(lambda a, h: h.double()),
            TypeError,
            "hyper_tensor has dtype torch.float64",
        ),
        "hyper_tensor_bf16": (_hyper(lambda a, h: h.bfloat16()), TypeError, "hyper_tensor has dtype"),
        "hyper_tensor_seven": (
            _hyper(lambda a, h: h[:7].clone()),
            ValueError,
            "hyper_tensor must have exactly 8 elements",
        ),
        "hyper_tensor_nine": (
            _hyper(lambda a, h: torch.cat([h, h[:1]])),
            ValueError,
            "hyper_tensor must have exactly 8 elements",
        ),
        "hyper_tensor_on_meta": (
            _hyper(lambda a, h: h.to("meta")),
            ValueError,
            "hyper_tensor is on meta but master is on cpu",
        ),
        "hyper_tensor_non_contiguous": (
            _hyper(lambda a, h: torch.stack([h, h], dim=1)[:, 0]),
            ValueError,
            "hyper_tensor is not contiguous",
        ),
        "hyper_tensor_misaligned": (
            _hyper(lambda a, h: misaligned(8, torch.float32).copy_(h)),
            ValueError,
            "hyper_tensor data pointer",
        ),
        "hyper_tensor_not_a_tensor": (
            _hyper(lambda a, h: h.tolist()),
            TypeError,
            "hyper_tensor must be a torch.Tensor",
        ),
        "hyper_tensor_in_out": (
            _hyper(lambda a, h: a["out"][8:16]),
            ValueError,
            "out and hyper_tensor overlap",
        ),
        "hyper_tensor_and_settings": (
            _hyper(lambda a, h: h, keep=SETTINGS),
            ValueError,
            "give either the AdamW settings (lr, beta1, beta2, eps, weight_decay, step) or hyper_tensor, not "
            "both; got hyper_tensor and lr, beta1, beta2, eps, weight_decay, step",
        ),
        "hyper_tensor_and_step": (
            _hyper(lambda a, h: h, keep=("step",)),
            ValueError,
            "not both; got hyper_tensor and step",
        ),
        "neither_settings_nor_hyper_tensor": (
            _drop(*SETTINGS),
            ValueError,
            "lr, beta1, beta2, eps, weight_decay, step are required",
        ),
        "step_missing": (_drop("step"), ValueError, "step is required"),
    }
)

WRITABLE = ("master", "exp_avg", "exp_avg_sq", "out")


def _snapshot(a: dict) -> dict:
    return {
        k: a[k].clone() for k in WRITABLE if isinstance(a.get(k), torch.Tensor) and a[k].device.type == "cpu"
    }


def _unchanged(a: dict, saved: dict) -> None:
    for k, before in saved.items():
        assert torch.equal(a[k], before), f"{k} was written although the call was rejected"


@pytest.mark.parametrize("fn", list(ADAMW_FNS))
@pytest.mark.parametrize("row", list(ADAMW_ROWS))
def test_adamw_rejects_before_launch(fn, row):
    change, exc, text = ADAMW_ROWS[row]
    a = adamw_args()
    change(a)
    saved = _snapshot(a)
    tensors = {k: a.pop(k) for k in ("master", "exp_avg", "exp_avg_sq", "grad")}
    with pytest.raises(exc) as info:
        ADAMW_FNS[fn](*tensors.values(), **a)
    assert text in str(info.value), str(info.value)
    _unchanged({**tensors, **a}, saved)


@pytest.mark.parametrize("fn", [k for k in ADAMW_FNS if k != "adamw_step_ref"])
@pytest.mark.parametrize("offset", [1, 3, 7])
@pytest.mark.parametrize("commit", [True, False])
def test_adamw_odd_offsets_match_reference(fn, offset, commit):
    """Slices starting at odd element offsets (16-byte vectors misaligned) with an odd size: the
    kernel equals the reference and writes nothing outside the slices."""
    n, pad = 2 * N + 1, 16

    def buffers():
        g = torch.Generator().manual_seed(1)
        base = {
            "master": torch.randn(n + 2 * pad, generator=g),
            "exp_avg": torch.randn(n + 2 * pad, generator=g) * 0.1,
            "exp_avg_sq": torch.rand(n + 2 * pad, generator=g) * 0.1,
            "grad": torch.randn(n + 2 * pad, generator=g).bfloat16(),
            "out": torch.full((n + 2 * pad,), POISON).bfloat16(),
        }
        views = {k: v[pad + offset : pad + offset + n] for k, v in base.items()}
        return base, views

    kw = {
        "lr": 1e-2,
        "beta1": 0.9,
        "beta2": 0.99,
        "eps": 1e-8,
        "weight_decay": 0.1,
        "step": 5,
        "commit": commit,
    }
    got_base, got = buffers()
    want_base, want = buffers()
    before = {k: v.clone() for k, v in got_base.items()}
    ADAMW_FNS[fn](*(got[k] for k in ("master", "exp_avg", "exp_avg_sq", "grad")), got["out"], **kw)
    adamw.adamw_step_ref(*(want[k] for k in ("master", "exp_avg", "exp_avg_sq", "grad")), want["out"], **kw)
    for k in got:
        inside = slice(pad + offset, pad + offset + n)
        torch.testing.assert_close(
            got_base[k][inside].float(), want_base[k][inside].float(), rtol=1e-5, atol=1e-6
        )
        outside = torch.ones(n + 2 * pad, dtype=torch.bool)
        outside[inside] = False
        assert torch.equal(got_base[k][outside], before[k][outside]), f"{k} written outside its slice"
    assert not (got["out"].float() == POISON).any(), "out not fully written"


# -- accumulate ----------------------------------------------------------------------------------------
def acc_args() -> dict:
    g = torch.Generator().manual_seed(2)
    return {
        "buffer": torch.randn(3 * N, generator=g),
        "grads": [torch.randn(N, generator=g), torch.randn(7, 11, generator=g).bfloat16()],
        "offsets": [0, N + 5],
    }


def _grad(i, value):
    def change(a):
        a["grads"][i] = value(a) if callable(value) else value

    return change


ACC_ROWS = {
    "buffer_non_contiguous": (
        lambda a: a.update(buffer=torch.randn(6 * N)[::2]),
        ValueError,
        "buffer is not contiguous",
    ),
    "buffer_2d": (lambda a: a.update(buffer=torch.randn(3, N)), ValueError, "buffer must be 1-D"),
    "buffer_float64": (
        lambda a: a.update(buffer=a["buffer"].double()),
        TypeError,
        "buffer has dtype torch.float64; allowed: torch.float32, torch.bfloat16 or torch.float16",
    ),
    "buffer_misaligned": (
        lambda a: a.update(buffer=misaligned(3 * N, torch.float32)),
        ValueError,
        "buffer data pointer",
    ),
    "grad_float64": (
        _grad(0, lambda a: a["grads"][0].double()),
        TypeError,
        "grads[0] has dtype torch.float64",
    ),
    "grad_int64": (_grad(1, torch.ones(77, dtype=torch.int64)), TypeError, "grads[1] has dtype torch.int64"),
    "grad_transposed": (_grad(1, lambda a: torch.randn(11, 7).t()), ValueError, "grads[1] is not contiguous"),
    "grad_misaligned": (
        _grad(0, lambda a: misaligned(N, torch.float32)),
        ValueError,
        "grads[0] data pointer",
    ),
    "grad_on_meta": (_grad(1, torch.empty(77, device="meta")), ValueError, "grads[1] is on meta"),
    "grad_past_the_end": (lambda a: a.update(offsets=[0, 3 * N - 10]), ValueError, "does not fit"),
    "negative_offset": (lambda a: a.update(offsets=[-1, N + 5]), ValueError, "does not fit"),
    "offsets_count": (lambda a: a.update(offsets=[0]), ValueError, "2 grads but 1 offsets"),
    "grad_not_a_tensor": (_grad(0, [1.0, 2.0]), TypeError, "grads[0] must be a torch.Tensor"),
}


@pytest.mark.parametrize("backend", ACC_BACKENDS)
@pytest.mark.parametrize("row", list(ACC_ROWS))
def test_accumulate_rejects_before_launch(backend, row):
    change, exc, text = ACC_ROWS[row]
    a = acc_args()
    change(a)
    before = a["buffer"].clone() if a["buffer"].device.type == "cpu" else None
    with pytest.raises(exc) as info:
        acc.accumulate_grads(a["buffer"], a["grads"], a["offsets"], 0.5, backend=backend)
    assert text in str(info.value), str(info.value)
    if before is not None:
        assert torch.equal(a["buffer"], before), "buffer written although the call was rejected"


FLAT_ROWS = {
    "size_mismatch": (lambda: (torch.zeros(N), torch.ones(N + 1)), ValueError, "sizes differ"),
    "src_float64": (
        lambda: (torch.zeros(N), torch.ones(N, dtype=torch.float64)),
        TypeError,
        "dtype torch.float64",
    ),
    "src_non_contiguous": (lambda: (torch.zeros(N), strided(N, torch.float32)), ValueError, "not contiguous"),
    "src_misaligned": (lambda: (torch.zeros(N), misaligned(N, torch.bfloat16)), ValueError, "data pointer"),
    "src_on_meta": (lambda: (torch.zeros(N), torch.empty(N, device="meta")), ValueError, "is on meta"),
}


@pytest.mark.parametrize("fn", ["accumulate_flat", "copy_flat"])
@pytest.mark.parametrize("backend", ACC_BACKENDS)
@pytest.mark.parametrize("row", list(FLAT_ROWS))
def test_flat_ops_reject_before_launch(fn, backend, row):
    make, exc, text = FLAT_ROWS[row]
    dst, src = make()
    before = dst.clone()
    with pytest.raises(exc) as info:
        getattr(acc, fn)(dst, src, 2.0, backend=backend)
    assert text in str(info.value), str(info.value)
    assert torch.equal(dst, before)


@pytest.mark.parametrize("backend", ACC_BACKENDS)
@pytest.mark.parametrize("offset", [1, 5, 17])
def test_accumulate_odd_offsets_match_reference(backend, offset):
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(N, generator=g), torch.randn(13, 7, generator=g).bfloat16(), None,
             torch.randn(5, 11, generator=g).half()]  # fmt: skip
    offsets = [offset, offset + N + 3, 0, offset + N + 100]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        buf = torch.randn(2 * N + 200, generator=g).to(dtype)
        want = buf.clone()
        acc.accumulate_grads(buf, grads, offsets, 0.25, backend=backend)
        acc.accumulate_grads_ref(want, grads, offsets, 0.25)
        assert torch.equal(buf, want), f"{backend} {dtype}: differs from the reference"
