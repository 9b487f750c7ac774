"""The retrieval heatmap (msa_train/quality/plots.py)."""
from msa_train.quality.plots import heatmap_figure, write_heatmap


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
