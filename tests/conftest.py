"""Session set-up for the test suite.

The tests that build DeepSpeed engines inside the pytest process (one gloo rank) mean CPU: DeepSpeed's
accelerator is fixed to the CPU one before DeepSpeed is first imported, so on a machine with a GPU they run as
here (without it DeepSpeed would pick CUDA and put those engines on the GPU). Launched ranks get their own
environment from ``tests/launch.rank_env`` (CPU, or CUDA for the GPU tests). ``torch.cuda`` itself stays
visible to this process: the GPU kernel tests use it directly.
"""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import contextlib  # noqa: E402
import glob  # noqa: E402

import pytest  # noqa: E402

_SHM_PATTERN = "/dev/shm/deepspeed_allreduce_buffer_*"
_SHM_AT_START = set(glob.glob(_SHM_PATTERN))


@pytest.fixture(autouse=True)
def _remove_deepspeed_shm_buffers():
    """DeepSpeed's CPU communication op creates a 69 MB shared-memory buffer per rank
    (``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``) and never unlinks it: each
    launch of the suite would leave its ranks' buffers in RAM (gigabytes over a run). Every test's
    launched ranks have exited when it returns (also those of module-scoped fixtures, which launch
    before this fixture starts): remove every buffer that appeared since the session started
    (unlinking one an in-process engine still maps leaves its mapping valid)."""
    yield
    for path in set(glob.glob(_SHM_PATTERN)) - _SHM_AT_START:
        with contextlib.suppress(OSError):
            os.unlink(path)
