"""Loss curves of a training run, written as PNG."""

from __future__ import annotations

from pathlib import Path


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` points (the raw per-step loss is noisy)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_curves(path: str | Path, *, title: str,
                series: dict[str, tuple[list[float], list[float]]],
                xlabel: str = "step", ylabel: str = "loss (nats/token)") -> Path:
    """One line per ``name: (xs, ys)``; a series of one point is drawn as a marker."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), dpi=110)
    FigureCanvasAgg(fig)  # a figure of our own: no pyplot state, no display
    ax = fig.add_subplot(1, 1, 1)
    for name, (xs, ys) in series.items():
        if len(xs) == 1:
            ax.plot(xs, ys, "o", label=name)
        elif xs:
            ax.plot(xs, ys, label=name, marker="o" if len(xs) <= 20 else None)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
