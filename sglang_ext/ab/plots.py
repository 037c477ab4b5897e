"""PNG plots of the A/B reports (matplotlib, imported lazily, Agg backend). Optional: without
matplotlib (the core install) the reports are complete and the plots are skipped with one line."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Callable, Sequence


PLOT_EXTRA = "pip install 'kimi-k3-nvfp4[plot]'"


def unavailable() -> str | None:
    """Why no plot can be drawn here (matplotlib missing), or None when plots work. The reports
    never depend on it: plots are optional everywhere."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        return f"matplotlib is not installed ({type(e).__name__}: {e}; {PLOT_EXTRA} adds it)"
    return None


def draw_all(out: Path, plots: dict[str, tuple[str, Callable[[Path], Path]]]) -> tuple[dict[str, str], str | None]:
    """Draw each plot ``key -> (file name, draw(path))`` into ``out``; returns the files drawn
    and, where some were not, one line saying which and why (also printed on stderr). Called
    after the report is written, so that a failed plot never loses a report."""
    why = unavailable()
    drawn: dict[str, str] = {}
    if why is None:
        for key, (name, draw) in plots.items():
            try:
                draw(out / name)
                drawn[key] = name
            except Exception as e:  # a plot is decoration: report it, keep the run's result
                why = why or f"{type(e).__name__}: {e}"
    skipped = [name for key, (name, _) in plots.items() if key not in drawn]
    if not skipped:
        return drawn, None
    line = f"plots skipped ({', '.join(skipped)}): {why}"
    print(f"k3nvfp4-ab: {line}", file=sys.stderr)
    return drawn, line


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    # Atomic like the other report files: render to a temp name, then rename.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".png", dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110, bbox_inches="tight")
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
        _plt().close(fig)
    return path


def error_histogram(path: Path, series: dict[str, Sequence[float]], title: str) -> Path:
    """Histogram of log10 |a-b| per arm pair (zeros drawn at the left edge)."""
    import numpy as np

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    floor = -12.0
    for label, vals in series.items():
        v = np.asarray(vals, dtype=np.float64)
        logv = np.where(v > 0, np.log10(np.maximum(v, 1e-300)), floor)
        ax.hist(np.maximum(logv, floor), bins=60, histtype="step", label=label, linewidth=1.4)
    ax.set_xlabel(f"log10 |a - b| (exact zeros at {floor:g})")
    ax.set_ylabel("elements")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(fig, path)


def per_expert_error(path: Path, series: dict[str, tuple[Sequence[int], Sequence[float]]], title: str) -> Path:
    """Normwise relative error of the tokens routed to each expert, one line per arm pair."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4))
    for label, (experts, errs) in series.items():
        ax.plot(list(experts), list(errs), marker=".", linestyle="-", linewidth=0.8, label=label)
    ax.set_xlabel("expert id")
    ax.set_ylabel("rel. error of its tokens")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(fig, path)


def accuracy_bars(path: Path, arms: Sequence[str], means: Sequence[float], sems: Sequence[float | None],
                  trunc: Sequence[float], title: str,
                  diff: tuple[float, tuple[float, float] | None, str] | None = None) -> Path:
    """pass@1 per arm with +-1 SEM error bars (none for one seed), truncation rate annotated;
    with ``diff = (B - A in pp, its 95% interval or None, verdict)`` a second panel shows the
    paired difference and its interval against zero."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2 if diff else 1, figsize=(9 if diff else 5, 4),
                             gridspec_kw={"width_ratios": [3, 2]} if diff else None, squeeze=False)
    ax = axes[0][0]
    xs = range(len(arms))
    err = [100 * (s or 0.0) for s in sems]
    ax.bar(xs, [100 * m for m in means], yerr=err, capsize=6, color=["#4c72b0", "#dd8452"][: len(arms)])
    for x, m, s, e, t in zip(xs, means, sems, err, trunc):  # label above the error bar
        sem = "no SEM (1 seed)" if s is None else f"SEM {100*s:.2f}"
        ax.text(x, 100 * m + e + 2, f"{100*m:.1f}% ({sem})\ntruncated {100*t:.1f}%", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), list(arms))
    ax.set_ylabel("pass@1 (%)")
    ax.set_ylim(0, 125)
    ax.set_title(title, fontsize=10)
    if diff:
        d, ci, verdict = diff
        ax2 = axes[0][1]
        ax2.axhline(0.0, color="grey", linewidth=0.8)
        yerr = None if ci is None else [[d - ci[0]], [ci[1] - d]]
        ax2.errorbar([0], [d], yerr=yerr, fmt="o", capsize=8, color="#c44e52")
        ax2.set_xticks([0], [f"{arms[1]} - {arms[0]}"])
        ax2.set_xlim(-1, 1)
        ax2.set_ylabel("difference (pp), 95% bootstrap CI")
        lo, hi = (d, d) if ci is None else ci
        pad = max(1.0, 0.2 * (hi - lo))
        ax2.set_ylim(min(lo, 0.0) - pad, max(hi, 0.0) + pad)
        ax2.set_title("\n".join(_wrap(verdict, 45)), fontsize=8)
    return _save(fig, path)


def _wrap(text: str, width: int) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width) or [""]


def divergence_histogram(path: Path, positions: Sequence[int], identical: int, total: int, title: str) -> Path:
    """First-divergence token positions of the greedy pass."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    from matplotlib.ticker import MaxNLocator

    if positions:
        hi = max(positions) + 1
        width = max(1, -(-hi // 40))  # integer-wide bins, at most 40 of them, starting at token 0
        ax.hist(list(positions), bins=list(range(0, hi + width, width)), color="#55a868", align="left", rwidth=0.9)
    else:
        ax.text(0.5, 0.5, "no divergent prompt", transform=ax.transAxes, ha="center", va="center")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlim(left=-0.5)
    ax.set_xlabel("first divergent token position")
    ax.set_ylabel("prompts")
    ax.set_title(f"{title}\n{identical}/{total} prompts with identical token streams")
    return _save(fig, path)
