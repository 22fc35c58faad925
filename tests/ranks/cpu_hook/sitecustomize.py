"""Start-up hook of the CPU test ranks: hides CUDA from a rank before anything imports torch.

``tests/ranks/launch.rank_env()`` puts this folder first on PYTHONPATH and sets ``ACCO_DS_TEST_HIDE_CUDA=1`` for
ranks that mean CPU (gloo). The ``deepspeed`` launcher sets ``CUDA_VISIBLE_DEVICES=0,...,W-1`` in every rank,
even with ``DS_ACCELERATOR=cpu``, so on a machine with one GPU the ranks would see it (accelerate and the HF
Trainer then pick NCCL and cuda:<local_rank>, which does not exist for rank 1). Python imports
``sitecustomize`` at start-up; this one empties ``CUDA_VISIBLE_DEVICES`` and then runs the next
``sitecustomize`` on the path, if any, so an environment's own hook still runs.

With ``ACCO_DS_TEST_CPU_ACCELERATE_SHIM=1`` as well, a rank (a process with ``LOCAL_RANK`` set) also applies
``tests/ranks/cpu_accelerate_shim.py`` at start-up: the HF Trainer then counts DeepSpeed's gloo ranks on a
CPU-only machine in a script that cannot call the shim itself (an unmodified training script,
tests/integrations/test_unmodified_scripts.py).

With ``ACCO_DS_TEST_CPU_FP16=1`` a rank also lifts DeepSpeed's CPU-accelerator refusal of fp16 at start-up
(``acco_ds.deepspeed.cpu_fp16.allow_fp16_on_cpu``: this CPU has no mkldnn fp16 kernels, torch computes fp16
without them), so an fp16 run under the HF Trainer or accelerate needs no line of its own for it.

With ``ACCO_DS_TEST_CPUINFO_CACHE`` set (tests/conftest.py sets it and puts this folder on the session's PYTHONPATH,
so every process the suite starts runs this hook), DeepSpeed's CPU probe is answered from one file per machine
(``tests/ranks/cpuinfo_cache.py``) instead of a fresh interpreter per op load; with ``ACCO_DS_TEST_NO_SHM_COMM=1``
(tests/conftest.py sets it too) DeepSpeed's CPU shared-memory communication op is neither built nor loaded
(``tests/ranks/no_shm_comm.py``).
"""

import importlib.machinery
import importlib.util
import os
import sys


def _hide_cuda() -> None:
    if os.environ.get("ACCO_DS_TEST_HIDE_CUDA") == "1":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


def apply_rank_hooks() -> None:
    """What the variables above ask of a starting process (each idempotent; a rank forked by
    tests/ranks/forked_ranks.py calls it again once it has its own environment)."""
    _hide_cuda()

    if os.environ.get("ACCO_DS_TEST_CPU_ACCELERATE_SHIM") == "1" and "LOCAL_RANK" in os.environ:
        from tests.ranks import cpu_accelerate_shim

        cpu_accelerate_shim.apply()

    if os.environ.get("ACCO_DS_TEST_CPU_FP16") == "1" and "LOCAL_RANK" in os.environ:
        from acco_ds.deepspeed.cpu_fp16 import allow_fp16_on_cpu

        allow_fp16_on_cpu()

    if os.environ.get("ACCO_DS_TEST_CPUINFO_CACHE"):
        try:
            from tests.ranks import cpuinfo_cache
        except ImportError:  # a process started outside the repository: DeepSpeed probes as it always does
            pass
        else:
            cpuinfo_cache.install()

    if os.environ.get("ACCO_DS_TEST_NO_SHM_COMM") == "1":
        try:
            from tests.ranks import no_shm_comm
        except ImportError:  # a process started outside the repository: DeepSpeed as it is
            pass
        else:
            no_shm_comm.install()


_hide_cuda()  # before the next hook on the path, which may import torch
_chain()
apply_rank_hooks()
