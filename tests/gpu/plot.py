"""latency.png from latency.csv (one row a sample): the median microseconds per gather against
bytes per rank, log-log, with the min-max of the samples shaded; left panel CUDA graph replay,
right panel eager PyTorch calls.

    python3 plot.py latency.csv latency.png
"""
import sys

import matplotlib
import matplotlib.ticker

import measure

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {"oneshot": ("tab:red", "-", 2.2), "ring-over-plugin": ("tab:blue", "-", 2.0),
         "nccl-socket": ("tab:gray", "-", 2.0), "oneshot-mode-eager": ("tab:orange", ":", 1.2),
         "oneshot-mode-rendezvous": ("tab:purple", ":", 1.2)}


def label(b):
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB" if b >= 1024 else f"{b} B"


def plot(src, dst):
    data = {mode: {c: sorted((b, s) for b, s in by.items() if s) for c, by in cs.items()}
            for mode, cs in measure.read_latency_csv(src).items()}
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, mode, title in zip(axes, ("graph", "eager"), ("CUDA graph replay (4 gathers a graph)", "eager PyTorch calls")):
        sizes = set()
        for config, (color, ls, lw) in STYLE.items():
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
        ax.set_title(f"two-rank all-gather, {title}")
        ax.set_xlabel("bytes per rank")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("microseconds per gather")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    plot(sys.argv[1], sys.argv[2])
