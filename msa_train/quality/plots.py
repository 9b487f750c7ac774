"""Plots of the quality study (matplotlib, Agg): retrieval heatmaps and loss curves."""
from __future__ import annotations

from pathlib import Path
from typing import List, Mapping, Sequence, Tuple

Retrieval = Mapping[str, Mapping[str, Mapping[str, float]]]  # task -> length -> depth -> accuracy


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _axes_of(table: Mapping[str, Mapping[str, float]]) -> Tuple[List[str], List[str]]:
    lengths = sorted(table, key=int)
    depths = sorted({d for row in table.values() for d in row}, key=float)
    return lengths, depths


def _length_label(n: str) -> str:
    n = int(n)
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def heatmap_figure(results: Mapping[str, Retrieval], title: str = ""):
    """One heatmap per (task, backend): rows are tasks, columns the backends side by side; each map
    has the context length on x and the needle depth on y (0 = start of the haystack, at the top),
    coloured by exact-match accuracy from 0 to 1, with the cell values written in."""
    plt = _pyplot()
    backends = list(results)
    tasks = sorted({t for r in results.values() for t in r})
    if not backends or not tasks:
        raise ValueError("heatmap: no retrieval results")
    fig, axes = plt.subplots(len(tasks), len(backends), figsize=(3.6 * len(backends) + 1, 3.0 * len(tasks)),
                             squeeze=False, constrained_layout=True)
    image = None
    for i, task in enumerate(tasks):
        for j, backend in enumerate(backends):
            ax = axes[i][j]
            table = results[backend].get(task, {})
            if not table:
                ax.set_axis_off()
                continue
            lengths, depths = _axes_of(table)
            grid = [[table[n].get(d, float("nan")) for n in lengths] for d in depths]
            image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
            ax.set_xticks(range(len(lengths)), [_length_label(n) for n in lengths])
            ax.set_yticks(range(len(depths)), [f"{float(d):.2f}" for d in depths])
            if len(lengths) * len(depths) <= 120:
                for y, row in enumerate(grid):
                    for x, v in enumerate(row):
                        ax.text(x, y, f"{v:.1f}" if v == v else "", ha="center", va="center", fontsize=6)
            ax.set_title(f"{backend}: {task}", fontsize=9)
            ax.set_xlabel("context length (tokens)", fontsize=8)
            ax.set_ylabel("needle depth", fontsize=8)
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.6, label="exact-match accuracy")
    if title:
        fig.suptitle(title)
    return fig


def write_heatmap(results: Mapping[str, Retrieval], path, title: str = "") -> Path:
    """``heatmap_figure`` written as a PNG at ``path``."""
    plt = _pyplot()
    fig = heatmap_figure(results, title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def moving_mean(ys: Sequence[float], window: int) -> List[float]:
    """The trailing mean of up to ``window`` points at every point (the first points average fewer)."""
    if window < 1:
        raise ValueError(f"window: expected an integer >= 1, got {window}")
    out, total = [], 0.0
    for i, y in enumerate(ys):
        total += y
        if i >= window:
            total -= ys[i - window]
        out.append(total / min(i + 1, window))
    return out


def write_curves(curves: Mapping[str, Sequence[Tuple[float, float]]], path, xlabel: str, ylabel: str,
                 title: str = "", logx: bool = False, smooth: int = 1) -> Path:
    """Several (x, y) curves on one plot (loss against tokens or seconds, loss by position); with
    ``smooth`` > 1 each y is the trailing mean of ``smooth`` points, said in the y label (a step of
    one 16K-token sequence is a noisy loss: code, prose or synthetic questions)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    if smooth > 1:
        ylabel = f"{ylabel} (mean of {smooth} steps)"
    for name, pts in curves.items():
        if pts:
            xs, ys = zip(*pts)
            ys = moving_mean(ys, smooth)
            ax.plot(xs, ys, label=name, marker="o" if len(pts) < 20 else None, markersize=3)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    if any(curves.values()):
        ax.legend()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
