"""Stream-ordering stress on one GPU (NCCL, W = 1, side stream): the toy scenarios with device sleeps that
shift the communication (side) stream and the compute stream against each other must still give the
reference's final parameters and moments; skipped without a GPU (scripts/gpu_checks.sh runs it).

- ``side_long``: every round job sleeps 20 ms on the side stream before its collectives, the compute stream
  0.2 ms per forward: a compute stream that reads the parameters (or rewrites the gradient buffer) without
  waiting for the job in flight reads them before the job wrote them.
- ``compute_long``: 5 ms per forward on the compute stream, 0.2 ms per job: a job that reduces the gradient
  buffer without waiting for the compute stream's last accumulation reads a partial buffer.
- the control: the same as ``side_long`` with every stream/event wait made a no-op; it must leave the
  reference by far more than the tolerance, which shows the sleeps are long enough to expose a missing wait
  (a pipeline whose host waits for every job would order the streams by itself: the message says so).

Nothing is read between steps (a read drains the pipeline); DeepSpeed's throughput timer must not synchronise
the device (no ``torch.cuda.synchronize()`` during the steps).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.core.test_trajectories import CLIPS, DTYPES, MODES, name_of, reference, scenarios
from tests.ranks.launch import REPO, rank_env, run_deepspeed

pytestmark = [
    pytest.mark.launcher,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)"),
]
CLIP = "clip"
assert CLIP in CLIPS
PARAM_TOL = {"fp32": 5e-5, "bf16": 4e-3}  # as tests/gpu/test_pipeline_gpu.py: GPU summation orders
MOMENT_TOL = {"fp32": 1e-4, "bf16": 3e-2}  # relative to the largest reference value
PADS = {"side_long": (20.0, 0.2), "compute_long": (0.2, 5.0)}  # (side ms per job, compute ms per forward)


def launch(tmp, names, side_ms, compute_ms, *extra):
    spec = tmp / "scenarios.json"
    spec.write_text(json.dumps([sc for sc in scenarios(1) if sc["name"] in names]))
    args = ["--scenarios", spec, "--out", tmp, "--side-ms", side_ms, "--compute-ms", compute_ms, *extra]
    run_deepspeed(REPO / "tests" / "ranks" / "stress_worker.py", 1, args, env=rank_env(accelerator="cuda"))
    return torch.load(tmp / "results.pt", weights_only=False)


def deviation(res: dict, mode: str, dtype: str):
    """(max |param - ref|, max |exp_avg - ref| / max |ref exp_avg|) at the end of the run; inf for NaN."""
    ref = reference(mode, dtype, 1, CLIP, tuple(res["lrs"]))
    dp = (res["final_model"] - ref.params[-1][0]).abs().max().item()
    want = ref.exp_avg[-1][0]
    dm = (res["exp_avg"] - want).abs().max().item() / want.abs().max().item()
    return tuple(float("inf") if d != d else d for d in (dp, dm))


ALL = [name_of(m, d, CLIP) for m in MODES for d in DTYPES]


@pytest.fixture(scope="module", params=list(PADS))
def stressed(request, tmp_path_factory):
    side_ms, compute_ms = PADS[request.param]
    return launch(tmp_path_factory.mktemp(request.param), ALL, side_ms, compute_ms)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_stressed_streams_match_reference(stressed, mode, dtype):
    res = stressed[name_of(mode, dtype, CLIP)]
    assert res["padded_side_jobs"] > 0, "no round job went through the padding wrapper"
    assert res["timer_synchronized"] is False
    assert res["device_syncs"] == 0, f"{res['device_syncs']} torch.cuda.synchronize() calls during the steps"
    dp, dm = deviation(res, mode, dtype)
    assert dp <= PARAM_TOL[dtype], f"{mode}/{dtype}: final params off the reference by {dp:.3e}"
    assert dm <= MOMENT_TOL[dtype], f"{mode}/{dtype}: final exp_avg off the reference by {dm:.3e} (relative)"


def test_control_without_waits_leaves_the_reference(tmp_path):
    name = name_of("acco", "fp32", CLIP)
    side_ms, compute_ms = PADS["side_long"]
    res = launch(tmp_path, [name], side_ms, compute_ms, "--break-waits")[name]
    dp, _ = deviation(res, "acco", "fp32")
    assert dp > 10 * PARAM_TOL["fp32"], (
        f"with every stream wait removed the run is still within {dp:.3e} of the reference: the sleeps do not "
        f"expose a missing wait, or the host orders the streams itself: it waited on the device "
        f"{res['host_waits']} times in {res['padded_side_jobs']} rounds (it should not wait inside a round)"
    )
