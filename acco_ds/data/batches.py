"""Deterministic micro-batches of byte windows.

Contract: micro-batch ``i`` of rank ``r`` under seed ``s`` is a pure function of (s, r, i, the
data): ``micro_batch`` draws ``batch`` random window offsets from a generator seeded with
(s, r, i). So every contender of a comparison (ZeRO-1, ACCO, ...) sees exactly the same samples
in the same order on each rank, whether it pulls a fixed number of micro-batches or an endless
stream (``stream``). Validation windows are fixed, non-overlapping and sharded across ranks.
"""

from __future__ import annotations

from typing import Iterator, Tuple

import torch

Batch = Tuple[torch.Tensor, torch.Tensor]


def _seed(seed: int, rank: int, index: int) -> int:
    # distinct, well-spread 63-bit seeds for each (seed, rank, index)
    return (seed * 1_000_003 + rank * 7_919 + index * 104_729 + 0x5DEECE66D) % (2**63 - 1)


def micro_batch(data: torch.Tensor, context: int, batch: int, seed: int, rank: int, index: int) -> Batch:
    """(x, y) int64 tensors of shape (batch, context); y is x shifted by one byte."""
    if data.numel() < context + 2:
        raise ValueError(f"the data holds {data.numel()} tokens, fewer than context+2={context + 2}")
    gen = torch.Generator().manual_seed(_seed(seed, rank, index))
    offsets = torch.randint(0, data.numel() - context - 1, (batch,), generator=gen)
    idx = offsets[:, None] + torch.arange(context + 1)[None, :]
    windows = data[idx].long()
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def stream(
    data: torch.Tensor, context: int, batch: int, seed: int, rank: int, start: int = 0
) -> Iterator[Batch]:
    """Endless iterator over micro-batches start, start+1, ... of ``rank``."""
    index = start
    while True:
        yield micro_batch(data, context, batch, seed, rank, index)
        index += 1


def val_windows(data: torch.Tensor, context: int, count: int, rank: int, world: int) -> Batch:
    """This rank's share of ``count`` fixed validation windows (evenly spaced, non-overlapping when
    the data is long enough). Windows j with j % world == rank go to ``rank``."""
    span = context + 1
    if data.numel() < span:
        raise ValueError(f"validation data holds {data.numel()} tokens, fewer than context+1={span}")
    count = max(1, count)
    stride = max(1, (data.numel() - span) // count)
    starts = torch.arange(count) * stride
    mine = starts[rank::world]
    idx = mine[:, None] + torch.arange(span)[None, :]
    windows = data[idx].long()
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
