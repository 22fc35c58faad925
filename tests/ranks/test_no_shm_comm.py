"""tests/ranks/no_shm_comm.py: the suite's processes run DeepSpeed without its CPU shared-memory communication op
(neither built, nor loaded, nor a /dev/shm buffer per rank), and without the variable DeepSpeed is left as it is."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

from acco_ds.cli import launch as cli_launch
from tests.ranks import no_shm_comm
from tests.ranks.launch import free_port

# importlib, not ``import deepspeed.comm.torch as t``: deepspeed.comm's ``torch`` attribute is the torch package
PROBE = "import importlib; t = importlib.import_module('deepspeed.comm.torch'); print(t.build_shm_op.__module__, {})"


def _python(code: str, **env) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], env=dict(os.environ, **env), capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_this_process_and_the_ones_it_starts_have_no_shm_op():
    import importlib

    backend = importlib.import_module(no_shm_comm.MODULE)
    assert os.environ[no_shm_comm.ENV] == "1"  # tests/conftest.py
    assert backend.build_shm_op is no_shm_comm.no_shm_op
    assert _python(PROBE.format("t.build_shm_op()")) == "tests.ranks.no_shm_comm None"


def test_without_the_variable_deepspeed_keeps_its_op():
    assert _python(PROBE.format("''"), **{no_shm_comm.ENV: "0"}) == "deepspeed.comm.torch"


def test_ranks_on_one_node_map_no_shm_buffer():
    """Two gloo ranks with ``LOCAL_SIZE`` = the world size (DeepSpeed's op would write a buffer each there) start
    through ``deepspeed.init_distributed``, sum a tensor and leave no /dev/shm buffer behind."""
    port = free_port()
    code = (
        "import deepspeed, torch, torch.distributed as dist; deepspeed.init_distributed(dist_backend='gloo'); "
        "x = torch.ones(3); dist.all_reduce(x); print(int(x.sum())); "
        # as torch asks: a gloo process that exits with its group alive may abort in its teardown (SIGABRT,
        # "terminate called without an active exception"), seen once in a fresh-clone suite run
        "dist.destroy_process_group()"
    )
    base = dict(os.environ, WORLD_SIZE="2", LOCAL_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env=dict(base, RANK=str(r), LOCAL_RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
        for p, (out, err) in zip(procs, outs):
            assert p.returncode == 0, err[-3000:]
            assert out.strip().splitlines()[-1] == "6"
        assert glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_*") == []
    finally:
        for p in procs:
            p.kill()
        cli_launch.cleanup_shm(port, 2)
