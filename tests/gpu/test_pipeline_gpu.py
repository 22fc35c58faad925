"""The pipeline on a CUDA GPU with NCCL: the side-stream executor (events, no host-wide sync)
gives the reference trajectory, and so do compressed rounds (the Triton quantizer on the side stream, the
NCCL all-to-all / all-gather where there are 2 GPUs). Skips without a GPU; scripts/gpu_checks.sh runs it when
one is lent."""

from __future__ import annotations

import pytest
import torch

from tests.core import test_fp16_trajectories as fp16
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


# fp16 with dynamic loss scaling and planted overflows (tests/core/test_fp16_trajectories.py): every mode, and
# compressed rounds under a moving scale; in the same launch
FP16_RUNS = [f"{m}_noclip" for m in fp16.MODES] + ["acco_int8"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    world = min(torch.cuda.device_count(), 2)
    plans = scenarios(world) + [sc for sc in fp16.scenarios(world) if sc["name"] in FP16_RUNS]
    return world, run_scenarios(world, plans, tmp_path_factory.mktemp("gpu"), backend="nccl")


@pytest.mark.parametrize("name", FP16_RUNS)
def test_gpu_fp16_matches_reference(results, name):
    """fp16 on the GPU: the loss scale on the device, the side stream's jobs unscaling each round by its own
    scale; the loss scale and skipped steps per step are the reference's exactly, the rest within the GPU's
    rounding (the reference computes at the fp16 parameters in fp32)."""
    world, res = results
    if name in fp16.COMPRESSED:
        mode, comp = fp16.COMPRESSED[name]
        ref = fp16.reference(mode, world, "noclip", fp16.ref_compression(comp))
        tol = (GPU_COMPRESSED_TOL["fp32"], GPU_COMPRESSED_MOMENT_TOL["fp32"], GPU_COMPRESSED_NORM_TOL["fp32"])
    else:
        mode = name.split("_")[0]
        ref = fp16.reference(mode, world, "noclip")
        tol = (GPU_TOL["bf16"], GPU_MOMENT_TOL["bf16"], GPU_NORM_TOL["bf16"])
    fp16.assert_matches(res[name], ref, mode, f"{name} on the GPU, W={world}", tol=tol)


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
