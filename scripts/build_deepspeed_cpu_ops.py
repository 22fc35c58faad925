"""Builds DeepSpeed's two CPU Adam ops ahead of their first use, as their first use would (JIT, torch's extension
loader, into ``TORCH_EXTENSIONS_DIR``):

- ``fused_adam``: the AdamW of DeepSpeed's own ZeRO-1 on the CPU accelerator (``"type": "AdamW"``), the baseline
  the tests compare ``sync`` with and the main job's ZeRO-1 run trains with;
- ``cpu_adam``: ZeRO-Offload's DeepSpeedCPUAdam.

Each is a compile of about a minute and a half of CPU time. ``scripts/setup_env.sh`` runs this in the background
while the rest of the environment installs (one pip process leaves a core idle), so that neither the first test
nor the main job waits for it. Only for the CPU accelerator (``DS_ACCELERATOR=cpu`` is set here): DeepSpeed's CUDA
ops are other builds, left to their first use. Exit status 0 when both load; 1 naming the op that did not build
(its first use then builds it again and fails there with the compiler's output).
"""

from __future__ import annotations

import os
import sys
import time

OPS = ("FusedAdamBuilder", "CPUAdamBuilder")


def main() -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    if accel.device_name() != "cpu":
        print(
            f"build_deepspeed_cpu_ops: the accelerator is {accel.device_name()!r}, not the CPU: nothing built"
        )
        return 0
    failed = []
    for name in OPS:
        t0 = time.perf_counter()
        try:
            accel.create_op_builder(name).load(verbose=False)
        except Exception as err:  # the op's first use builds it again and reports the compiler's output
            failed.append(f"{name}: {type(err).__name__}: {err}")
            continue
        print(f"build_deepspeed_cpu_ops: {name} ready in {time.perf_counter() - t0:.0f} s")
    for line in failed:
        print(f"build_deepspeed_cpu_ops: did not build {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
