"""Loss curves of one or several runs: against samples and against wall time, one line per mode.

Contract: ``plot_losses(curves, out_dir)`` takes ``{label: records}`` (records as produced by
``acco_ds.cli.metrics.merge_ranks``) and writes ``loss_vs_samples.png`` and ``loss_vs_time.png``
into ``out_dir``, the training loss smoothed over a trailing window of samples (the same window
for every line), and returns the paths. Uses matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List


def _smoothed(records: List[dict], window: int):
    from acco_ds.cli.metrics import smoothed_loss

    values = smoothed_loss(records, window)
    pts = [(r, v) for r, v in zip(records, values) if v is not None]
    return pts


def plot_losses(curves: Dict[str, List[dict]], out_dir: Path, title: str = "") -> List[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    longest = max((recs[-1]["samples"] for recs in curves.values() if recs), default=1)
    window = max(1, longest // 40)
    paths = []
    for xkey, xlabel, name in (
        ("samples", "samples (sequences, all ranks)", "loss_vs_samples.png"),
        ("time_s", "wall time (s)", "loss_vs_time.png"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, recs in curves.items():
            pts = _smoothed(recs, window)
            if pts:
                ax.plot([r[xkey] for r, _ in pts], [v for _, v in pts], label=label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"training loss (mean over the last {window} samples)")
        ax.set_title(title or "acco-train")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
