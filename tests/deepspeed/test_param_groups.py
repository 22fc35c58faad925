"""acco_ds.deepspeed.param_groups.ParamGroupHolder: the param groups, defaults and state of
``torch.optim.AdamW`` over the same tensors, built without importing ``torch._dynamo`` (checked in a fresh
interpreter: this one has imported it long ago)."""

from __future__ import annotations

import subprocess
import sys

import torch

from acco_ds.deepspeed.param_groups import ParamGroupHolder
from tests.ranks.launch import REPO


def _groups():
    a, b = torch.zeros(7), torch.zeros(3)
    return [
        {"params": [a], "lr": 1e-3, "weight_decay": 0.1},
        {"params": [b], "lr": 2e-3, "betas": (0.8, 0.9)},
    ]


def test_same_groups_and_defaults_as_adamw():
    groups = _groups()
    held, plain = ParamGroupHolder(groups), torch.optim.AdamW(groups)
    assert isinstance(held, torch.optim.AdamW)
    assert held.defaults == plain.defaults
    assert len(held.param_groups) == len(plain.param_groups) == 2
    for h, p in zip(held.param_groups, plain.param_groups):
        assert {k: v for k, v in h.items() if k != "params"} == {k: v for k, v in p.items() if k != "params"}
        assert [id(t) for t in h["params"]] == [id(t) for t in p["params"]]
    held.add_param_group({"params": [torch.zeros(2)], "lr": 5e-4})
    assert held.param_groups[-1]["lr"] == 5e-4 and held.param_groups[-1]["eps"] == plain.defaults["eps"]
    assert held.state_dict()["param_groups"][0]["lr"] == 1e-3


def test_built_without_importing_the_compiler():
    code = (
        "import sys, torch\n"
        "from acco_ds.deepspeed.param_groups import ParamGroupHolder\n"
        "ParamGroupHolder([torch.zeros(3, requires_grad=True)])\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout
