"""The retrieval heatmap and the loss curves (msa_train/quality/plots.py)."""
import pytest

from msa_train.quality.plots import heatmap_figure, moving_mean, write_curves, write_heatmap


def test_heatmap_axes_and_png(tmp_path):
    table = {"passkey": {"4096": {"0": 1.0, "0.5": 0.5, "1": 0.0}, "2048": {"0": 1.0, "0.5": 1.0, "1": 1.0}},
             "multi_key": {"2048": {"0": 0.25, "1": 0.75}}}
    results = {"full": table, "fmsa": {"passkey": table["passkey"]}}
    fig = heatmap_figure(results)
    grid = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"][:4]  # rows: tasks (sorted), columns: backends
    titles = [ax.get_title() for ax in grid]
    assert titles == ["full: multi_key", "", "full: passkey", "fmsa: passkey"]
    ax = grid[2]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["2K", "4K"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0.00", "0.50", "1.00"]
    image = ax.get_images()[0].get_array()
    assert image.shape == (3, 2) and image[2, 1] == 0.0 and image[1, 1] == 0.5 and image[0, 0] == 1.0
    path = write_heatmap(results, tmp_path / "h.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_moving_mean_is_the_trailing_mean_of_the_window():
    assert moving_mean([4.0, 2.0, 6.0, 0.0], 2) == [4.0, 3.0, 4.0, 3.0]
    assert moving_mean([4.0, 2.0, 6.0], 5) == [4.0, 3.0, 4.0]  # the first points average what there is
    assert moving_mean([1.0, 5.0], 1) == [1.0, 5.0]
    with pytest.raises(ValueError, match="window"):
        moving_mean([1.0], 0)


def test_smoothed_curves_say_so_on_the_axis(tmp_path, monkeypatch):
    import matplotlib.figure

    labels, ys = [], []
    real = matplotlib.figure.Figure.savefig

    def record(fig, *a, **k):
        labels.append(fig.axes[0].get_ylabel())
        ys.append(list(fig.axes[0].lines[0].get_ydata()))
        return real(fig, *a, **k)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    pts = [(i, float(i % 3)) for i in range(30)]
    write_curves({"a": pts}, tmp_path / "raw.png", "step", "training loss")
    write_curves({"a": pts}, tmp_path / "smooth.png", "step", "training loss", smooth=3)
    assert labels == ["training loss", "training loss (mean of 3 steps)"]
    assert ys[0][:4] == [0.0, 1.0, 2.0, 0.0] and ys[1][:4] == [0.0, 0.5, 1.0, 1.0]
    assert (tmp_path / "smooth.png").read_bytes()[:4] == b"\x89PNG"
