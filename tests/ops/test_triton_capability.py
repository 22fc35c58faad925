"""On a CUDA device whose compute capability is below the Triton kernels' lowest target
(``acco_ds.ops._build.TRITON_MIN_CAPABILITY``, sm_70) every op's default takes its torch form, and the reason is
logged once per process; at sm_70 (V100), sm_75 (T4) and above the ops take Triton.

The capability is mocked (``_build.cuda_capability``) and triton reported installed: nothing here touches a GPU or
``torch.cuda`` (the CUDA device is only a ``torch.device``, the tensors stand-ins with a ``device``)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from acco_ds.ops import (
    _build,
    accumulate,
    adamw_difference,
    fold_quantize,
    norm,
    quantize,
    quantized_sum_step,
)

CUDA = torch.device("cuda", 0)


@pytest.fixture
def capability(monkeypatch):
    """Sets the mocked compute capability of every CUDA device; fresh log-once state."""
    monkeypatch.setattr(_build, "triton_available", lambda: True)
    monkeypatch.setattr(_build, "_logged_capabilities", set())
    monkeypatch.setattr(_build, "_logged_choices", set())
    monkeypatch.setattr(quantize, "_logged", set())
    seen = []

    def set_to(cap):
        def fake(device):
            seen.append(device)
            return cap

        monkeypatch.setattr(_build, "cuda_capability", fake)
        return seen

    return set_to


def defaults_on_cuda() -> dict:
    """The default backend every op picks for CUDA tensors."""
    t = SimpleNamespace(device=CUDA, is_contiguous=lambda: True, numel=lambda: 0)  # an empty CUDA tensor
    step = SimpleNamespace(master=t, out=t)
    return {
        "accumulate": accumulate._pick("accumulate_grads", CUDA, None),
        "fold_quantize": fold_quantize._pick("fold_quantize", None, CUDA),
        "quantize": quantize._pick("quantize", None, 8, x=t),
        "norm": norm._pick(t, None),
        "adamw_difference": adamw_difference._pick(step, 8, 256, None),
        "quantized_sum_step": quantized_sum_step._pick("quantized_sum_of_squares", None, CUDA, {"q": t}, 256),
    }


TORCH_FORMS = {
    "accumulate": "ref",
    "fold_quantize": "ref",
    "quantize": "ref",
    "norm": "torch",
    "adamw_difference": "composed",
    "quantized_sum_step": "composed",
}


@pytest.mark.parametrize("cap", [(6, 1), (6, 0), (5, 2)], ids=lambda c: f"sm_{c[0]}{c[1]}")
def test_below_the_lowest_target_takes_the_torch_forms(capability, caplog, cap):
    seen = capability(cap)
    with caplog.at_level(logging.INFO):
        assert defaults_on_cuda() == TORCH_FORMS
        assert defaults_on_cuda() == TORCH_FORMS  # and again: no second capability line
    assert seen and all(d == CUDA for d in seen)
    lines = [r for r in caplog.records if "compute capability" in r.getMessage() and r.name == "acco_ds.ops"]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    msg = lines[0].getMessage()
    assert lines[0].levelno == logging.WARNING
    assert f"compute capability {cap[0]}.{cap[1]} is below sm_70" in msg and "torch form" in msg, msg


@pytest.mark.parametrize("cap", [(7, 0), (7, 5), (8, 0), (9, 0)], ids=lambda c: f"sm_{c[0]}{c[1]}")
def test_from_sm70_on_the_ops_take_triton(capability, caplog, cap):
    capability(cap)
    with caplog.at_level(logging.INFO):
        picks = defaults_on_cuda()
    assert picks == dict.fromkeys(TORCH_FORMS, "triton")
    assert not [r for r in caplog.records if "compute capability" in r.getMessage()]


def test_an_explicit_triton_backend_names_the_capability(capability):
    capability((6, 1))
    t = SimpleNamespace(device=CUDA)
    with pytest.raises(
        ValueError, match=r"backend='triton' cannot run: compute capability 6\.1 is below sm_70"
    ):
        quantize._pick("quantize", "triton", 8, x=t)


def test_the_lowest_target_is_what_the_compile_checks_cover():
    """tests/compile/test_cuda_compile.py compiles the Triton kernels for sm_70 and sm_75: the threshold is that."""
    assert _build.TRITON_MIN_CAPABILITY == (7, 0)
