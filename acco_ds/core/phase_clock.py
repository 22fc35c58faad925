"""Where a round's communication job spends its time: the durations of its phases, measured where the job runs.

A :class:`PhaseClock` is started at the job's beginning and marked at the end of each phase (``mark(name)``); the
time between two marks belongs to the later mark's name, and a name marked several times (one mark per parameter
group) adds up. ``seconds()`` gives ``{name: seconds}``.

Where it measures: on the CPU (the executor's worker thread runs the job, gloo) the host clock
(``time.perf_counter``) at each mark: the job's real time, waits on peers included. On CUDA a timing event recorded
on the current stream (the side stream the job is queued on) at each mark, so that the figures are the device's
time between the phases' ends, the collectives' waits included, and marking never waits for the device.
``seconds()`` reads those events: call it only once the job's last operation has completed (the pipeline calls it
after the job's summary event, recorded after the last mark, has completed), else it raises.
"""

from __future__ import annotations

import time

import torch

PHASES = ("reduce_scatter", "norm", "step", "all_gather")
"""The phases ``run_round_job`` marks, in their order: the gradient exchange (reduce-scatter, compressed or not);
the counts, the g~ and the global norm with its all-reduce (where a rank waits for the slowest one's exchange);
the AdamW step (with the quantized parameter difference when the all-gather is compressed); the parameter
all-gather (or the exchange of the differences)."""

OFFLOAD_PHASES = ("to_host", "to_device")
"""With optimizer offload (``core.host_step``), the step phase splits: ``to_host`` the copies of the step's inputs
to the host and the host's wait for them, ``step`` the AdamW step on the host, ``to_device`` the copies of the new
parameters back (on CUDA the side stream's time for them, up to the all-gather's start)."""


class PhaseClock:
    """The marks of one job on ``device`` (see the module docstring)."""

    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        self._marks: list = [("", self._now())]

    def _now(self):
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def mark(self, name: str) -> None:
        """The phase ``name`` ends here."""
        self._marks.append((name, self._now()))

    def seconds(self) -> dict:
        """``{name: seconds}`` of every phase marked (CUDA: only once the job's operations have completed)."""
        out: dict = {}
        for (_, start), (name, end) in zip(self._marks, self._marks[1:]):
            dt = start.elapsed_time(end) / 1e3 if self._cuda else end - start
            out[name] = out.get(name, 0.0) + dt
        return out
