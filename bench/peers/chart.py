"""The throughput chart of the comparison (matplotlib, run in the peers venv)."""

from __future__ import annotations


def throughput_chart(rows: list[dict], out: str, title: str) -> None:
    """rows: {"loader": str, "pretok": float|None, "text": ..., "mix": ...} in tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    modes = [("pretok", "pre-tokenized, packed"), ("text", "online tokenize + pack"), ("mix", "0.7/0.3 mix")]
    loaders = [r["loader"] for r in rows]
    x = np.arange(len(loaders))
    width = 0.27
    fig, ax = plt.subplots(figsize=(11, 5))
    for i, (key, label) in enumerate(modes):
        vals = [(r.get(key) or 0.0) / 1e6 for r in rows]
        bars = ax.bar(x + (i - 1) * width, vals, width, label=label)
        for b, r in zip(bars, rows):
            if r.get(key) is None:
                ax.text(b.get_x() + b.get_width() / 2, 0.06, "n/a", ha="center", va="bottom", fontsize=7, rotation=90)
            else:
                ax.text(b.get_x() + b.get_width() / 2, b.get_height(), f"{b.get_height():.2g}", ha="center",
                        va="bottom", fontsize=6)
    ax.set_xticks(x, loaders, rotation=15)
    ax.set_ylabel("million tokens / s (median, log scale)")
    if any((r.get(k) or 0) > 0 for r in rows for k, _ in modes):
        ax.set_yscale("log")
        ax.set_ylim(bottom=0.05)
    ax.set_title(title, fontsize=10)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
