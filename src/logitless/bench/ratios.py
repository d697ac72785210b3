"""Ratios against a benchmark's reference, and how they print.

A tiny shape can leave the reference's peak memory at 0 MB: on CPU the peak is the growth of the
resident set, and small work fits in pages the process already holds. A ratio to such a reference
means nothing, so it is None (JSON null) and prints as "n/a".
"""

from __future__ import annotations

MEASURABLE_MB = 1.0  # below this a CPU peak is page reuse, not a measurement


def ratio(value: float, reference: float, *, floor: float = 0.0) -> float | None:
    """``value / reference``, or None when the reference is at or below ``floor``."""
    return None if reference <= floor else value / reference


def add_ratios(results: dict, reference: str, time_key: str = "time_s", ratio_key: str = "time_ratio") -> None:
    """Add ``ratio_key`` (of ``time_key``) and ``peak_ratio`` to every result, relative to ``results[reference]``."""
    base = results[reference]
    for result in results.values():
        result[ratio_key] = ratio(result[time_key], base[time_key])
        result["peak_ratio"] = ratio(result["peak_mb"], base["peak_mb"], floor=MEASURABLE_MB)


def format_ratio(value: float | None, width: int) -> str:
    text = "n/a" if value is None else f"{value:.2f}"
    return f"{text:>{width}}"


def trl_comparison_lines(groups: dict, time_key: str, time_header: str, group_header: str,
                         digits: int) -> list[str]:
    """The header and one line per (group, implementation) of a TRL-vs-logitless trainer table: the step's time
    (``time_key``), the loss with its backward, the peak memory, each with its ratio to TRL's, and the losses."""
    width = max(9, *(len(group) + 1 for group in groups))
    lines = [f"{group_header:<{width}}{'head':<11}{time_header:>8}{'x TRL':>7}{'loss+bwd s':>12}{'x TRL':>7}"
             f"{'peak MB':>9}{'x TRL':>7}  losses"]
    for group, results in groups.items():
        for name, r in results.items():
            lines.append(f"{group:<{width}}{name:<11}{r[time_key]:>8.{digits}f}{format_ratio(r['time_ratio'], 7)}"
                         f"{r['loss_backward_s']:>12.{digits}f}{format_ratio(r['loss_backward_ratio'], 7)}"
                         f"{r['peak_mb']:>9.0f}{format_ratio(r['peak_ratio'], 7)}"
                         f"  {', '.join(f'{x:.4f}' for x in r['losses'])}")
    return lines
