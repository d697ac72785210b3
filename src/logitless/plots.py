"""PNG plots of training curves and benchmark results (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _integer_locator():
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)


def plot_curve(values: list[float], path: str | Path, *, title: str, ylabel: str, xlabel: str = "step") -> Path:
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.plot(range(1, len(values) + 1), values, marker=".", linewidth=1)
    axis.set(title=title, xlabel=xlabel, ylabel=ylabel)
    axis.xaxis.set_major_locator(_integer_locator())
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return Path(path)


def plot_curves(series: dict[str, list[float]], path: str | Path, *, title: str, ylabel: str,
                xlabel: str = "step") -> Path:
    """Several named curves on one axis."""
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(6, 3.5))
    for name, values in series.items():
        axis.plot(range(1, len(values) + 1), values, marker=".", linewidth=1, label=name)
    axis.set(title=title, xlabel=xlabel, ylabel=ylabel)
    axis.xaxis.set_major_locator(_integer_locator())
    axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return Path(path)
