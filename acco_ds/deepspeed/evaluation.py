"""Evaluation, generation and ``state_dict`` see the committed weights: what users measure mid-training is
the model that checkpoints and exports hold (docs/ALGORITHM.md, property 9).

Three ways in, all ending in ``core.committed_view``:

- ``engine.eval()`` / ``engine.train()``: switch at the call (``register`` wraps the engine's ``train``).
- ``module.eval()`` on the engine's module (HF Trainer may evaluate the unwrapped model): a forward
  pre-hook on the module shows the committed weights at the first forward in eval mode and the
  compute side's weights again at the first forward in training mode.
- ``optimizer.eval()`` / ``optimizer.train()`` (the convention of schedule-free optimizers, which the
  HF Trainer and accelerate call around evaluation and at every training step): switch explicitly.
- ``with engine.optimizer.committed_weights(): ...`` for code that does not call ``eval()`` (sampling,
  a ``torch.no_grad()`` loop on ``engine.module`` in training mode).

While shown explicitly (the last two), the training-mode pre-hook leaves the view alone, and a
backward raises: training at the committed weights would compute gradients at the wrong point.
"""

from __future__ import annotations

from contextlib import contextmanager

from acco_ds.core.committed_view import show_committed, show_compute


class EvaluationView:
    """Owns the explicit/implicit view state of one ACCO optimizer."""

    def __init__(self, pipeline):
        self.pipeline = pipeline
        self.explicit = False

    def forward_pre_hook(self, module, args) -> None:
        self.on_engine_mode(module.training)

    def on_engine_mode(self, training: bool) -> None:
        """``engine.train(mode)`` was called."""
        if self.explicit:
            return
        if training and self.pipeline.viewing_committed:
            show_compute(self.pipeline)
        elif not training and not self.pipeline.viewing_committed:
            show_committed(self.pipeline)

    def eval(self) -> None:
        self.explicit = True
        if not self.pipeline.viewing_committed:
            show_committed(self.pipeline)

    def train(self) -> None:
        self.explicit = False
        if self.pipeline.viewing_committed:
            show_compute(self.pipeline)

    @contextmanager
    def committed(self):
        was_explicit, was_viewing = self.explicit, self.pipeline.viewing_committed
        self.explicit = True
        if not was_viewing:
            show_committed(self.pipeline)
        try:
            yield
        finally:
            self.explicit = was_explicit
            if not was_viewing and self.pipeline.viewing_committed:
                show_compute(self.pipeline)


def consolidated_committed(engine, original, *args, **kwargs):
    """DeepSpeed's AutoTP export (``engine._consolidated_16bit_state_dict``, which HF and accelerate call to
    save a tensor-parallel model) gathers each split parameter's slices by re-assigning ``param.data``, then
    splits it again into new tensors: run it on the committed weights, then make the parameters views into
    ACCO's buffers again (the views the export replaced). Collective, like the original."""
    view = engine.optimizer._view
    with view.committed():
        out = original(engine, *args, **kwargs)
        show_committed(view.pipeline)  # the export replaced the views: the committed ones, again
    return out
