"""Unit tests of the core's pure pieces: the round schedule and the shard layout."""

from __future__ import annotations

import pytest
import torch

from acco_ds.core import schedule
from acco_ds.core.buffers import ALIGN, GroupLayout
from acco_ds.core.schedule import Job, RoundCounter


def test_acco_plan_alternates_peek_and_commit():
    plans = [schedule.plan("acco", r) for r in range(6)]
    assert [p.job for p in plans] == [Job.PEEK, Job.COMMIT] * 3
    assert [p.wait_previous for p in plans] == [False] + [True] * 5
    assert [p.commit_index for p in plans] == [0, 0, 1, 1, 2, 2]
    assert not any(p.wait_now for p in plans)


def test_dpu_and_sync_plans():
    assert [schedule.plan("dpu", r).wait_previous for r in range(3)] == [False, True, True]
    assert all(
        schedule.plan("sync", r).wait_now and schedule.plan("sync", r).job is Job.COMMIT for r in range(3)
    )
    with pytest.raises(ValueError, match="mode must be"):
        schedule.plan("zero", 0)


@pytest.mark.parametrize("gas", [1, 3, 7])
def test_acco_needs_even_gas(gas):
    with pytest.raises(ValueError, match="gradient_accumulation_steps must be even"):
        schedule.micro_batches_per_round("acco", gas)


def test_round_shares():
    assert schedule.micro_batches_per_round("acco", 8) == 4
    assert schedule.micro_batches_per_round("dpu", 3) == 3


def test_counter_fixed_and_adaptive():
    fixed = RoundCounter(share=2, adaptive=False)
    fixed.add()
    assert not fixed.may_end(True)
    fixed.add()
    assert fixed.may_end(False)  # fixed: ends at its share whatever the communication
    adaptive = RoundCounter(share=2, adaptive=True, cap=4)
    for _ in range(2):
        adaptive.add()
    assert not adaptive.may_end(False) and adaptive.may_end(True)
    for _ in range(2):
        adaptive.add()
    assert adaptive.may_end(False)  # the cap ends it


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("sizes", [[1], [7, 5], [278011], [3, 0, 4]])
def test_layout_shards_cover_the_flat_vector(world, sizes):
    params = [torch.zeros(n) for n in sizes]
    lay = GroupLayout.build(params, world)
    assert lay.numel == sum(sizes)
    assert lay.padded_numel % (world * ALIGN) == 0 and lay.padded_numel - lay.numel < world * ALIGN
    covered = []
    for r in range(world):
        covered.extend(lay.shard_range(r))
        real = lay.real_shard_range(r)
        assert real.start == lay.shard_range(r).start and (len(real) == 0 or real.stop <= lay.numel)
    assert covered == list(range(lay.padded_numel))
    assert sum(len(lay.real_shard_range(r)) for r in range(world)) == lay.numel
    assert list(lay.offsets) == [sum(sizes[:i]) for i in range(len(sizes))]
