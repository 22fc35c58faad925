"""Controlled slowdown of one rank (heterogeneous workers), by real extra compute.

Contract: ``Spinner(extra_s).spin()`` keeps the calling thread busy with small matrix products
for ``extra_s`` seconds (wall clock, measured with perf_counter); it never sleeps, so the rank
really computes longer, as a slower device would. ``calibrate`` measures the median time of one
micro-batch (forward + backward) of a model, to turn a slow factor into seconds.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Callable, Iterable

import torch


class Spinner:
    def __init__(self, extra_s: float):
        if extra_s < 0:
            raise ValueError(f"extra compute per micro-batch must be >= 0 s, got {extra_s}")
        self.extra_s = float(extra_s)
        self._a = torch.randn(64, 64)
        self.total_s = 0.0

    def spin(self) -> None:
        if self.extra_s <= 0:
            return
        start = time.perf_counter()
        deadline = start + self.extra_s
        a = self._a
        while time.perf_counter() < deadline:
            a = torch.tanh(a @ self._a)
        self.total_s += time.perf_counter() - start


def calibrate(model: torch.nn.Module, batches: Iterable, step: Callable, reps: int = 5) -> float:
    """Median seconds of ``step(model_copy, batch)`` (forward + backward) over ``reps`` batches after
    one warm-up, on a deep copy of ``model`` so the trained model is untouched."""
    probe = copy.deepcopy(model)
    times = []
    for i, batch in enumerate(batches):
        t = time.perf_counter()
        step(probe, batch)
        if i > 0:
            times.append(time.perf_counter() - t)
        if len(times) >= reps:
            break
    del probe
    return statistics.median(times)
