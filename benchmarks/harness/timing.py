"""Timing of collectives, shared by the comm-only probes (``benchmarks.ranks.comm_probe`` and
``benchmarks.ranks.topology_comm_probe``).

Contract:
- ``timed_calls(fn, reps)``: seconds per call of ``fn`` run back to back, from a barrier to a
  barrier after ``reps`` calls, the median of 3 such windows after one warm-up call. A send
  completes when the kernel has buffered the bytes, not when they crossed the link; timing a lone
  call would under-count them, timing a run of calls that ends with a barrier counts every byte.
- ``round_timings(rs, ar, ag, p2p, reps)``: one round's communication timed that way: the
  gradient reductions (the backend's reduce-scatter ``rs``, all-reduce ``ar``, acco_ds's
  point-to-point reduce-scatter ``p2p``), the parameter all-gather ``ag`` and each reduction
  followed by the all-gather: ``{"rs_s", "ar_s", "ag_s", "rs_ag_s", "ar_ag_s", "p2p_s",
  "p2p_ag_s"}`` in seconds per call. ``p2p`` raising ImportError (an acco_ds without that
  function) leaves its two keys out and records ``p2p_error``; the others still stand.
- ``probe_round(numel, dtype, device, group, reps)``: those timings for a flat gradient of
  ``numel`` elements on ``group``, with the buffers' size; ``write_on_rank0(res, path)`` saves them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist


def timed_calls(fn: Callable[[], object], reps: int) -> float:
    """Seconds per call of ``fn``, barrier to barrier (see the module docstring)."""
    fn()  # warm-up
    dist.barrier()
    windows = []
    for _ in range(3):
        dist.barrier()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        dist.barrier()
        windows.append((time.perf_counter() - t) / reps)
    return statistics.median(windows)


def round_timings(rs: Callable, ar: Callable, ag: Callable, p2p: Callable, reps: int) -> dict:
    """The seven timings of one round's communication (see the module docstring)."""
    res = {
        "rs_s": timed_calls(rs, reps),
        "ar_s": timed_calls(ar, reps),
        "ag_s": timed_calls(ag, reps),
        "rs_ag_s": timed_calls(lambda: (rs(), ag()), reps),
        "ar_ag_s": timed_calls(lambda: (ar(), ag()), reps),
    }
    try:
        res["p2p_s"] = timed_calls(p2p, reps)
        res["p2p_ag_s"] = timed_calls(lambda: (p2p(), ag()), reps)
    except ImportError as err:
        res["p2p_error"] = str(err)
    return res


def probe_round(numel: int, dtype: str, device: torch.device, group, reps: int) -> dict:
    """One round's communication on ``group`` (``dist.group.WORLD`` or a data-parallel group),
    timed by ``round_timings``: a flat gradient of ``numel`` elements (rounded up to a multiple of the
    group's size) in ``dtype`` ("fp32" or "bf16") on ``device``, reduced and its shard all-gathered
    (CUDA work synchronised inside each call). Returns ``{"numel", "dtype", "bytes", <timings>}``."""
    size = dist.get_world_size(group)
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    n = -(-numel // size) * size
    grad = torch.randn(n, dtype=torch_dtype, device=device)
    shard = torch.empty(n // size, dtype=torch_dtype, device=device)
    full = torch.empty(n, dtype=torch_dtype, device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def rs() -> None:
        dist.reduce_scatter_tensor(shard, grad, group=group)
        sync()

    def ar() -> None:
        dist.all_reduce(grad, group=group)
        sync()

    def p2p() -> None:
        from acco_ds.core.round_job import reduce_scatter_inplace

        reduce_scatter_inplace(grad, group)  # overwrites this rank's slice: fine for timing
        sync()

    def ag() -> None:
        dist.all_gather_into_tensor(full, shard, group=group)
        sync()

    timings = round_timings(rs, ar, ag, p2p, reps)
    return {"numel": n, "dtype": dtype, "bytes": n * grad.element_size(), **timings}


def write_on_rank0(res: dict, path: str) -> None:
    """Rank 0 writes ``res`` as JSON to ``path``; every rank then waits at a barrier."""
    if dist.get_rank() == 0:
        with open(path, "w") as fh:
            json.dump(res, fh, indent=2)
    dist.barrier()


def probe_options(ap: argparse.ArgumentParser) -> None:
    """The options both comm-only probes take: ``--dtype``, ``--reps``, ``--out`` and the
    launcher's ``--local_rank``."""
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", required=True)
    ap.add_argument("--local_rank", type=int, default=0)
