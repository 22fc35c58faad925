"""acco-train --model gpt2|llama: the models built from transformers configs (byte vocabulary, nothing
downloaded) keep the main job's call contract, their options are checked, and a tiny GPT-2 and a tiny
Llama train with ACCO through the real launcher (2 CPU ranks) for a few steps."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from acco_ds.cli.args import parse
from acco_ds.models import HFModelConfig, build_model, model_num_params

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
TINY = {"n_layer": 1, "d_model": 32, "n_head": 2, "context": 16}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hf_model_contract(arch):
    spec = dict(TINY, arch=arch)
    torch.manual_seed(0)
    a = build_model(spec)
    torch.manual_seed(0)
    b = build_model(spec)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))  # seeded alike
    assert model_num_params(spec) == a.num_params() == sum(p.numel() for p in a.parameters())
    assert type(a.lm).__name__ == ("GPT2LMHeadModel" if arch == "gpt2" else "LlamaForCausalLM")
    assert a.lm.config.vocab_size == 256
    x = torch.randint(0, 256, (3, 16))
    assert a(x).shape == (3, 16, 256)
    loss = a(x, x.roll(-1, 1))
    assert loss.dim() == 0 and abs(loss.item() - math.log(256)) < 1.0
    loss.backward()
    assert all(p.grad is not None for p in a.parameters())
    with pytest.raises(ValueError, match="exceeds the model context"):
        a(torch.randint(0, 256, (1, 17)))
    assert build_model(spec, torch.bfloat16).lm.dtype == torch.bfloat16


def test_hf_model_config_errors():
    with pytest.raises(ValueError, match="arch must be one of"):
        HFModelConfig(arch="bert")
    with pytest.raises(ValueError, match="divisible by n_head"):
        HFModelConfig(arch="llama", d_model=30, n_head=4)
    with pytest.raises(ValueError, match="llama only"):
        HFModelConfig(arch="gpt2", n_kv_head=2)
    with pytest.raises(ValueError, match="multiple of n_kv_head"):
        HFModelConfig(arch="llama", n_head=4, n_kv_head=3)
    assert HFModelConfig(arch="llama", d_model=384).ffn == 1024 and HFModelConfig(arch="gpt2").ffn == 512
    with pytest.raises(ValueError, match="model arch must be one of"):
        build_model({"arch": "t5"})


def test_model_options_are_checked(capsys):
    a = parse(["--model", "llama", "--n-head", "4", "--n-kv-head", "2", "--out", "x"])
    assert a.model == "llama" and a.n_kv_head == 2
    assert parse(["--out", "x"]).model == "tiny"
    for bad, msg in (
        (["--model", "gpt2", "--n-kv-head", "2"], "llama only"),
        (["--model", "tiny", "--d-ff", "64"], "--d-ff and --n-kv-head apply to --model gpt2|llama"),
        (["--model", "llama", "--d-model", "30", "--n-head", "4"], "divisible by n_head"),
    ):
        with pytest.raises(SystemExit):
            parse(bad + ["--out", "x"])
        assert msg in capsys.readouterr().err


@pytest.mark.launcher
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_acco_train_hf_model_run(tmp_path, arch):
    """A real 2-rank ACCO run of a tiny HF model (about 30 s on 2 CPU cores)."""
    out = tmp_path / "out"
    size = ["--n-layer", "1", "--d-model", "64", "--n-head", "2", "--context", "32"]
    cmd = [sys.executable, "-m", "acco_ds.train", "--model", arch, "--mode", "acco", "--steps", "10", *size]
    cmd += ["--micro-batch", "4", "--grad-accum", "2", "--warmup-steps", "2", "--lr", "5e-3"]
    cmd += ["--eval-windows", "8", "--out", str(out), "--no-progress"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    model = summary["model"]
    assert model["arch"] == arch and model["params"] == model_num_params(
        {k: v for k, v in model.items() if k != "params"}
    )
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert summary["runs"]["acco"]["steps"] == 10 and lines[-1]["step"] == 10
    assert lines[-1]["loss"] < lines[0]["loss"] - 0.5, (lines[0]["loss"], lines[-1]["loss"])
    assert summary["runs"]["acco"]["val_loss"] < math.log(256)
