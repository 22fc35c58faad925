"""Plot of the memory benchmark: ``plot(results, path)`` writes one panel per (dtype, W): each
contender's measured extra peak per rank over ZeRO-1 (bytes per parameter) against the model size,
GPT-2 solid, Llama dashed, with the memory bound on ACCO's extra, 1.10 x (D + D/W), drawn as a horizontal line
and the analytic extra of acco dotted. Returns the path."""

from __future__ import annotations

from pathlib import Path

from acco_ds.plan import memory_model as mm
from benchmarks.memory import table as memory_table


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = memory_table.analyse(results)["rows"]
    combos = sorted({(r["dtype"], r["world"]) for r in rows}) or [("bf16", 2)]
    fig, axes = plt.subplots(1, len(combos), figsize=(4.6 * len(combos), 4.2), squeeze=False)
    colors = {"zero2": "tab:gray", "sync": "tab:green", "dpu": "tab:orange", "acco": "tab:blue"}
    for ax, (dtype, world) in zip(axes[0], combos):
        mine = [r for r in rows if r["dtype"] == dtype and r["world"] == world]
        for contender, color in colors.items():
            for arch, style in (("gpt2", "-"), ("llama", "--")):
                pts = sorted(
                    (r["params"], r["extra"])
                    for r in mine
                    if r["contender"] == contender and r["arch"] == arch and r.get("extra") is not None
                )
                if pts:
                    ax.plot(
                        [p[0] for p in pts],
                        [p[1] for p in pts],
                        style,
                        marker="o",
                        color=color,
                        label=f"{contender} {arch}",
                    )
        acco_a = sorted((r["params"], r["analytic_extra"]) for r in mine if r["contender"] == "acco")
        if acco_a:
            ax.plot(
                [p[0] for p in acco_a], [p[1] for p in acco_a], ":", color="tab:blue", label="acco analytic"
            )
        D = mm.DTYPE_SIZE[dtype]
        ax.axhline(mm.goal_bound(D, world), color="red", ls="-.", label="bound 1.1 (D + D/W)")
        ax.axhline(0.0, color="k", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("parameters")
        ax.set_title(f"{dtype}, W = {world}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("extra peak per rank over ZeRO-1 (B/param)")
    max(axes[0], key=lambda ax: len(ax.get_lines())).legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
