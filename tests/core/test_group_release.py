"""Closing an engine's pipeline releases the gloo process groups it created (``core.comm.release_groups``).

Every gloo group has a device of its own with an event-loop thread that wakes every 10 ms; a process that builds
engine after engine (the suite's multi-job ranks, a hyper-parameter sweep in one process) kept all of them: 96 loop
threads per rank after 48 engines. Here, in a one-rank gloo job in the test process:

- after ``pipeline.close()`` the pipeline's groups are gone from torch's group map and its references to them are
  dropped, and the gloo loop threads are back to their count before the engine;
- engine after engine, closed by ``engine.destroy()`` (DeepSpeed's teardown) or ``pipeline.close()``, the count
  stays there;
- a pipeline whose worker thread is still running, or a process that saw a failed round, keeps its groups (a
  collective may still run on them); a group already destroyed is skipped.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch.distributed as dist

from acco_ds.core import comm


def _loop_threads() -> int:
    """The gloo event-loop threads of this process (torch names them ``gloo_tcp_loop``)."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                n += f.read().strip() == "gloo_tcp_loop"
        except OSError:  # the thread ended while we looked
            pass
    return n


def _engine(mode: str = "acco"):
    deepspeed = pytest.importorskip("deepspeed")
    import acco_ds  # noqa: F401  (registers "ACCO")
    from tests.ranks import toy
    from tests.ranks.inproc import ensure_single_rank_group

    ensure_single_rank_group()
    cfg = {
        "train_micro_batch_size_per_gpu": toy.MICRO_BATCH,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "ACCO", "params": {"mode": mode}},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
    }
    model = toy.build()
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    for j in range(4):
        engine.backward(engine(*toy.micro_batch(0, j)))
        engine.step()
    engine.optimizer.finish()
    return engine


def _settle() -> int:
    gc.collect()
    return _loop_threads()


@pytest.fixture(autouse=True)
def clean_process(monkeypatch):
    """As in a process that saw no failed round (an earlier test in this process may have planted one)."""
    monkeypatch.setattr(comm, "_SAW_COMM_FAILURE", False)


@pytest.fixture
def warm(clean_process):
    """One engine built and closed first: the default group and DeepSpeed's own (cached) groups exist, so that
    the counts below are the pipeline's alone."""
    _engine().optimizer.pipeline.close()


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")


@needs_proc
@pytest.mark.parametrize("mode", ["acco", "dpu"])
def test_close_releases_the_groups_and_their_loop_threads(warm, mode):
    before = _settle()
    engine = _engine(mode)
    pipe = engine.optimizer.pipeline
    groups = [pipe.executor.group, pipe.control_group]
    assert all(g in dist.distributed_c10d._world.pg_map for g in groups)
    assert _loop_threads() >= before + 2  # one loop per gloo group the pipeline made
    pipe.close()
    assert not any(g in dist.distributed_c10d._world.pg_map for g in groups)
    assert pipe.executor.group is None and pipe.control_group is None
    del groups, pipe, engine
    assert _settle() == before


@needs_proc
def test_engine_after_engine_keeps_the_loop_threads_flat(warm):
    """Closed by ``engine.destroy()``, DeepSpeed's teardown (``ACCOZeroOptimizer.destroy``), or the pipeline's own
    ``close``."""
    before = _settle()
    for k in range(4):
        engine = _engine()
        if k % 2:
            engine.destroy()
        else:
            engine.optimizer.pipeline.close()
        assert engine.optimizer.pipeline.control_group is None
        engine.optimizer.destroy()  # again: nothing left to release
        del engine
        assert _settle() == before


def test_groups_still_in_use_or_after_a_failure_are_kept(monkeypatch):
    from tests.ranks.inproc import ensure_single_rank_group

    ensure_single_rank_group()
    group = comm.new_subgroup(None, "gloo", 30.0)
    try:
        assert comm.release_groups([group], busy=True) is False
        monkeypatch.setattr(comm, "_SAW_COMM_FAILURE", True)
        assert comm.release_groups([group]) is False
        assert group in dist.distributed_c10d._world.pg_map
        monkeypatch.setattr(comm, "_SAW_COMM_FAILURE", False)
        assert comm.release_groups([None, group]) is True
        assert group not in dist.distributed_c10d._world.pg_map
        assert comm.release_groups([group]) is True  # already destroyed: skipped
    finally:
        if group in dist.distributed_c10d._world.pg_map:
            dist.destroy_process_group(group)
