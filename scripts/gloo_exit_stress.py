"""How often a two-rank gloo job aborts at exit, with and without acco_ds's exit hook.

Each run starts two ranks on 127.0.0.1 that do 50 async all-gathers and exit right after the last one. Without
the hook, torch's gloo worker threads may drop their last reference to a finished collective's tensors while
the interpreter finalises and abort the process (SIGABRT, "terminate called without an active exception").

    python scripts/gloo_exit_stress.py --runs 30
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import textwrap

RANK = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    if sys.argv[1] == "hook":
        import acco_ds.core.comm  # noqa: F401  (registers the exit hook)
    dist.init_process_group("gloo")
    for i in range(50):
        x = torch.randn(1000 + i)
        out = torch.empty(2 * x.numel())
        dist.all_gather_into_tensor(out, x, async_op=True).wait()
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(variant: str) -> bool:
    """True when both ranks exited with status 0."""
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
        procs.append(
            subprocess.Popen([sys.executable, "-c", RANK, variant], env=env, stderr=subprocess.DEVNULL)
        )
    return all(p.wait(timeout=300) == 0 for p in procs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=30)
    args = ap.parse_args()
    for variant in ("plain", "hook"):
        failed = sum(not one_run(variant) for _ in range(args.runs))
        print(f"{variant:5s}: {failed} of {args.runs} runs aborted at exit")


if __name__ == "__main__":
    main()
