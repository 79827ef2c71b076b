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


def workers_chart(panels: dict, out: str, title: str) -> None:
    """Issue 16 at a glance. Top row, pre-tokenized: trainer overhead per step, ``next()`` p99
    under the busy trainer, replay tokens/s; bottom row, online tokenization: overhead and
    tokens/s under the busy trainer. One row per loader, light bar in-process, dark bar 2
    workers; Zephon orange, peers blue. ``panels`` from ``bench.workers_report.chart_rows``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    modes = [m for m in ("pretok", "text") if panels.get(m, {}).get("loaders")]
    if not modes:
        return
    top = [("overhead_us", "trainer overhead per 5 ms step (us)", 10.0), ("p99_ms", "next() wait p99 (ms)", 1e-3),
           ("replay_tok_s", "replay, nothing else in the loop (M tok/s)", 1e4)]
    bottom = [("overhead_us", "trainer overhead per 5 ms step (us)", 10.0),
              ("busy_tok_s", "tokens/s under the busy trainer (M tok/s)", 1e4)]
    heights = [len(panels[m]["loaders"]) + 1.5 for m in modes]
    fig = plt.figure(figsize=(16, 1.2 + 0.28 * sum(heights)))
    grid = fig.add_gridspec(len(modes), 3, height_ratios=heights)
    for row, mode in enumerate(modes):
        data = panels[mode]
        names = data["loaders"]
        y = np.arange(len(names))
        specs = top if mode == "pretok" else bottom
        for col, (metric, heading, floor) in enumerate(specs):
            ax = fig.add_subplot(grid[row, col])
            for k, offset in (("0", -0.2), ("2", 0.2)):
                vals = data[metric].get(k, [None] * len(names))
                for i, v in enumerate(vals):
                    if v is None:
                        continue
                    zephon = names[i] == "Zephon"
                    color = ("#d95f02" if zephon else "#1f78b4") if k == "2" else ("#fdb863" if zephon else "#a6cee3")
                    shown = max(v, floor)
                    ax.barh(y[i] + offset, shown, height=0.38, color=color)
                    scale = 1e-6 if metric.endswith("tok_s") else 1.0
                    text = f"{v * scale:+.0f}" if metric == "overhead_us" else f"{v * scale:.3g}"
                    ax.text(shown, y[i] + offset, " " + text, va="center", fontsize=6)
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            if metric.endswith("tok_s"):
                ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v / 1e6:g}"))
            if metric == "p99_ms":
                goal = panels.get("p99_goal_ms")  # the best peer's p99 with 2 workers, same run
                if goal is not None:
                    ax.axvline(goal, color="k", ls="--", lw=0.8)
                    ax.text(goal, len(names) - 0.5, f" goal {goal:.2f} ms (best peer)", fontsize=6)
            ax.set_yticks(y, names if col == 0 else [""] * len(names), fontsize=8)
            ax.set_ylim(len(names) - 0.4, -0.9)
            ax.grid(axis="x", alpha=0.3)
            ax.set_title(("pre-tokenized: " if mode == "pretok" else "online tokenization: ") + heading, fontsize=9)
    fig.suptitle(f"Issue 16: what each loader costs a trainer that holds the GIL 1 ms and waits 4 ms per batch "
                 f"({title}). Light = in-process, dark = 2 workers; orange = Zephon. Log scales.", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
