"""ACCO's figures in DeepSpeed's monitor section (TensorBoard, CSV, W&B, Comet).

DeepSpeed's engine writes ``Train/Samples/lr`` itself (rank 0, at each accumulation boundary,
x = samples seen). With ``"type": "ACCO"`` and ``"monitor"`` (e.g. ``"csv_monitor": {"enabled":
true, ...}``) enabled, the optimizer's ``step()`` adds, through the same ``engine.monitor`` and with
the same x axis (the engine's ``global_samples`` once this step is counted):

- ``Train/Samples/train_loss``: rank 0's mean loss over the step's micro-batches (the sum of the
  losses ``engine.backward`` received, which it divides by gradient_accumulation_steps).
- ``Train/Samples/grad_norm``: the global norm of the averaged, unclipped gradient of the last
  commit that has finished (in acco/dpu the commit of the previous step is the last one finished
  when the engine steps).
- ``ACCO/rounds``: rounds launched so far; ``ACCO/committed_steps``: commits swapped in;
  ``ACCO/skipped_steps``: commits skipped for a non-finite gradient.
- ``ACCO/micro_batches_per_round/rank_{i}``: micro-batches rank i accumulated in the last round
  that finished (all ranks' counts travel with the round's communication).
- ``ACCO/micro_batches_committed``: global micro-batches that entered applied commits.
- ``ACCO/comm_wait_ms``: time rank 0's compute side waited for its communication side since the
  previous step (on CUDA: the host time to enqueue the wait; the stream wait itself is not timed).

Writing costs one host read of the loss and the grad norm per step, on rank 0 only, and nothing at
all when the monitor is disabled.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist


class ACCOMonitor:
    """Writes ACCO's events to ``engine.monitor`` (a ``deepspeed.monitor.monitor.MonitorMaster``)."""

    def __init__(self, engine):
        self._engine = weakref.ref(engine)  # the engine owns the optimizer that owns this
        self.monitor = engine.monitor
        self.train_batch_size = int(engine.train_batch_size())
        self._loss_sum: torch.Tensor | None = None
        self._last_wait_s = 0.0

    @property
    def active(self) -> bool:
        return bool(self.monitor.enabled) and dist.get_rank() == 0

    def record_loss(self, loss) -> None:
        """Called with each loss ``engine.backward`` scales (already divided by GAS); no host sync."""
        if not self.active or not isinstance(loss, torch.Tensor):
            return
        value = loss.detach().float().reshape(())
        self._loss_sum = value.clone() if self._loss_sum is None else self._loss_sum + value

    def events(self, optimizer, global_samples: int) -> list:
        """The (name, value, x) events of the step that just ended (see the module docstring)."""
        pipeline = optimizer.pipeline
        stats = pipeline.stats
        x = int(global_samples) + self.train_batch_size
        out = []
        if self._loss_sum is not None:
            out.append(("Train/Samples/train_loss", float(self._loss_sum.item()), x))
            self._loss_sum = None
        if pipeline.last_grad_norm is not None:
            out.append(("Train/Samples/grad_norm", float(pipeline.last_grad_norm.item()), x))
        out += [
            ("ACCO/rounds", stats.rounds, x),
            ("ACCO/committed_steps", pipeline.committed_steps, x),
            ("ACCO/skipped_steps", stats.skipped_steps, x),
            ("ACCO/micro_batches_committed", stats.micro_batches_committed, x),
            ("ACCO/comm_wait_ms", 1000.0 * (stats.comm_wait_s - self._last_wait_s), x),
        ]
        self._last_wait_s = stats.comm_wait_s
        for rank, count in enumerate(stats.last_round_counts):
            out.append((f"ACCO/micro_batches_per_round/rank_{rank}", int(count), x))
        return out

    def after_step(self, optimizer) -> None:
        """Write this step's events (rank 0, monitor enabled); called from the optimizer's step()."""
        engine = self._engine()
        if self.active and engine is not None:
            self.monitor.write_events(self.events(optimizer, engine.global_samples))
