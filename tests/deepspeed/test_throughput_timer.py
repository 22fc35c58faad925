"""DeepSpeed's throughput timer must not synchronise the device in an ACCO engine.

DeepSpeed 0.19.8 creates ``engine.tput_timer`` with ``timers.throughput.synchronized = true`` by default and,
without ``training_data``, calls ``get_accelerator().synchronize()`` in ``engine.forward`` and ``engine.step``:
on a GPU a device-wide sync that waits for ACCO's communication stream. The CPU accelerator's synchronize does
nothing, so these tests count the calls instead (real engines, one gloo rank in this process).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import deepspeed
import pytest
from deepspeed.accelerator import get_accelerator

import acco_ds  # noqa: F401  (registers "ACCO")
from acco_ds.cli import dsconfig
from acco_ds.deepspeed import engine_setup
from tests.ranks import toy
from tests.ranks.inproc import ensure_single_rank_group

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    ensure_single_rank_group()


def config(optimizer: dict, **top) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": toy.MICRO_BATCH,
        "gradient_accumulation_steps": 2,
        "optimizer": optimizer,
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
    }
    cfg.update(top)
    return cfg


ACCO = {"type": "ACCO", "params": {"lr": 1e-3, "mode": "acco"}}


def train_counting_syncs(cfg: dict, monkeypatch, steps: int = 3):
    """Build the engine from ``cfg``, run ``steps`` optimizer steps; (engine, accelerator synchronize() calls
    made inside engine.forward / engine.step). The timer starts at global step 2, so 3 steps are needed."""
    model = toy.build()
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    acc = get_accelerator()
    calls = []
    original = acc.synchronize
    monkeypatch.setattr(acc, "synchronize", lambda *a, **k: (calls.append(1), original(*a, **k))[1])
    try:
        for i in range(steps * engine.gradient_accumulation_steps()):
            loss = engine(*toy.micro_batch(0, i))
            engine.backward(loss)
            engine.step()
    finally:
        monkeypatch.setattr(acc, "synchronize", original)
        opt = engine.optimizer
        if hasattr(opt, "pipeline"):
            opt.finish()
            opt.pipeline.close()
    return engine, len(calls)


def test_acco_engine_has_the_synchronized_throughput_timer_off(monkeypatch):
    engine, syncs = train_counting_syncs(config(ACCO), monkeypatch)
    assert engine.tput_timer.config.enabled and engine.tput_timer.config.synchronized is False
    assert syncs == 0


def test_deepspeed_default_synchronizes(monkeypatch):
    """The counter sees DeepSpeed's syncs (without ACCO the default stays as DeepSpeed has it)."""
    adamw = {"type": "AdamW", "params": {"lr": 1e-3}}
    engine, syncs = train_counting_syncs(config(adamw), monkeypatch)
    assert engine.tput_timer.config.synchronized is True
    assert syncs > 0


def test_user_config_turning_it_back_on_is_kept_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(engine_setup, "_said", set())
    cfg = config(ACCO, timers={"throughput": {"synchronized": True}})
    with caplog.at_level(logging.WARNING, logger="acco_ds"):
        engine, syncs = train_counting_syncs(cfg, monkeypatch)
    assert engine.tput_timer.config.synchronized is True and syncs > 0
    warned = [
        r.getMessage() for r in caplog.records if "timers.throughput.synchronized=true" in r.getMessage()
    ]
    assert len(warned) == 1 and "no longer overlaps" in warned[0]


def test_shipped_and_generated_acco_configs_turn_it_off():
    acco_configs = 0
    for path in sorted((ROOT / "configs").glob("*.json")):
        cfg = json.loads(path.read_text())
        if cfg["optimizer"]["type"].lower() == "acco":
            acco_configs += 1
            assert cfg["timers"] == {"throughput": {"synchronized": False}}, path.name
    assert acco_configs >= 4
    knobs = dsconfig.Knobs(micro_batch=4, grad_accum=4, world_size=2, num_params=10**6)
    for mode in dsconfig.ALL_MODES:
        assert dsconfig.build_config(mode, knobs)["timers"] == {"throughput": {"synchronized": False}}, mode
