"""Show the committed parameters to the model for evaluation, and put the compute side's back.

Between optimizer steps the model's parameters are what the compute side needs next, not the
committed weights: in ``acco`` the estimate theta~ during stage 2, in ``dpu`` the previous commit.
:func:`show_committed` makes the model's parameters views into the buffer that holds the committed
parameters theta (what ``safe_get_full_fp32_param`` returns, in the parameters' dtype) without a
copy; :func:`show_compute` makes them views into the MODEL buffer again. Nothing else changes: no
job is swapped in, no bookkeeping is done, the gradient buffers are untouched, so training that
resumes after :func:`show_compute` is bit for bit the training that never looked.

Which buffer holds theta: while a COMMIT is in flight, its parameter target once the job has finished
(:func:`show_committed` waits for it: the compute stream waits on its event on CUDA, the host does
not); otherwise the MODEL buffer (a PEEK in flight leaves the model at theta). Fixed accumulation:
local, no collective (every rank launches the same jobs at the same micro-batch). Adaptive
accumulation: a peer may not have launched the job this rank waits for, so the ranks first agree on
the round count (``snapshot.drain``, a collective): evaluation is then collective, as it is for an
HF Trainer or accelerate run, which evaluate on every rank.
"""

from __future__ import annotations

from acco_ds.core import snapshot


def show_committed(pipeline) -> None:
    """Point the model's parameters at the committed weights (idempotent)."""
    if pipeline.adaptive:
        snapshot.drain(pipeline)
    elif pipeline.in_flight is not None:
        pipeline.executor.wait(pipeline.in_flight[0])
    for b, flat in zip(pipeline.groups, snapshot.committed_flats(pipeline)):
        b.point_params(flat)
    pipeline.viewing_committed = True


def show_compute(pipeline) -> None:
    """Point the model's parameters back at the MODEL buffer, where the compute side left them."""
    for b in pipeline.groups:
        b.point_params()
    pipeline.viewing_committed = False
