"""The tensor-parallel norm group's first collective happens while ``ACCOPipeline`` is built, on the device the
jobs use: NCCL creates a group's communicator at its first collective, which must not be a round job's norm
all-reduce on the side stream while the compute side runs tensor-parallel collectives on DeepSpeed's group.

One rank in this process stands for a tensor-parallel rank of two: the pipeline's view of ``torch.distributed``
says the tensor-parallel group has two ranks, and its norm and control groups are real one-rank gloo groups; a spy
records every ``all_reduce`` the pipeline issues itself. (The real two-rank runs are tests/deepspeed/
test_tensor_parallel.py, launched.)"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from acco_ds.config import ACCOConfig
from acco_ds.core import pipeline as pipeline_module
from acco_ds.ops.adamw_settings import AdamWSettings
from tests.ranks.inproc import ensure_single_rank_group

FAKE_TP = object()
"""The tensor-parallel group the pipeline is given (two ranks, as its view of torch.distributed says)."""


class _Dist:
    """torch.distributed as the pipeline sees it: FAKE_TP has two ranks; every all_reduce is recorded."""

    def __init__(self, calls):
        self.calls = calls

    def __getattr__(self, name):
        return getattr(dist, name)

    def get_world_size(self, group=None):
        return 2 if group is FAKE_TP else dist.get_world_size(group)

    def get_rank(self, group=None):
        return 0 if group is FAKE_TP else dist.get_rank(group)

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        self.calls.append(("all_reduce", group, tensor.device))
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def _one_rank_group(timeout_s):
    return dist.new_group(ranks=[0], backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def test_the_norm_groups_first_collective_is_in_init(monkeypatch):
    ensure_single_rank_group()
    calls, made = [], {}
    new_subgroup, make_control_group = pipeline_module.new_subgroup, pipeline_module.make_control_group

    def spy_new_subgroup(group, backend, timeout_s):
        if group is not FAKE_TP:
            return new_subgroup(group, backend, timeout_s)
        made["norm"] = _one_rank_group(timeout_s)
        calls.append(("created", made["norm"], None))
        return made["norm"]

    def spy_control_group(group, timeout_s):
        return _one_rank_group(timeout_s) if group is FAKE_TP else make_control_group(group, timeout_s)

    monkeypatch.setattr(pipeline_module, "dist", _Dist(calls))
    monkeypatch.setattr(pipeline_module, "new_subgroup", spy_new_subgroup)
    monkeypatch.setattr(pipeline_module, "make_control_group", spy_control_group)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(37)), torch.nn.Parameter(torch.randn(5))]
    cfg = ACCOConfig(mode="dpu")
    pipe = pipeline_module.ACCOPipeline(
        [params], lambda: [AdamWSettings(1e-3, 0.9, 0.999, 1e-8, 0.0)], cfg, 2, 0.0, tp_group=FAKE_TP
    )
    try:
        assert pipe.tp_norm_group is made["norm"]
        on_norm = [i for i, (what, group, _) in enumerate(calls) if group is pipe.tp_norm_group]
        assert on_norm, "the tensor-parallel norm group was built without a collective"
        created, first = on_norm[0], on_norm[1] if len(on_norm) > 1 else None
        assert calls[created][0] == "created"
        assert first is not None, "the norm group's first collective is left to a round job"
        assert calls[first][0] == "all_reduce" and calls[first][2] == pipe.device, calls[first]
    finally:
        pipe.close()
