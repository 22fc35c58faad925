"""What a round end costs the training thread, bounded so it cannot creep back (``benchmarks.round_end.probe``).

The round's job (reduce-scatter, norm, AdamW, all-gather, per group) runs on the executor's worker thread (CPU) or
is enqueued by it (CUDA, the same thread class: ``core.comm``), never by the training thread; the training thread's
round end dispatches a few operations: one zeroing per group (the next gradient buffer), the norm's selection, the
fp16 round scale; with a fused compressed round end also the quantization of the blocks no fold covered (host-side
block lists and one kernel per group). No host read of a device value: fp16's minimum-scale check reads the count the
job's host summary carries, and the scaler's next state is computed by the job.

Host time is not asserted here (``python -m benchmarks.round_end`` measures it)."""

from __future__ import annotations

import pytest

from benchmarks.round_end.cli import build, drive
from benchmarks.round_end.probe import RoundEndProbe
from tests.ranks.inproc import ensure_single_rank_group

PER_GROUP = {False: 1, True: 10}  # uncompressed: the zeroing; fused: leftover quantization and its block list
FIXED = 3  # the norm's selection, the step count's fill, a view
FP16 = 8  # the round scale's copies and the host summary's minimum-scale count


@pytest.fixture(scope="module", autouse=True)
def group():
    from acco_ds.deepspeed.cpu_fp16 import allow_fp16_on_cpu

    allow_fp16_on_cpu()
    ensure_single_rank_group()


@pytest.mark.parametrize("groups", [2, 6])
@pytest.mark.parametrize("compressed", [False, True], ids=["plain", "int8-fused"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("mode", ["sync", "dpu", "acco"])
def test_the_training_thread_enqueues_a_few_operations_per_round_end(mode, dtype, compressed, groups):
    setting = {"mode": mode, "dtype": dtype, "compressed": compressed, "groups": groups}
    model, pipe = build(setting)
    probe = RoundEndProbe(pipe)
    try:
        drive(model, pipe, micro_batches=12)
        pipe.finish()
    finally:
        probe.remove()
        pipe.close()
    c = probe.counts
    assert len(c.training_ops) >= 6 and len(c.job_ops) == len(c.training_ops)
    assert all(t != probe.training_thread for t in c.job_threads), "a round's job ran on the training thread"
    bound = PER_GROUP[compressed] * groups + FIXED + (FP16 if dtype == "fp16" else 0)
    worst = max(c.training_ops, key=lambda ops: sum(ops.values()))
    assert c.max_training_ops <= bound, dict(worst)
    assert c.min_job_ops >= 10 * groups  # the job's own work, none of it on the training thread
    host_reads = [ops.get("aten._local_scalar_dense", 0) + ops.get("aten.item", 0) for ops in c.training_ops]
    assert not any(host_reads), "a round end read a device value on the host"
    assert pipe.stats.round_end_host_s > 0.0
