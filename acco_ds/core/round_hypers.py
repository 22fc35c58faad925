"""The AdamW settings each round's job uses, for ``ACCOPipeline``: the LR schedule as the applied commits see it.

State owned here: ``_hypers`` (the caller's function: the current AdamW settings per group), ``engine_steps`` (LR
schedule steps: engine steps whose scheduler step ran) and ``_hyper_history`` (the settings seen at each engine step
count, pruned below ``state_step``). Compute side only: the settings are recorded at each micro-batch end and turned
into a table at each round end (:meth:`_hyper_table`), one row per applied-commit count the job may find on the device
(``round_job`` picks its row there, so no host read of the count in flight is needed).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Dict, List

from acco_ds.core.schedule import Job
from acco_ds.ops.adamw_settings import AdamWSettings


class RoundHypers:
    """Mixin of ``ACCOPipeline`` (see the module docstring). Reads ``state_step``, ``_unread``, ``in_flight`` and
    ``groups``."""

    def _init_hypers(self, hypers: Callable[[], List[AdamWSettings]], peek_lr_scale: float = 1.0) -> None:
        """``hypers``: called on the compute side at each micro-batch end and round end (never by the job).
        ``peek_lr_scale``: the factor on the LR of a PEEK's settings (``ACCOConfig.peek_lr_scale``)."""
        self._hypers = hypers
        self._peek_lr_scale = float(peek_lr_scale)
        self.engine_steps = 0  # LR-schedule steps: engine steps whose scheduler step ran (no overflow)
        self._hyper_history: Dict[int, List[AdamWSettings]] = {}

    def on_engine_step(self, lr_stepped: bool = True) -> None:
        """The engine's optimizer step was called; ``lr_stepped``: its LR scheduler steps right after
        (DeepSpeed skips the scheduler step when the optimizer reports ``overflow``)."""
        self.stats.optimizer_steps += 1
        if lr_stepped:
            self.engine_steps += 1

    def _record_hypers(self) -> None:
        if self.engine_steps not in self._hyper_history:
            self._hyper_history[self.engine_steps] = list(self._hypers())

    def _hypers_for(self, applied: int) -> List[AdamWSettings]:
        """The AdamW settings of the next commit (and of the peek predicting it) when ``applied``
        commits have been applied: the LR schedule advances once per APPLIED step, so this commit
        uses the settings the engine had after ``applied`` scheduler steps (adaptive rounds may lag
        behind the engine's steps; a skipped commit does not advance the schedule)."""
        self._record_hypers()
        hyp = self._hyper_history.get(applied)
        if hyp is None:
            older = [k for k in self._hyper_history if k <= applied]
            hyp = self._hyper_history[max(older) if older else min(self._hyper_history)]
        return hyp

    def _hyper_table(self, job: Job = Job.COMMIT) -> List[List[tuple]]:
        """Per group, the AdamW scalars (``hyper_scalars``) of the next job for every applied count it
        may find on the device: ``state_step`` (read) plus 0 .. the commits whose summary is unread. A PEEK's
        LR is the commit's times ``peek_lr_scale``."""
        unknown = sum(1 for r in self._unread if r.job is Job.COMMIT)
        if self.in_flight is not None and self.in_flight[1].job is Job.COMMIT:
            unknown += 1
        rows = []
        for applied in range(self.state_step, self.state_step + unknown + 1):
            settings = self._hypers_for(applied)
            if job is Job.PEEK and self._peek_lr_scale != 1.0:
                settings = [replace(h, lr=h.lr * self._peek_lr_scale) for h in settings]
            rows.append([h.hyper_scalars(applied + 1) for h in settings])
        for k in [k for k in self._hyper_history if k < self.state_step]:
            del self._hyper_history[k]
        return [[row[g] for row in rows] for g in range(len(self.groups))]
