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
from benchmarks.gpu_overlap import timeline

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
                      host_ahead=1.0, host_syncs_per_step=0.0, rounds=8, round_end_host_us=42.4),
        bench.Setting("acco", 0.25, 25.0, 100.0, t_side_ms=26.0, t_round_ms=104.0, host_round_ms=4.0,
                      host_ahead=0.75, host_syncs_per_step=2.0, host_gaps_us=[12.0, 150.0], profiled_steps=1,
                      rounds=16, notes=["x"]),
    ]  # fmt: skip
    meta = dict(date="d", machine="m", versions="v", command="c", params=271e6, micro_batch=8, seq=1024, gas=4,
                steps=8, warmup=2, cycles_per_ms=1.9e6, compute_syncs_per_step=0.0)  # fmt: skip
    return s, meta


def test_render_labels_the_stand_in():
    s, meta = _settings_and_meta()
    md = bench.render(s, meta)
    assert "the largest such gap.\n" in md and "steady state" not in md  # a JSON from before that profile
    meta.update(compute_host_gaps_us=[], compute_profiled_steps=0)
    assert "The model alone, profiled the same way: not profiled." in bench.render(s, meta)
    meta.update(compute_host_gaps_us=[20.0, 180.0, 400.0], compute_profiled_steps=2)
    assert (
        "The model alone, profiled the same way: 2 stalls in 2 steps (largest gap 400 us)."
        in bench.render(s, meta)
    )
    assert "STAND-IN" in md and "271M parameters" in md
    assert "| sync | 1 | 100.0 | 100.0 | 101.0 | 203.0 | 50% | 5.0 | 42 | 100% | 0.0 | - |" in md
    # a JSON from before the round end's host time was recorded: nan
    assert (
        "| acco | 0.25 | 25.0 | 100.0 | 26.0 | 104.0 | 96% | 4.0 | nan | 75% | 2.0 | 1 in 1 steps (150) |"
        in md
    )
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


# -- the host-stall measure on synthetic kernel timelines (benchmarks.gpu_overlap.timeline) -------------------

COMPUTE, SIDE = 7, 20


def _kernels(spans, stream=COMPUTE, queued_at=0.0):
    """Device ops of ``stream`` at ``(start, end)`` us, each launched at ``queued_at`` (or at a given third value)."""
    return [timeline.DeviceOp(a, b, stream, rest[0] if rest else queued_at) for a, b, *rest in spans]


def test_gap_free_timeline_has_no_host_gap():
    ops = _kernels([(i * 10.0, i * 10.0 + 10.0) for i in range(100)])  # back to back, all queued at t = 0
    ops += _kernels([(0.0, 900.0)], stream=SIDE)
    assert timeline.compute_stream(ops) == COMPUTE
    assert timeline.host_gaps(ops) == [] and timeline.stalls(timeline.host_gaps(ops)) == []


def test_host_waiting_inside_a_round_is_a_stall():
    """The compute stream finishes its queue at 100 us; the host, waiting in a round, launches the next kernel at
    2100 us: 2 ms of idle the host caused. With the side stream busy until 1900 us only 200 us are the host's."""
    ops = _kernels([(0.0, 50.0), (50.0, 100.0)]) + _kernels(
        [(2105.0, 2200.0, 2100.0), (2200.0, 2300.0, 2101.0)]
    )
    assert timeline.host_gaps(ops) == [2000.0]
    assert timeline.stalls(timeline.host_gaps(ops)) == [2000.0]
    with_side = ops + _kernels([(0.0, 1900.0)], stream=SIDE)
    assert timeline.host_gaps(with_side) == [200.0] and timeline.stalls(timeline.host_gaps(with_side)) == [
        200.0
    ]


def test_waiting_for_the_side_stream_with_work_queued_is_not_a_stall():
    """The next kernel was launched before the compute stream ran dry (a stream wait on the side job held it):
    device-side waiting, not the host's; nor is a host launch right after the side stream it waited for ends."""
    ops = _kernels([(0.0, 100.0), (3000.0, 3100.0, 50.0)]) + _kernels([(0.0, 2990.0)], stream=SIDE)
    assert timeline.host_gaps(ops) == []
    late = _kernels([(0.0, 100.0), (3010.0, 3100.0, 3000.0)]) + _kernels([(0.0, 2990.0)], stream=SIDE)
    assert timeline.host_gaps(late) == [10.0] and timeline.stalls(timeline.host_gaps(late)) == []


def test_small_launch_gaps_under_the_threshold_pass():
    spans = [
        (i * 20.0, i * 20.0 + 15.0, i * 20.0 + 10.0) for i in range(200)
    ]  # 5 us idle per launch, host-made
    gaps = timeline.host_gaps(_kernels(spans))
    assert len(gaps) == 199 and max(gaps) == 5.0 and timeline.stalls(gaps) == []
    assert timeline.stalls([timeline.STALL_THRESHOLD_US, timeline.STALL_THRESHOLD_US + 1]) == [101.0]


def test_ops_from_a_chrome_trace():
    """The records torch.profiler exports: device ops joined to their launch call by correlation id."""
    trace = {"traceEvents": [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 5.0, "dur": 3.0, "args": {"correlation": 1}},
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 10.0, "dur": 40.0, "args": {"stream": 7, "correlation": 1}},
        {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernel", "ts": 900.0, "dur": 3.0, "args": {"correlation": 2}},
        {"ph": "X", "cat": "kernel", "name": "triton", "ts": 905.0, "dur": 10.0, "args": {"stream": 7, "correlation": 2}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 20.0, "dur": 5.0, "args": {"stream": 20}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 1.0, "dur": 1.0, "args": {}},
    ]}  # fmt: skip
    ops = timeline.ops_from_trace(trace)
    assert sorted(ops, key=lambda o: o.start) == [
        timeline.DeviceOp(10.0, 50.0, 7, 5.0),
        timeline.DeviceOp(20.0, 25.0, 20, float("-inf")),
        timeline.DeviceOp(905.0, 915.0, 7, 900.0),
    ]
    assert timeline.host_gaps(ops) == [850.0]  # from the first kernel's end (50 us) to the launch (900 us)


def test_host_activity_names_the_launching_threads_self_time_in_a_gap():
    ev = [
        {"ph": "X", "cat": "python_function", "name": "step", "ts": 0, "dur": 1000, "tid": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 200, "dur": 700, "tid": 1},
        {"ph": "X", "cat": "python_function", "name": "heartbeat wait", "ts": 0, "dur": 1000, "tid": 2},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 1000, "tid": 7},
    ]
    trace = {"traceEvents": ev}
    assert timeline.host_activity(trace, 100, 1000, tid=1) == [
        ("cudaStreamSynchronize", 700.0),
        ("step", 200.0),
    ]
    assert timeline.host_activity(trace, 100, 1000)[0] == ("heartbeat wait", 900.0)
    assert timeline.host_activity(trace, 100, 1000, tid=1, top=1) == [("cudaStreamSynchronize", 700.0)]
