"""The shipped configs parse, and every ACCO one validates (options and DeepSpeed-level rules)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from acco_ds.config import ACCOConfig
from acco_ds.core.schedule import micro_batches_per_round

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.json"))


def test_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"acco_zero1_bf16.json", "zero1_adamw_bf16.json", "zero2_overlap_adamw_bf16.json"} <= names
    assert "acco_int8_slow_link_fp32.json" in names  # compressed rounds (CPU ranks), docs/SLOW_LINKS.md


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_is_valid(path):
    cfg = json.loads(path.read_text())
    assert cfg["train_micro_batch_size_per_gpu"] > 0
    if cfg["optimizer"]["type"].lower() == "acco":
        acco = ACCOConfig.from_params(cfg["optimizer"]["params"])
        assert cfg["zero_optimization"]["stage"] == 1
        micro_batches_per_round(acco.mode, cfg["gradient_accumulation_steps"])
