"""Per-rank step records (the raw metrics a rank writes; merged by ``acco_ds.cli.metrics``).

Contract: ``StepLog.micro(loss)`` is called once per micro-batch this rank computed;
``StepLog.step(step, t)`` closes the records up to optimizer step ``step`` (it may jump by more
than one) at ``t`` seconds since the synchronised start. Each record is cumulative:
``{"step", "t", "mb", "loss_sum"}`` = micro-batches computed by this rank so far and the sum of
their losses, so that ranks can be aligned on steps afterwards; with a ``probe`` (a callable returning a dict of
numbers, e.g. fp16's loss scale and skipped steps) each record also holds what it returned at that step. ``write`` dumps them as JSONL
(once, at the end: no file I/O in the timed loop).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable


class StepLog:
    def __init__(self, start: int = 0, probe: Callable[[], dict] | None = None) -> None:
        """``start``: the optimizer steps already done before this log (a resumed run): records begin after it;
        ``probe``: called at each recorded step, its keys added to the record."""
        self.probe = probe
        self.records: list = []
        self.mb = 0
        self.loss_sum = 0.0
        self._last_step = start
        self._window_loss = 0.0
        self._window_mb = 0
        self._recent = float("nan")

    @property
    def last_step(self) -> int:
        """The last optimizer step recorded (``start`` before any)."""
        return self._last_step

    def micro(self, loss: float) -> None:
        self.mb += 1
        self.loss_sum += loss
        self._window_loss += loss
        self._window_mb += 1

    def step(self, step: int, t: float) -> None:
        if step <= self._last_step:
            return
        self._last_step = step
        record = {"step": step, "t": round(t, 6), "mb": self.mb, "loss_sum": self.loss_sum}
        if self.probe is not None:
            record.update(self.probe())
        self.records.append(record)

    def recent_loss(self) -> float:
        """Mean loss of the micro-batches since the last call (for the progress bar); the previous
        value when none was computed since (e.g. the update after the last step), NaN before any."""
        if self._window_mb:
            self._recent = self._window_loss / self._window_mb
            self._window_loss, self._window_mb = 0.0, 0
        return self._recent

    def write(self, path: Path) -> None:
        path.write_text("".join(json.dumps(r) + "\n" for r in self.records))
