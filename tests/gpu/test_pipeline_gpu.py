"""The pipeline on a CUDA GPU with NCCL: the side-stream executor (events, no host-wide sync)
gives the reference trajectory. Skips without a GPU; scripts/gpu_checks.sh runs it when one is lent."""

from __future__ import annotations

import pytest
import torch

from tests.core.test_trajectories import CLIPS, DTYPES, MODES, assert_matches_reference, name_of, scenarios
from tests.ranks.launch import run_scenarios

pytestmark = [
    pytest.mark.launcher,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)"),
]
# GPU kernels (matmul, reductions) sum in other orders than the CPU reference.
GPU_TOL = {"fp32": 5e-5, "bf16": 4e-3}
GPU_MOMENT_TOL = {"fp32": 1e-4, "bf16": 3e-2}
GPU_NORM_TOL = {"fp32": 1e-4, "bf16": 2e-2}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    world = min(torch.cuda.device_count(), 2)
    return world, run_scenarios(world, scenarios(world), tmp_path_factory.mktemp("gpu"), backend="nccl")


@pytest.mark.parametrize("clip", CLIPS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_matches_reference(results, mode, dtype, clip):
    world, res = results
    assert_matches_reference(
        res[name_of(mode, dtype, clip)],
        mode,
        dtype,
        world,
        clip,
        GPU_TOL[dtype],
        GPU_MOMENT_TOL[dtype],
        GPU_NORM_TOL[dtype],
    )


def test_gpu_finish_loads_committed(results):
    _, res = results
    for mode in MODES:
        r = res[name_of(mode, "fp32", "clip")]
        assert torch.equal(r["final_model"], r["traj"][-1])
