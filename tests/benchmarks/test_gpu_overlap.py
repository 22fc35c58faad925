"""benchmarks.gpu_overlap on a machine without a GPU: its pure parts (model size, DeepSpeed
config, efficiency, the report, re-rendering from its JSON) and a clear exit without a GPU. The measurement itself runs on a GPU
(scripts/gpu_checks.sh)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from acco_ds.config import ACCOConfig
from benchmarks.gpu_overlap import cli as bench

ROOT = Path(__file__).resolve().parents[2]


def test_import_touches_neither_torch_nor_transformers():
    code = "import sys; import benchmarks.gpu_overlap.cli; "
    code += "print('torch' in sys.modules, 'transformers' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["False", "False"], r.stderr[-2000:]


def test_llama_size_and_param_count():
    transformers = pytest.importorskip("transformers")
    tiny = bench.SIZES["tiny"]
    model = transformers.LlamaForCausalLM(bench.llama_config(tiny, 16))
    assert sum(p.numel() for p in model.parameters()) == bench.llama_param_count(tiny)
    assert model.config.hidden_size == tiny.hidden and not model.config.tie_word_embeddings
    loss = model(
        input_ids=torch.randint(0, tiny.vocab, (2, 16)), labels=torch.randint(0, tiny.vocab, (2, 16))
    ).loss
    assert torch.isfinite(loss)
    assert 200e6 <= bench.llama_param_count(bench.SIZES["default"]) <= 500e6  # "a few hundred million"


def test_ds_config_is_an_acco_config():
    for mode in ("sync", "acco"):
        cfg = bench.ds_config(mode, 8, 4)
        assert ACCOConfig.from_params(cfg["optimizer"]["params"]).mode == mode
        assert cfg["timers"] == {"throughput": {"synchronized": False}} and cfg["bf16"]["enabled"]
    with pytest.raises(ValueError, match="mode must be"):
        bench.ds_config("zero1", 8, 4)
    assert bench.rounds_per_step("acco") == 2 and bench.rounds_per_step("sync") == 1


def test_efficiency():
    assert bench.efficiency(100.0, 50.0, 100.0) == 1.0
    assert bench.efficiency(100.0, 200.0, 250.0) == pytest.approx(0.8)
    assert bench.efficiency(100.0, 100.0, 200.0) == 0.5  # sync: compute + communication back to back


def _settings_and_meta() -> tuple:
    s = [
        bench.Setting("sync", 1.0, 100.0, 100.0, t_side_ms=101.0, t_round_ms=203.0, host_round_ms=5.0,
                      host_ahead=1.0, host_syncs_per_step=0.0, rounds=8),
        bench.Setting("acco", 0.25, 25.0, 100.0, t_side_ms=26.0, t_round_ms=104.0, host_round_ms=4.0,
                      host_ahead=0.75, host_syncs_per_step=2.0, rounds=16, notes=["x"]),
    ]  # fmt: skip
    meta = dict(date="d", machine="m", versions="v", command="c", params=271e6, micro_batch=8, seq=1024, gas=4,
                steps=8, warmup=2, cycles_per_ms=1.9e6, compute_syncs_per_step=0.0)  # fmt: skip
    return s, meta


def test_render_labels_the_stand_in():
    s, meta = _settings_and_meta()
    md = bench.render(s, meta)
    assert "STAND-IN" in md and "271M parameters" in md
    assert "| sync | 1 | 100.0 | 100.0 | 101.0 | 203.0 | 50% | 5.0 | 100% | 0.0 |" in md
    assert "| acco | 0.25 | 25.0 | 100.0 | 26.0 | 104.0 | 96% | 4.0 | 75% | 2.0 |" in md
    assert "- acco x0.25: x" in md


def test_arguments_are_checked():
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "x", "--gas", "3"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "x", "--modes", "sync,zero2"])
    a = bench.parse_args(["--out", "x", "--quick", "--factors", "0,1"])
    assert a.size == "quick" and a.steps == 4 and a.factors == [0.0, 1.0] and a.modes == ["sync", "acco"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_without_a_gpu_it_says_so_and_writes_nothing(tmp_path, capsys):
    assert bench.main(["--out", str(tmp_path / "out")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_from_json_rerenders_the_written_table(tmp_path, capsys):
    """The raw JSON ``write`` saves beside the table re-renders (``--from-json``, no GPU) the same table."""
    s, meta = _settings_and_meta()
    md = bench.write(tmp_path / "run", s, meta)
    assert (tmp_path / "run" / "gpu_overlap.md").read_text() == md
    again = tmp_path / "again"
    assert bench.main(["--out", str(again), "--from-json", str(tmp_path / "run" / "gpu_overlap.json")]) == 0
    assert (again / "gpu_overlap.md").read_text() == md
