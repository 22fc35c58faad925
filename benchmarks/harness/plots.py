"""Plot building blocks of the e2e and topology benchmarks: ``pyplot()`` (matplotlib on the Agg
backend, imported only when a plot is drawn) and ``throughput_axes`` (samples/s and the steps/s
ratio to ZeRO-1 per link rate)."""

from __future__ import annotations

from benchmarks.harness import link


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def throughput_axes(a, b, results: dict, an: dict) -> None:
    """Samples/s per contender against the link rate (the compute-only bound as a line) into axes
    ``a``, the steps/s ratio to ZeRO-1 into ``b`` (best-of-seeds figures)."""
    rates = sorted(an["tables"], key=link.rate_mbit)
    xs = list(range(len(rates)))
    labels = sorted(
        {lbl for t in an["tables"].values() for lbl in t},
        key=lambda x: list(an["tables"][rates[0]]).index(x) if x in an["tables"][rates[0]] else 99,
    )
    for lbl in labels:
        pts = [(x, an["tables"][r][lbl]) for x, r in zip(xs, rates) if lbl in an["tables"][r]]
        a.plot([p[0] for p in pts], [p[1]["samples_per_s"] for p in pts], marker="o", label=lbl)
        b.plot([p[0] for p in pts], [p[1]["x_steps"] or 0 for p in pts], marker="o", label=lbl)
    a.axhline(an["compute_only"]["samples_per_s"], color="k", ls="--", label="compute-only bound")
    b.axhline(1.5, color="grey", ls=":", label="fixed-ACCO limit 1.5x")
    for ax, title in ((a, "samples/s (all replicas, best of seeds)"), (b, "optimizer steps/s / ZeRO-1's")):
        ax.set_xticks(xs, [f"{r}\n{results['rates'][r]['comm']['t_comm_s']:.2f}s" for r in rates])
        ax.set_xlabel("link rate (T_comm of one round)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    a.legend(fontsize=8)
