"""The paths only a GPU rank takes, run on CPU ranks in whole training runs (W = 2, one launch), against the same runs
without them.

A scenario with ``"cuda_paths": true`` (tests/ranks/worker.py) runs its jobs on the CUDA executor
(``core.comm.StreamExecutor``: the worker thread enqueues each job after the launch event, the round end makes the
compute stream wait on the done event) over emulated streams (``core.emulated_stream``: a job's done event completes
5 ms after the worker thread finished it, a stream wait blocks its thread), and reads each job's host summary one
job late (``defer_host_reads``), as the pipeline does on CUDA. The cases are those whose host-side bookkeeping these
paths move: fp16 with planted overflows (skips, the loss scale), optimizer offload on the staged host step
(``ACCO_DS_HOST_STEP_STAGING=1``), int8-compressed rounds (fused round ends, error feedback) and adaptive
accumulation with its rounds capped at their share (the same rounds in both runs), in sync, dpu and acco.

Each pair must give the same bits at every step: the committed parameters, both Adam moments, the reported gradient
norm, the loss scale, every rank's final parameters (compressed: the error-feedback residuals too); and DeepSpeed
must see the same run: ``engine.skipped_steps`` and the LR the engine reports, at every step.
"""

from __future__ import annotations

import pytest
import torch

from acco_ds.core.emulated_stream import DELAY_ENV
from acco_ds.core.host_step import STAGING_ENV
from tests.core import test_fp16_trajectories as fp16
from tests.core import test_trajectories as traj
from tests.deepspeed.test_offload import offloaded
from tests.ranks.launch import run_scenarios

pytestmark = pytest.mark.launcher  # starts ranks through a launcher (left out by make test-fast)

WORLD, STEPS = 2, 6
MODES = ("sync", "dpu", "acco")
# planted fp16 overflows (tests/ranks/worker.py "poison", GAS = fp16.GAS = 4): step 1 in its first micro-batch (acco:
# the g~ round), step 2 in its last on the other rank (hysteresis 2: the second skip in a row halves the scale),
# step 4 in one parameter's gradient only (one rank's shard)
POISON = [[0, 1 * fp16.GAS + 0], [WORLD - 1, 2 * fp16.GAS + 3], [0, 4 * fp16.GAS + 2, fp16.ONE_SHARD]]


def cases() -> dict:
    """name -> the scenario without the CUDA paths (its twin: the same with ``cuda_paths``)."""
    out = {}
    for m in MODES:
        out[f"{m}_fp16"] = {"config": fp16.ds_config(fp16.acco(m), "noclip"), "poison": POISON}
        out[f"{m}_offload"] = {"config": offloaded(traj.ds_config(traj.acco_opt(m), "fp32", "clip"))}
        mode, dtype, comp = traj.COMPRESSED[f"{m}_bf16_int8"]
        opt = traj.acco_opt(mode)
        opt["params"]["compression"] = comp
        out[f"{m}_int8"] = {"config": traj.ds_config(opt, dtype, "noclip")}
    for m, cap in (("dpu", traj.GAS), ("acco", traj.GAS // 2)):
        opt = traj.acco_opt(m)
        # capped at their share, adaptive rounds end where fixed ones do, whatever the timing: the same rounds
        opt["params"].update(accumulation="adaptive", max_micro_batches_per_round=cap)
        out[f"{m}_adaptive"] = {"config": traj.ds_config(opt, "fp32", "clip")}
    return out


CASES = cases()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    scenarios = []
    for name, sc in CASES.items():
        scenarios.append({"name": name, "steps": STEPS, **sc})
        scenarios.append({"name": f"{name}_cuda", "steps": STEPS, "cuda_paths": True, **sc})
    tmp = tmp_path_factory.mktemp("cuda_paths")
    # staging only acts on the offload cases (the others have no offload section); the emulated delay is set
    # explicitly so the docstring's 5 ms stays what runs
    return run_scenarios(WORLD, scenarios, tmp, **{STAGING_ENV: "1", DELAY_ENV: "0.005"})


def _norms(res: dict) -> list:
    return [repr(n) for n in res["norms"]]  # repr: an inf/NaN norm equals itself


@pytest.mark.parametrize("name", list(CASES))
def test_the_cuda_paths_ran(results, name):
    plain, cuda = results[name], results[f"{name}_cuda"]
    assert plain["executor"] == "ThreadExecutor" and not plain["defer_host_reads"]
    assert cuda["executor"] == "StreamExecutor" and cuda["defer_host_reads"]
    # the training thread (or the worker thread) found a job's done event not yet complete: device asynchrony
    assert cuda["emulated_incomplete_looks"] > 0
    if name.endswith("_offload"):  # both took the staged host step
        for res in (plain, cuda):
            assert res["stats"]["job_to_host_s"] > 0.0 and res["stats"]["job_to_device_s"] > 0.0
    if name.endswith("_fp16"):  # the planted overflows were skipped, and the scale moved
        assert plain["skipped"][-1] >= 3 and len(set(plain["scales"])) > 1, (
            plain["skipped"],
            plain["scales"],
        )


@pytest.mark.parametrize("name", list(CASES))
def test_the_cuda_paths_give_the_same_bits(results, name):
    plain, cuda = results[name], results[f"{name}_cuda"]
    assert len(plain["traj"]) == len(cuda["traj"]) == STEPS
    for t, (a, b) in enumerate(zip(plain["traj"], cuda["traj"])):
        assert torch.equal(a, b), f"{name} step {t + 1}: the parameters differ with the CUDA paths"
    for key in ("exp_avg", "exp_avg_sq"):
        for t, (a, b) in enumerate(zip(plain["moments"][key], cuda["moments"][key])):
            assert torch.equal(a, b), f"{name} step {t + 1}: {key} differs with the CUDA paths"
    assert _norms(plain) == _norms(cuda), f"{name}: the reported norms differ"
    assert plain["scales"] == cuda["scales"], f"{name}: the loss scales differ"
    assert plain["final_scale"] == cuda["final_scale"]
    assert repr(plain["final_norm"]) == repr(cuda["final_norm"])
    for r, (a, b) in enumerate(zip(plain["final_model_per_rank"], cuda["final_model_per_rank"])):
        assert torch.equal(a, b), f"{name}: rank {r}'s final parameters differ"
    for r, (ra, rb) in enumerate(zip(plain["residuals_per_rank"], cuda["residuals_per_rank"])):
        assert (ra is None) == (rb is None) and (ra is not None) == name.endswith("_int8"), (name, r)
        for t, (a, b) in enumerate(
            zip(ra or [], rb or [])
        ):  # compressed: each step's error-feedback residual
            assert a is not None and b is not None and torch.equal(a, b), (
                f"{name} rank {r} step {t + 1}: residual"
            )
    for key in ("skipped_steps", "skipped_peeks", "empty_commits", "micro_batches_committed", "rounds"):
        assert plain["stats"][key] == cuda["stats"][key], (name, key)
    assert (plain["traj"][-1] - plain["traj"][0]).abs().max() > 1e-4  # the runs moved


@pytest.mark.parametrize("name", list(CASES))
def test_deepspeed_sees_the_same_run(results, name):
    """What the engine reports per step: its skipped_steps (an fp16 skip counted at the step that swapped the
    skipped commit in) and the LR it ran (a skipped step does not advance the schedule)."""
    plain, cuda = results[name], results[f"{name}_cuda"]
    assert plain["skipped"] == cuda["skipped"], (name, plain["skipped"], cuda["skipped"])
    assert plain["lrs"] == cuda["lrs"], (name, plain["lrs"], cuda["lrs"])
