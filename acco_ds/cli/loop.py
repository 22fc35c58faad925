"""The per-rank training loops (the unchanged DeepSpeed loop, fixed or adaptive accumulation).

Contracts:
- ``train_fixed``: exactly ``steps * grad_accum`` micro-batches, ``loss = engine(x, y);
  engine.backward(loss); engine.step()`` each. Used for the DeepSpeed baselines and for ACCO with
  fixed accumulation.
- ``train_adaptive``: ACCO with adaptive accumulation: pulls micro-batches from the endless
  per-rank iterator while ``engine.optimizer.committed_steps < steps``, so a fast rank computes
  more micro-batches than a slow one (and every rank computes while the link is busy).
Both are ``train`` (``adaptive`` or not). Every loop calls ``spinner.spin()`` after each micro-batch
(the controlled slowdown), feeds the ``StepLog`` and the progress bar, calls ``on_step(step)`` (when
given) each time an optimizer step completes, and returns the seconds since ``start`` (a perf_counter value taken
by the caller right after the ranks' barrier), less the seconds ``on_step`` returned (what it spent that is not
training: acco-train's evaluations; None counts as 0); every time the loop records counts the same way. A resumed
run passes ``done``, the steps its checkpoint holds: the loops run the ``steps - done`` steps left.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

from acco_ds.cli.progress import Progress
from acco_ds.cli.slowdown import Spinner
from acco_ds.cli.steplog import StepLog


def step_counter(engine) -> Callable[[], int]:
    """Optimizer steps done: committed steps for ACCO, DeepSpeed's global steps otherwise."""
    opt = engine.optimizer
    if hasattr(opt, "committed_steps"):
        return lambda: int(opt.committed_steps)
    return lambda: int(engine.global_steps)


def committed_samples(engine, micro_batch: int, world: int, grad_accum: int, step: int) -> int:
    """Global samples in the committed steps (ACCO: its own count; DeepSpeed: steps x batch)."""
    opt = engine.optimizer
    if hasattr(opt, "stats"):
        return int(opt.stats()["micro_batches_committed"]) * micro_batch
    return step * grad_accum * micro_batch * world


def _micro(engine, batch, device) -> float:
    x, y = (t.to(device, non_blocking=True) for t in batch)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    return float(loss.detach().float().item())


def train(
    engine,
    batches: Iterator,
    steps: int,
    grad_accum: int,
    micro_batch: int,
    world: int,
    log: StepLog,
    bar: Progress,
    spinner: Spinner,
    start: float,
    done: int = 0,
    on_step: Callable[[int], None] | None = None,
    adaptive: bool = False,
) -> float:
    """The loop of both accumulations: fixed, exactly ``(steps - done) * grad_accum`` micro-batches; ``adaptive``,
    micro-batches until ``steps`` optimizer steps are done. A step is reported once the count passes the last one
    reported (fixed: the log's last step; adaptive: the loop's own, from ``done``)."""
    count = step_counter(engine)
    step, left = done, (steps - done) * grad_accum
    while step < steps if adaptive else left > 0:
        left -= 1
        log.micro(_micro(engine, next(batches), engine.device))
        spinner.spin()
        new = count()
        if new > (step if adaptive else log.last_step):
            step = new
            now = time.perf_counter() - start
            samples = committed_samples(engine, micro_batch, world, grad_accum, step)
            log.step(step, now)
            bar.update(step, log.recent_loss(), samples, now)
            if on_step is not None:
                # the clock leaves out what on_step says it spent outside training
                start += on_step(step) or 0.0
    return time.perf_counter() - start


def train_fixed(engine, batches: Iterator, **kw) -> float:
    """``train`` with fixed accumulation (``kw``: its settings)."""
    return train(engine, batches, adaptive=False, **kw)


def train_adaptive(engine, batches: Iterator, **kw) -> float:
    """``train`` with ACCO's adaptive accumulation (``kw``: its settings)."""
    return train(engine, batches, adaptive=True, **kw)
