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


def save_figure(figure, path: str | Path) -> Path:
    """Lay ``figure`` out, write it as a 120-dpi PNG at ``path`` and free it."""
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    _pyplot().close(figure)
    return Path(path)


def labelled_bars(axis, names: list[str], values: list[float], labels: list[str], colors: list[str]) -> None:
    """One bar per name with its label above it, and headroom for the labels (1.0 when every value is 0)."""
    bars = axis.bar(names, values, color=colors)
    for bar, label in zip(bars, labels):
        axis.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    axis.set_ylim(top=max(values) * 1.18 or 1.0)


def ratio_bar_panels(results: dict[str, dict], panels: list[tuple[str, str, float, str, int]], colors: list[str],
                     title: str, path: str | Path, *, rotate_names: bool = False) -> Path:
    """A benchmark's bar charts side by side: one panel per ``(key, ratio_key, scale, panel title, decimals)``,
    a bar per named result (its ``key`` times ``scale``) labelled with its ratio ("n/a" where there is none)."""
    names = list(results)
    figure, axes = _pyplot().subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for axis, (key, ratio_key, scale, panel_title, decimals) in zip(axes[0], panels):
        ratios = [results[name][ratio_key] for name in names]
        labelled_bars(axis, names, [results[name][key] * scale for name in names],
                      ["n/a" if r is None else f"{r:.{decimals}f}x" for r in ratios], colors)
        axis.set_title(panel_title)
        if rotate_names:
            axis.set_xticks(range(len(names)), names, rotation=30, ha="right")
    figure.suptitle(title)
    return save_figure(figure, path)


def plot_curve(values: list[float], path: str | Path, *, title: str, ylabel: str, xlabel: str = "step") -> Path:
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.plot(range(1, len(values) + 1), values, marker=".", linewidth=1)
    axis.set(title=title, xlabel=xlabel, ylabel=ylabel)
    axis.xaxis.set_major_locator(_integer_locator())
    axis.grid(alpha=0.3)
    return save_figure(figure, path)


def plot_curves(series: dict[str, list[float] | dict[int, float]], path: str | Path, *, title: str, ylabel: str,
                xlabel: str = "step") -> Path:
    """Several named curves on one axis: a list is a value per step 1, 2, ...; a dict maps steps to values
    (a curve measured at some steps only)."""
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(6, 3.5))
    for name, values in series.items():
        steps, points = (list(values), list(values.values())) if isinstance(values, dict) else (
            range(1, len(values) + 1), values)
        axis.plot(steps, points, marker=".", linewidth=1, label=name)
    axis.set(title=title, xlabel=xlabel, ylabel=ylabel)
    axis.xaxis.set_major_locator(_integer_locator())
    axis.legend()
    axis.grid(alpha=0.3)
    return save_figure(figure, path)


def curves_beside_bars(series: dict[str, list[float]], bars: dict[str, dict[str, float]], path: str | Path, *,
                       title: str, curves_ylabel: str, bars_ylabel: str) -> Path:
    """Two panels: the named curves (a value per step 1, 2, ...) on the left; on the right, for each name of
    ``bars``, a group of bars ({bar's label: value}) side by side, each labelled with its value."""
    plt = _pyplot()
    figure, (curves, grouped) = plt.subplots(1, 2, figsize=(11, 4))
    for name, values in series.items():
        curves.plot(range(1, len(values) + 1), values, marker=".", linewidth=1, label=name)
    curves.set(xlabel="step", ylabel=curves_ylabel)
    curves.xaxis.set_major_locator(_integer_locator())
    curves.legend()
    curves.grid(alpha=0.3)
    labels = list(dict.fromkeys(label for group in bars.values() for label in group))
    width = 0.8 / len(labels)
    for index, label in enumerate(labels):
        values = [group.get(label, 0.0) for group in bars.values()]
        placed = grouped.bar([x + (index - (len(labels) - 1) / 2) * width for x in range(len(bars))], values, width,
                             label=label)
        grouped.bar_label(placed, fmt="%.2f")
    grouped.set_xticks(range(len(bars)), list(bars))
    grouped.set(ylabel=bars_ylabel, ylim=(0, 1.1))
    grouped.legend()
    figure.suptitle(title)
    return save_figure(figure, path)
