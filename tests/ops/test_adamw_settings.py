"""The AdamW settings type (acco_ds.ops.adamw_settings) against the kernels' ABI and torch's form.

- ``KERNEL_FIELDS`` is the field list of ``AdamWHyper`` in csrc/adamw/adamw_math.h (read from the header, so
  this runs without a build) and of every built AdamW module (``HYPER_FIELDS``, with ``HYPER_OFFSETS`` the
  packed fp32 layout the hyper_tensor and the by-value scalars rely on);
- ``hyper_scalars`` gives each named scalar its formula (a reordered tuple is caught by name);
- torch's form (param groups, ``torch.optim.AdamW`` arguments) converts both ways, and the field names are
  the keys checkpoints store.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import re
from pathlib import Path

import pytest
import torch

from acco_ds.config import ACCOConfig
from acco_ds.ops import _build
from acco_ds.ops.adamw import hyper_tensor
from acco_ds.ops.adamw_settings import KERNEL_FIELDS, SETTING_FIELDS, TORCH_KEYS, AdamWSettings

HEADER = Path(__file__).resolve().parents[2] / "csrc" / "adamw" / "adamw_math.h"


def header_fields() -> tuple:
    """The X(name) entries of the ACCO_ADAMW_HYPER_FIELDS macro, in order."""
    text = HEADER.read_text()
    m = re.search(r"#define ACCO_ADAMW_HYPER_FIELDS\(X\)((?:[^\n]*\\\n)*[^\n]*\n)", text)
    assert m, f"ACCO_ADAMW_HYPER_FIELDS not found in {HEADER}"
    return tuple(re.findall(r"\bX\((\w+)\)", m.group(1)))


def test_kernel_fields_are_the_header_struct():
    assert header_fields() == KERNEL_FIELDS


@pytest.mark.parametrize("kind", ["adamw_cpu", "adamw_cuda"])
def test_kernel_fields_are_the_built_modules_struct(kind):
    """The module itself (imported directly: the CUDA one loads without a driver, _build would refuse it)."""
    try:
        mod = importlib.import_module(_build._MODULES[kind])
    except ImportError as e:
        pytest.skip(f"{_build._MODULES[kind]} is not built: {e}")
    assert tuple(mod.HYPER_FIELDS) == KERNEL_FIELDS
    assert tuple(mod.HYPER_OFFSETS) == tuple(4 * i for i in range(len(KERNEL_FIELDS)))


def test_hyper_scalars_by_name():
    s = AdamWSettings(lr=3e-3, beta1=0.85, beta2=0.995, eps=1e-7, weight_decay=0.05)
    step = 7
    k = dict(zip(KERNEL_FIELDS, s.hyper_scalars(step), strict=True))
    assert k == {
        "decay": 1.0 - 3e-3 * 0.05,
        "beta1": 0.85,
        "one_minus_beta1": 1.0 - 0.85,
        "beta2": 0.995,
        "one_minus_beta2": 1.0 - 0.995,
        "bc2_sqrt": math.sqrt(1.0 - 0.995**step),
        "eps": 1e-7,
        "step_size": 3e-3 / (1.0 - 0.85**step),
    }
    h = hyper_tensor(*dataclasses.astuple(s), step)
    assert torch.equal(h, torch.tensor(s.hyper_scalars(step), dtype=torch.float64).float())


def test_torch_form_round_trip():
    s = AdamWSettings.from_torch(1e-3, [0.9, 0.999], 1e-8, 0.01)
    assert s == AdamWSettings(1e-3, 0.9, 0.999, 1e-8, 0.01) and s.betas == (0.9, 0.999)
    assert tuple(s.torch_kwargs()) == TORCH_KEYS
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], **s.torch_kwargs())
    assert AdamWSettings.from_param_group(opt.param_groups[0]) == s
    assert tuple(dataclasses.asdict(s)) == SETTING_FIELDS == ("lr", "beta1", "beta2", "eps", "weight_decay")


def test_config_settings():
    cfg = ACCOConfig(lr=2e-4, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0)
    assert cfg.adamw_settings() == AdamWSettings(2e-4, 0.8, 0.99, 1e-6, 0.0)


@pytest.mark.parametrize(
    "change,step,msg",
    [
        ({}, 0, "step must be an int >= 1"),
        ({"beta1": 1.0}, 1, r"beta1 must be in \[0, 1\)"),
        ({"eps": -1.0}, 1, "eps must be finite and >= 0"),
        ({"weight_decay": math.nan}, 1, "weight_decay must be finite and >= 0"),
    ],
)
def test_check_names_the_bad_setting(change, step, msg):
    s = dataclasses.replace(AdamWSettings(1e-3, 0.9, 0.999, 1e-8, 0.0), **change)
    with pytest.raises(ValueError, match=f"who: {msg}"):
        s.check("who", step)
