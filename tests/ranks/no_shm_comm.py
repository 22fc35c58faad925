"""DeepSpeed without its CPU shared-memory communication op in the processes the suite starts.

DeepSpeed's CPU accelerator builds ``deepspeed_shm_comm`` at every ``init_distributed`` (``TorchBackend`` calls
``deepspeed.comm.torch.build_shm_op``): a JIT compile once per environment, a load in every
rank, and, when ``LOCAL_SIZE`` equals the world size (DeepSpeed's launcher, ``tests/ranks/launch.run_local``), a
69 MB buffer written to /dev/shm by each rank, which then polls until it can open every peer's. The op serves only
``inference_all_reduce`` (AutoTP's row-parallel layers in eval mode); without it DeepSpeed takes torch.distributed's
``all_reduce`` there, as it always does on CUDA, whose accelerator has no such op. Training never calls it.

:func:`install` makes ``build_shm_op`` answer None in this process, now if ``deepspeed.comm.torch`` is imported and
at its import otherwise (a finder first on ``sys.meta_path``: the start-up hook runs before anything imports
DeepSpeed, and importing it here would make every process that never uses it pay for the import). Only the tests use it,
when ``ACCO_DS_TEST_NO_SHM_COMM=1`` (tests/conftest.py sets it for the session): the product and its users' runs keep
DeepSpeed as it is.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

ENV = "ACCO_DS_TEST_NO_SHM_COMM"
MODULE = "deepspeed.comm.torch"


def no_shm_op():
    """``build_shm_op``'s answer where the op is not available: None (``TorchBackend`` then skips it)."""
    return None


def _patch(module) -> None:
    module.build_shm_op = no_shm_op


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``deepspeed.comm.torch`` as the path finder does and patches it once its loader has run it."""

    def find_spec(self, fullname, path, target=None):
        if fullname != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> bool:
    """With ``ACCO_DS_TEST_NO_SHM_COMM=1``: ``build_shm_op`` answers None in this process (idempotent). False, and
    nothing changed, otherwise."""
    if os.environ.get(ENV) != "1":
        return False
    if MODULE in sys.modules:
        _patch(sys.modules[MODULE])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    return True
