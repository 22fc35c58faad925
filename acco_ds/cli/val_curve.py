"""A rank's validation-loss curve during training: what ``acco_ds.cli.time_to_loss`` reads.

Contract: ``ValCurve(engine, evaluate, every, wire, start)`` (``evaluate()`` returns the validation loss of the
parameters the model shows, a collective over the ranks; ``wire`` the rank's ``WireCounter`` or None; ``start`` the
step the run starts at, a resumed run's checkpoint):
- ``at(step, t)`` evaluates now and records ``(step, t, loss)`` (the start, before the clock runs; the end, after
  the last commit);
- ``on_step(step, clock)`` is the training loop's hook (``acco_ds.cli.loop``): when the optimizer steps pass a
  multiple of ``every`` (0: never), the model is shown the committed parameters (ACCO: ``engine.optimizer.eval()``,
  which waits for the round in flight; that wait stays in the clock, as any evaluation mid-training costs it),
  then evaluated, and the evaluation's own seconds are returned for the loop to leave out of its clock; the point
  recorded is (the step of the parameters evaluated, ``clock()`` at the start of the evaluation, the loss). The
  step evaluated is the committed steps plus one when a finished commit is in flight (its target is what the
  model shows; ``acco_ds.core.snapshot.committed_flats``). One evaluation per multiple passed, so that ranks
  whose step count jumps differently (adaptive accumulation) still make the same collective calls; a point at
  a step already recorded is not recorded twice.
- ``curve()`` is ``{"step": [...], "time_s": [...], "val_loss": [...]}`` in order; ``seconds`` the evaluations'
  total time left out of the clock, ``cpu_seconds`` the calling thread's CPU time in them. The evaluations'
  collectives are not counted as training traffic (``WireCounter.not_counted``).
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable


def evaluated_step(engine) -> int:
    """The optimizer step of the parameters the model shows after ``engine.optimizer.eval()`` (ACCO) or between
    steps (DeepSpeed): ACCO's committed steps, plus one for a finished COMMIT in flight (its target is shown)."""
    opt = engine.optimizer
    if not hasattr(opt, "committed_steps"):
        return int(engine.global_steps)
    from acco_ds.core.schedule import Job

    n = int(opt.committed_steps)
    in_flight = getattr(getattr(opt, "pipeline", None), "in_flight", None)
    if in_flight is not None:
        result = in_flight[0].result
        if result is not None and result.job is Job.COMMIT:
            n += 1
    return n


class ValCurve:
    """The validation-loss curve of one rank (module docstring)."""

    def __init__(self, engine, evaluate: Callable[[], float], every: int, wire=None, start: int = 0) -> None:
        self.engine = engine
        self.evaluate = evaluate
        self.every = max(0, int(every))
        self.wire = wire
        self.points: list = []
        self.seconds = 0.0
        # the calling thread's CPU time in the evaluations of on_step (time.thread_time)
        self.cpu_seconds = 0.0
        self._last = int(start)  # the step of the last evaluation (a resumed run: the step it resumed at)

    def _loss(self) -> float:
        quiet = self.wire.not_counted() if self.wire is not None else contextlib.nullcontext()
        with quiet:
            return self.evaluate()

    def _record(self, step: int, t: float, loss: float) -> None:
        if self.points and self.points[-1][0] >= step:
            return
        self.points.append((int(step), round(float(t), 6), float(loss)))

    def at(self, step: int, t: float) -> float:
        loss = self._loss()
        self._record(step, t, loss)
        return loss

    def on_step(self, step: int, clock: Callable[[], float]) -> float:
        """The loop's hook: the seconds of the evaluations made now (0.0 when none)."""
        passed = step // self.every - self._last // self.every if self.every and step > self._last else 0
        if passed <= 0:
            return 0.0
        self._last = step
        opt = self.engine.optimizer
        explicit = hasattr(opt, "eval") and hasattr(opt, "committed_steps")
        spent = 0.0
        for _ in range(passed):  # every rank the same calls, however its count jumped
            if explicit:
                opt.eval()  # waits for the commit in flight (adaptive: the ranks agree first): in the clock
            t = clock() - spent
            t0, c0 = time.perf_counter(), time.thread_time()
            self._record(evaluated_step(self.engine), t, self._loss())
            if explicit:
                opt.train()
            spent += time.perf_counter() - t0
            self.cpu_seconds += time.thread_time() - c0
        self.seconds += spent
        return spent

    def curve(self) -> dict:
        return {
            "step": [p[0] for p in self.points],
            "time_s": [p[1] for p in self.points],
            "val_loss": [p[2] for p in self.points],
        }
