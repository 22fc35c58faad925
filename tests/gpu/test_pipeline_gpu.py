"""The pipeline on a CUDA GPU with NCCL: the side-stream executor (events, no host-wide sync)
gives the reference trajectory, and so do compressed rounds (the Triton quantizer on the side stream, the
NCCL all-to-all / all-gather where there are 2 GPUs). Skips without a GPU; scripts/gpu_checks.sh runs it when
one is lent."""

from __future__ import annotations

import pytest
import torch

from tests.core.test_trajectories import (
    CLIPS,
    COMPRESSED,
    DTYPES,
    MODES,
    UNFUSED_TWINS,
    assert_matches_reference,
    name_of,
    ref_compression,
    scenarios,
)
from tests.core.test_trajectories import (
    test_fused_round_end_gives_the_job_quantized_bits as check_fused_twin,  # not collected here under that name
)
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
# Compressed: the free-running reference with the same quantizer. A gradient element that the GPU's summation
# order moves across a rounding boundary of its block moves by one quantization step (about 1% of the block's
# largest value), which Adam turns into a parameter gap of up to about 1% of the learning rate.
GPU_COMPRESSED_TOL = {"fp32": 5e-4, "bf16": 4e-3}
GPU_COMPRESSED_MOMENT_TOL = {"fp32": 3e-2, "bf16": 5e-2}
GPU_COMPRESSED_NORM_TOL = {"fp32": 1e-2, "bf16": 2e-2}


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


@pytest.mark.parametrize("name", sorted(COMPRESSED))
def test_gpu_compressed_rounds_follow_the_reference(results, name):
    world, res = results
    mode, dtype, comp = COMPRESSED[name]
    assert_matches_reference(
        res[name],
        mode,
        dtype,
        world,
        "noclip",
        GPU_COMPRESSED_TOL[dtype],
        GPU_COMPRESSED_MOMENT_TOL[dtype],
        GPU_COMPRESSED_NORM_TOL[dtype],
        compression=ref_compression(comp, dtype),
    )
    if world > 1:  # the NCCL exchange counted fewer bytes than the same round uncompressed
        plain = res[name_of(mode, dtype, "noclip")]["stats"]["last_round_bytes_sent"]
        assert 0 < res[name]["stats"]["last_round_bytes_sent"] < plain


@pytest.mark.parametrize("name", sorted(UNFUSED_TWINS))
def test_gpu_fused_round_end_gives_the_job_quantized_bits(results, name):
    """On the GPU too: rounds quantized in their last backward's gradient hooks (Triton fold + quantize on the
    compute stream, the residual handed over by events) give the run whose jobs quantize them on the side stream,
    bit for bit."""
    check_fused_twin(results, name)
