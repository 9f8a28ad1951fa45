"""latency.png from latency.csv (one row a sample): the median microseconds per gather against
bytes per rank, log-log, with the min-max of the samples shaded; a panel for CUDA graph replay
and one for eager PyTorch calls where the run has them. allreduce-latency.csv the same, per
all-reduce against bytes of the buffer.

    python3 plot.py latency.csv latency.png [gather|all-reduce]
"""
import sys

import matplotlib
import matplotlib.ticker

import measure

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {"intercept": ("tab:green", "-", 2.4), "intercept-preload": ("tab:olive", "--", 1.4),
         "intercept-nonap": ("tab:cyan", ":", 1.4), "intercept-wide": ("tab:red", "-.", 1.4),
         "nccl-socket": ("tab:gray", "-", 2.0)}
OTHER = ("black", "-.", 1.0)  # a config without a style of its own


def label(b):
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB" if b >= 1024 else f"{b} B"


# What a plot's collective is called, and what its sizes count.
WHAT = {"gather": ("all-gather", "bytes per rank"), "all-reduce": ("all-reduce", "bytes of the buffer")}


def plot(src, dst, what="gather"):
    name, xlabel = WHAT[what]
    data = {mode: {c: sorted((b, s) for b, s in by.items() if s) for c, by in cs.items()}
            for mode, cs in measure.read_latency_csv(src).items()}
    titles = {"graph": f"CUDA graph replay (4 {what}s a graph)", "eager": "eager PyTorch calls"}
    modes = [m for m in titles if data.get(m)] or ["graph"]
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes) + 1, 5), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, mode in zip(axes, modes):
        title = titles[mode]
        sizes = set()
        configs = list(STYLE) + sorted(c for c in data.get(mode, {}) if c not in STYLE)
        for config in configs:
            color, ls, lw = STYLE.get(config, OTHER)
            pts = data.get(mode, {}).get(config, [])
            if pts:
                xs = [b for b, _ in pts]
                sizes.update(xs)
                ax.plot(xs, [s["median"] for _, s in pts], ls, color=color, lw=lw, marker="o", ms=3, label=config)
                ax.fill_between(xs, [s["min"] for _, s in pts], [s["max"] for _, s in pts], color=color, alpha=0.15)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ticks = sorted(sizes)
        ax.set_xticks(ticks)
        ax.set_xticklabels([label(b) for b in ticks], rotation=45, fontsize=8)
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_title(f"two-rank {name}, {title}")
        ax.set_xlabel(xlabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel(f"microseconds per {what}")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    plot(sys.argv[1], sys.argv[2], *sys.argv[3:4])
