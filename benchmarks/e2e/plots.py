"""Plots of the e2e benchmark into the results folder.

``plot_all(results, analysis, out_dir, prefix)`` writes:
- ``<prefix>_throughput.png``: samples/s per contender against the link rate (the compute-only
  bound as a line), and the steps/s ratio to ZeRO-1 (best-of-seeds figures);
- ``<prefix>_loss.png``: training loss (trailing average) against wall time, one panel per rate;
- ``<prefix>_hetero.png``: samples/s per rank and overall in the heterogeneous case.
Returns the paths written.
"""

from __future__ import annotations

from pathlib import Path

from acco_ds.cli.metrics import smoothed_loss
from benchmarks.harness import link
from benchmarks.harness.plots import pyplot, throughput_axes


def _throughput(results, an, path):
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    throughput_axes(a, b, results, an)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _loss(results, an, path):
    plt = pyplot()
    rates = sorted(results["rates"], key=link.rate_mbit)
    fig, axes = plt.subplots(1, len(rates), figsize=(4 * len(rates), 3.8), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        runs = results["rates"][rate]["runs"]
        ax.set_title(f"link {rate}")
        if not runs:  # every contender failed at this rate (named in the table)
            continue
        base = runs.get("zero1")
        window = max(1, int(0.2 * (base or next(iter(runs.values())))["samples"]))
        for lbl, s in runs.items():
            pts = [
                (r["time_s"], v)
                for r, v in zip(s["records"], smoothed_loss(s["records"], window))
                if v is not None
            ]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=lbl)
        ax.set_xlabel("wall time (s)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("training loss (trailing 20% of ZeRO-1's samples)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _hetero(an, path):
    plt = pyplot()
    h = an["hetero"]
    labels = list(h["rows"])
    world = len(next(iter(h["rows"].values()))["rank_samples_per_s"])
    fig, ax = plt.subplots(figsize=(6.5, 4))
    width = 0.8 / (world + 1)
    for k in range(world + 1):
        vals = [
            h["rows"][lbl]["rank_samples_per_s"][k] if k < world else h["rows"][lbl]["samples_per_s"]
            for lbl in labels
        ]
        name = f"rank {k}" + (" (slowed)" if k == h["slow_rank"] else "") if k < world else "overall"
        ax.bar([i + k * width for i in range(len(labels))], vals, width, label=name)
    ax.set_xticks([i + world * width / 2 for i in range(len(labels))], labels)
    ax.set_ylabel("samples/s")
    ax.set_title(f"rank {h['slow_rank']} {h['slow_factor']:g}x slower, link {h['rate']}")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_all(results: dict, an: dict, out_dir: Path, prefix: str) -> list:
    out_dir = Path(out_dir)
    paths = []
    if an["tables"]:
        paths += [out_dir / f"{prefix}_throughput.png", out_dir / f"{prefix}_loss.png"]
        _throughput(results, an, paths[0])
        _loss(results, an, paths[1])
    if an.get("hetero") and an["hetero"]["rows"]:
        paths.append(out_dir / f"{prefix}_hetero.png")
        _hetero(an, paths[-1])
    return paths
