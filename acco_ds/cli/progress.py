"""Progress bar of rank 0: optimizer steps done / target, loss, samples/s and the ETA (tqdm).

Contract: ``Progress(total, enabled)`` is a no-op on every rank but the one that enables it;
``update(step, loss, samples, elapsed)`` moves the bar to ``step`` (steps can jump, never go
back) and shows the running loss and the global samples/s.
"""

from __future__ import annotations

import sys


class Progress:
    def __init__(self, total: int, enabled: bool, desc: str):
        self._bar = None
        self._n = 0
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, desc=desc, unit="step", file=sys.stderr, dynamic_ncols=True, mininterval=0.5
            )

    def update(self, step: int, loss: float, samples: int, elapsed: float) -> None:
        if self._bar is None:
            return
        if step > self._n:
            self._bar.update(step - self._n)
            self._n = step
        rate = samples / elapsed if elapsed > 0 else 0.0
        self._bar.set_postfix(loss=f"{loss:.3f}", samples_s=f"{rate:.1f}", refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
