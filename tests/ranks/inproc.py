"""A one-rank gloo process group inside the test process (127.0.0.1), for tests that build real
DeepSpeed engines without a launcher: config validation, kernel-free engine checks."""

from __future__ import annotations

import os

import torch.distributed as dist

from tests.ranks.launch import free_port


def ensure_single_rank_group() -> None:
    """Initialise torch.distributed with one gloo rank unless it is already initialised (then it must
    have one rank). Only LOCAL_RANK (which deepspeed.initialize requires) is set in the environment;
    the launchers started later set their own per rank."""
    if dist.is_initialized():
        assert dist.get_world_size() == 1, "the test process already belongs to a multi-rank group"
        return
    os.environ.setdefault("LOCAL_RANK", "0")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
