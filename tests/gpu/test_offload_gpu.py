"""Optimizer offload on a CUDA GPU with NCCL (``core.host_step``): the master shard and moments in host memory, the
round's job copying the step's inputs to the host on the side stream, stepping them with the CPU kernels and copying
the new parameters back. The CPU and CUDA AdamW kernels share one math, so every mode with offload gives the bits
of the same mode without it. Skips without a GPU; scripts/gpu_checks.sh runs it when one is lent."""

from __future__ import annotations

import pytest
import torch

from tests.deepspeed.test_offload import PAIRS, pair_scenarios
from tests.ranks.launch import run_scenarios

pytestmark = [
    pytest.mark.launcher,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)"),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    world = min(torch.cuda.device_count(), 2)
    plans = pair_scenarios()
    return world, run_scenarios(world, plans, tmp_path_factory.mktemp("gpu_offload"), backend="nccl")


@pytest.mark.parametrize("name", list(PAIRS))
def test_gpu_offload_gives_the_bits_of_the_gpu_step(results, name):
    _, res = results
    plain, off = res[name], res[f"{name}_off"]
    for t, (a, b) in enumerate(zip(plain["traj"], off["traj"])):
        assert torch.equal(a, b), f"{name} step {t + 1}: max |diff| {(a - b).abs().max().item():.3e}"
    assert plain["norms"] == off["norms"]
    for key in ("exp_avg", "exp_avg_sq"):
        for t, (a, b) in enumerate(zip(plain["moments"][key], off["moments"][key])):
            assert torch.equal(a.cpu(), b.cpu()), f"{name} {key} step {t + 1}"
    assert off["stats"]["job_to_host_s"] > 0.0 and off["stats"]["job_to_device_s"] > 0.0
    assert plain["stats"]["job_to_host_s"] == 0.0
