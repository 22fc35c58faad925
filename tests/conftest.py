"""Session set-up for the test suite.

The tests that build DeepSpeed engines inside the pytest process (one gloo rank) mean CPU: DeepSpeed's
accelerator is fixed to the CPU one before DeepSpeed is first imported, so on a machine with a GPU they run as
here (without it DeepSpeed would pick CUDA and put those engines on the GPU). Launched ranks get their own
environment from ``tests/launch.rank_env`` (CPU, or CUDA for the GPU tests). ``torch.cuda`` itself stays
visible to this process: the GPU kernel tests use it directly.
"""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
