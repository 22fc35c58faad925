"""benchmarks.offload on a machine without a GPU: its pure parts (the contenders' DeepSpeed configs, the sizing, the
goals judged from a planted JSON, the compute stream's idle fraction on a synthetic trace, scripts/gpu/goals.py's
rows), its arguments and its exits, and the whole flow end to end in --tiny mode (CPU, gloo, a tiny Llama: every
contender in its own process, the JSON, the table rendered from it, the goals). The measurement itself runs on a GPU
(scripts/gpu/checks.sh, step bench_offload)."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from acco_ds.config import ACCOConfig
from benchmarks.offload import cli, goals, plan, report, worker

ROOT = Path(__file__).resolve().parents[2]


def _gpu_goals():
    spec = importlib.util.spec_from_file_location("gpu_goals", ROOT / "scripts" / "gpu" / "goals.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_goals", module)
    spec.loader.exec_module(module)
    return sys.modules["gpu_goals"]


def test_import_touches_neither_torch_nor_transformers():
    code = "import sys; import benchmarks.offload.cli, benchmarks.offload.worker, benchmarks.offload.goals; "
    code += "print('torch' in sys.modules, 'transformers' in sys.modules, 'deepspeed' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["False", "False", "False"], r.stderr[-2000:]


def test_goals_module_is_stdlib_only():
    """scripts/gpu/goals.py loads it by path on the GPU machine: no import of the project or of torch."""
    text = (ROOT / "benchmarks" / "offload" / "goals.py").read_text()
    imports = [line.split()[1] for line in text.splitlines() if line.startswith(("import ", "from "))]
    assert set(imports) <= {"__future__", "math"}, imports


def test_contender_configs():
    from deepspeed.runtime.zenflow.zenflow_config import ZenFlowConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    for label in plan.CONTENDERS:
        cfg = plan.ds_config(label, 2, 8)
        assert cfg["gradient_accumulation_steps"] == 8 and cfg["train_micro_batch_size_per_gpu"] == 2
        assert cfg["bf16"] == {"enabled": True} and cfg["gradient_clipping"] == plan.CLIP
        zero = DeepSpeedZeroConfig(**cfg["zero_optimization"])
        offloaded = cfg["zero_optimization"].get("offload_optimizer")
        assert (offloaded == {"device": "cpu", "pin_memory": True}) == (label != "compute-only"), label
        if cfg["optimizer"]["type"] == "ACCO":
            acco = ACCOConfig.from_params(cfg["optimizer"]["params"])
            assert int(zero.stage) == 1
            if label == "compute-only":
                assert (acco.mode, acco.accumulation) == ("dpu", "fixed")
            else:
                assert acco.mode == "acco" and acco.accumulation == label.rsplit("-", 1)[1]
        else:  # DeepSpeed's AdamW, the same settings as ACCO's
            assert cfg["optimizer"] == {"type": "AdamW", "params": plan.HP}
    assert int(DeepSpeedZeroConfig(**plan.ds_config("zero2-offload", 2, 8)["zero_optimization"]).stage) == 2
    zf = plan.ds_config("zenflow", 2, 8)["zero_optimization"]
    assert zf["stage"] == 2 and ZenFlowConfig(**zf["zenflow"]).overlap_step
    assert zf["zenflow"] == {"overlap_step": True, "update_interval": 8}  # the accumulation, not "auto"
    assert (
        plan.ds_config("zenflow", 2, 8, "auto")["zero_optimization"]["zenflow"]["update_interval"] == "auto"
    )
    with pytest.raises(ValueError, match="unknown contender"):
        plan.ds_config("zero3-offload", 2, 8)


def test_sizing():
    from benchmarks.gpu_overlap.cli import llama_param_count

    n = llama_param_count(plan.SIZES["1b"])
    assert 0.5e9 <= n <= 1.5e9 and 0.5e9 <= llama_param_count(plan.SIZES["0.5b"]) <= 0.6e9
    size = plan.SIZES["1b"]
    assert plan.flops_per_token(size, 2048) == pytest.approx(6 * (n - 32000 * 2048) + 6 * 16 * 2048 * 2048)
    first = plan.predict(size, 2048, 2, 2)
    gas = plan.choose_gas(first["host_step_s"], first["compute_mb_s"])
    p = plan.predict(size, 2048, 2, gas)
    assert gas % 2 == 0 and goals.FIXED_REGIME[0] <= p["host_over_compute"] <= goals.FIXED_REGIME[1]
    assert p["zero_offload_step_s"] > p["compute_step_s"] + p["host_step_s"]  # the copies too
    # the ratio does not depend on the model's size: only the tokens per step set it
    q = plan.predict(plan.SIZES["0.5b"], 2048, 2, gas)
    assert q["host_over_compute"] == pytest.approx(p["host_over_compute"], rel=0.1)
    assert (
        plan.choose_gas(1.0, 0.1) == 20
        and plan.choose_gas(1.0, 10.0) == 2
        and plan.choose_gas(100.0, 0.01) == 64
    )
    assert all(plan.choose_gas(1.0, t) % 2 == 0 for t in (0.013, 0.07, 0.2))
    assert plan.GPU_STEPS.micro_batches(8) == 8 * (2 + 5 + 2) and plan.TINY_STEPS.micro_batches(4) == 12


def test_arguments():
    a = cli.parse_args(["--out", "x", "--tiny"])
    assert (a.device, a.size, a.gas, a.seq, a.steps) == ("cpu", "tiny", 4, 64, plan.TINY_STEPS)
    a = cli.parse_args(["--out", "x"])
    assert (a.size, a.gas, a.seq, a.micro_batch, a.steps) == ("1b", "auto", 2048, 2, plan.GPU_STEPS)
    assert a.contenders == list(plan.CONTENDERS)
    a = cli.parse_args(
        ["--out", "x", "--contenders", "zenflow,compute-only", "--zenflow-update-interval", "4"]
    )
    assert (
        a.contenders == ["compute-only", "zenflow"] and a.zenflow_update_interval == 4
    )  # compute-only first
    for bad in (["--gas", "3"], ["--gas", "x"], ["--contenders", "zero3"], ["--steps", "1,2"],
                ["--gas", "auto", "--contenders", "zero1-offload"], ["--steps", "0,2,0"]):  # fmt: skip
        with pytest.raises(SystemExit):
            cli.parse_args(["--out", "x", *bad])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_without_a_gpu_it_says_so_and_writes_nothing(tmp_path, capsys):
    assert cli.main(["--out", str(tmp_path / "out")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_idle_fraction_on_a_synthetic_trace():
    """Compute stream 7: kernels at 0-10, 10-20, 40-50 us and a copy at 20-30 (idle: a transfer); 30-40 nothing.
    A side stream's kernels do not count. Window 0-50, busy 30: idle 40%."""

    def ev(cat, ts, dur, stream):
        return {"cat": cat, "ph": "X", "ts": ts, "dur": dur, "args": {"stream": stream}}

    trace = {"traceEvents": [ev("kernel", 0, 10, 7), ev("kernel", 10, 10, 7), ev("gpu_memcpy", 20, 10, 7),
                             ev("kernel", 40, 10, 7), ev("kernel", 5, 60, 20), ev("cpu_op", 0, 100, 0)]}  # fmt: skip
    out = worker.idle_fraction(trace)
    assert out["stream"] == 7 and out["kernels"] == 3 and out["window_us"] == 50.0
    assert out["idle_fraction"] == pytest.approx(0.4) and out["copies_on_compute_stream_us"] == 10.0
    overlapping = {"traceEvents": [ev("kernel", 0, 30, 7), ev("kernel", 10, 10, 7), ev("kernel", 40, 10, 7)]}
    assert worker.idle_fraction(overlapping)["idle_fraction"] == pytest.approx(0.2)
    assert worker.idle_fraction({"traceEvents": []})["idle_fraction"] is None


# -- the goals, judged from a planted JSON ----------------------------------------------------------------------
GIB = 2**30
N = 1_000_000_000


def _planted() -> dict:
    """A GPU run where every goal is met: host / compute 0.5 (host step 0.5 s over a 1.0 s compute step)."""

    def c(sps, steps_per_s, loss, peak, fp32=0, idle=0.05):
        return {"status": "ok", "samples_per_s": sps, "steps_per_s": steps_per_s, "step_time_s": 1 / steps_per_s,
                "eval_loss": loss, "peak_gpu_bytes": peak, "fp32_gpu_bytes": fp32, "idle_fraction": idle}  # fmt: skip

    return {
        "meta": {"device": "cuda", "params": N, "contenders": list(plan.CONTENDERS),
                 "calibration": {"model_alone_samples_per_s": 17.0, "threads": 16, "host_rows": {
                     "acco_commit": {"n": 100_000_000, "median_s": 0.045},
                     "acco_peek": {"n": 100_000_000, "median_s": 0.030},
                     "deepspeed_cpu_adam": {"n": 100_000_000, "median_s": 0.05}}}},
        "contenders": {
            "compute-only": c(16.0, 1.0, 5.00, 40 * GIB, fp32=12 * N, idle=0.02),
            "zero1-offload": c(10.0, 0.62, 5.00, 20 * GIB, idle=0.4),
            "zero2-offload": c(10.5, 0.65, 5.00, 19 * GIB, idle=0.38),
            "zenflow": c(13.0, 0.8, 5.20, 24 * GIB),
            "acco-offload-fixed": c(14.5, 0.9, 5.05, 25 * GIB, fp32=1000),
            "acco-offload-adaptive": c(15.0, 0.85, 5.06, 25 * GIB, fp32=1000),
        },
    }  # fmt: skip


def _met(data) -> list:
    return [row["met"] for row in goals.judge(data)]


def test_goals_all_met_on_a_planted_run():
    data = _planted()
    assert goals.host_step_s(data) == pytest.approx(0.5) and goals.host_over_compute(data) == pytest.approx(
        0.5
    )
    rows = goals.judge(data)
    assert [r["goal"] for r in rows] == list(goals.GOALS)
    assert _met(data) == [True] * 7, rows
    assert (
        "1.45x (0.900 vs 0.620 steps/s); vs ZeRO-2 + offload 1.38x; host / compute 0.50" in rows[0]["figure"]
    )
    assert "94% (15.00 vs 16.00 samples/s); 88% of the model alone's 17.00" in rows[1]["figure"]
    assert "fixed +1.00%, adaptive +1.20%; ZenFlow +4.00%" in rows[3]["figure"]
    assert "16.1 B/param below compute-only's 40.0 GiB" in rows[4]["figure"]
    assert "commit 1.11x DeepSpeedCPUAdam's step" in rows[5]["figure"] and rows[6]["figure"] == "6 of 6"


def test_goals_not_met_and_missing_figures():
    data = _planted()
    data["contenders"]["acco-offload-fixed"]["steps_per_s"] = 0.8  # 1.29x
    data["contenders"]["acco-offload-adaptive"]["eval_loss"] = 5.2  # +4%
    data["contenders"]["acco-offload-fixed"]["fp32_gpu_bytes"] = 4 * N  # a moment left on the GPU
    data["meta"]["calibration"]["host_rows"]["acco_commit"]["median_s"] = 0.06  # slower than DeepSpeedCPUAdam
    assert _met(data) == [False, True, True, False, False, False, True]
    # outside the regime: no verdict (host / compute 0.25: 1.4x is out of anyone's reach there)
    data = _planted()
    data["meta"]["calibration"]["host_rows"]["deepspeed_cpu_adam"]["median_s"] = 0.025
    rows = goals.judge(data)
    assert rows[0]["met"] is None and "outside the goal's regime" in rows[0]["figure"]
    data["meta"]["calibration"]["host_rows"]["deepspeed_cpu_adam"]["median_s"] = 0.15  # 1.5x: adaptive's too
    assert goals.judge(data)[1]["met"] is None
    # a contender that failed: its goals have no result, the last contender goal says why
    data = _planted()
    data["contenders"]["zenflow"] = {
        "status": "failed",
        "error": "Traceback ...\nRuntimeError: ZenFlow broke",
    }
    rows = goals.judge(data)
    assert rows[2]["met"] is None and "zenflow: failed (RuntimeError: ZenFlow broke)" in rows[2]["figure"]
    assert rows[6]["met"] is False and "5 of 6" in rows[6]["figure"]
    assert rows[3]["met"] is True and "ZenFlow: no loss" in rows[3]["figure"]  # ZenFlow's loss is only beside
    # a missing contender, a NaN loss, no host rows, a CPU run's memory
    data = _planted()
    del data["contenders"]["compute-only"]
    data["contenders"]["acco-offload-fixed"]["eval_loss"] = math.nan
    data["meta"]["calibration"]["host_rows"] = {}
    assert _met(data) == [None, None, True, None, None, None, False]
    data = _planted()
    data["meta"]["device"] = "cpu"
    assert goals.judge(data)[4] == {"goal": goals.GOALS[4], "figure": "n/a: not a GPU run", "met": None}
    assert goals.verdict(None) == "NOT MET (no result)" and goals.verdict(False) == "NOT MET"


def test_report_renders_the_planted_run():
    md = report.render(_planted())
    assert (
        "| acco-offload-adaptive | ok | 15.00 | 94% | 0.850 | 1.176 | 5.0% | 5.0600 (+1.20%) | 25.0 | 0.00 |"
        in md
    )
    assert "| zero1-offload | ok | 10.00 | 62% | 0.620 | 1.613 | 40.0% | 5.0000 | 20.0 | 0.00 |" in md
    assert md.count("| MET |") == 7 and "| deepspeed_cpu_adam | 100M | ? | 50.00 | 56.0 (28 B) | 2000 |" in md


def test_gpu_goals_read_the_offload_json(tmp_path):
    gg = _gpu_goals()
    (tmp_path / "steps.tsv").write_text("bench_offload\t300\tok\t0\t250\n")
    (tmp_path / "offload.json").write_text(json.dumps(_planted()))
    rows = gg.offload_goals(tmp_path)
    assert (
        len(rows) == 7 and all(r.endswith("| met |") for r in rows) and rows[0].startswith("| offload: fixed")
    )
    (tmp_path / "steps.tsv").write_text("bench_offload\t300\ttimeout\t124\t300\n")
    rows = gg.offload_goals(tmp_path)
    assert all(r.endswith("| NOT met (no result) |") and "bench_offload: timeout" in r for r in rows)
    (tmp_path / "steps.tsv").write_text("bench_offload\t300\tok\t0\t250\n")
    data = _planted()
    data["contenders"]["acco-offload-adaptive"]["samples_per_s"] = 10.0
    (tmp_path / "offload.json").write_text(json.dumps(data))
    rows = gg.offload_goals(tmp_path)
    assert rows[1].endswith("| NOT met |") and rows[2].endswith("| NOT met |") and rows[0].endswith("| met |")


# -- the whole flow on the CPU ----------------------------------------------------------------------------------
def _run(args: list, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.offload", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


@pytest.mark.slow
@pytest.mark.launcher  # starts six one-rank processes (about 2 minutes here): left out of the edit loop
def test_tiny_end_to_end(tmp_path):
    out = tmp_path / "out"
    r = _run(["--tiny", "--out", str(out)])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    data = json.loads((out / cli.JSON_NAME).read_text())
    meta, contenders = data["meta"], data["contenders"]
    assert meta["device"] == "cpu" and meta["gas"] == 4 and meta["contenders"] == list(plan.CONTENDERS)
    assert meta["cpu_adam_load_s"] is not None and set(meta["calibration"]["host_rows"]) == {
        "acco_commit", "acco_peek", "deepspeed_cpu_adam"}  # fmt: skip
    for label in plan.CONTENDERS:
        c = contenders[label]
        assert c["status"] == "ok", (label, c.get("error"))
        assert c["micro_batches_timed"] == 8 and c["samples_per_s"] > 0 and math.isfinite(c["eval_loss"])
        assert c["samples_trained"] == 24 and c["params"] == meta["params"]  # the same samples for everyone
        assert c["idle_fraction"] is None and c["peak_gpu_bytes"] is None  # n/a on the CPU
        assert c["config"] == plan.ds_config(label, 2, 4)
    # fixed rounds: 8 micro-batches at GAS 4 commit 3 steps (the last one drained); adaptive rounds end when the
    # communication does, so how many fit depends on the machine's load (1 commit of 3 rounds in a loaded suite run)
    assert contenders["acco-offload-fixed"]["acco_stats"]["committed_steps"] >= 3
    adaptive = contenders["acco-offload-adaptive"]["acco_stats"]
    assert adaptive["committed_steps"] >= 1 and adaptive["rounds"] >= 2 * adaptive["committed_steps"] >= 2
    # the same model, seed and data: ACCO + offload ends where ZeRO-Offload ends, within the loss goal
    rows = goals.judge(data)
    assert rows[3]["met"] is True and rows[4]["met"] is None and rows[6]["met"] is True, rows
    # the table is the JSON's, and --from-json renders it again
    md = (out / cli.MD_NAME).read_text()
    assert md == report.render(data) and md in r.stdout
    again = tmp_path / "again"
    assert _run(["--from-json", str(out / cli.JSON_NAME), "--out", str(again)], 120).returncode == 0
    assert (again / cli.MD_NAME).read_text() == md
    # scripts/gpu/goals.py judges the same rows from the file
    (out / "steps.tsv").write_text("bench_offload\t300\tok\t0\t100\n")
    gg_rows = _gpu_goals().offload_goals(out)
    assert [r.endswith("| met |") for r in gg_rows] == [row["met"] is True for row in rows]


def test_a_deadline_leaves_contenders_out(tmp_path):
    """Too little time for any contender: none is started, each says why, the JSON and table are still written, and
    the exit status (3) says the run is incomplete."""
    out = tmp_path / "out"
    r = _run(
        ["--tiny", "--out", str(out), "--contenders", "compute-only,zero1-offload", "--deadline-s", "2"], 120
    )
    assert r.returncode == 3, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads((out / cli.JSON_NAME).read_text())
    assert {c["status"] for c in data["contenders"].values()} == {"not run"}
    assert "deadline" in data["contenders"]["compute-only"]["error"]
    rows = goals.judge(copy.deepcopy(data))
    assert rows[6]["met"] is False and "0 of 2" in rows[6]["figure"]
    assert (out / cli.MD_NAME).read_text() == report.render(data)
