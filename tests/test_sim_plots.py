"""Simulation plots a user reads at a glance: plain log-tick labels, the target crossing of each method, the
scenario's name in every title, nothing clipped (``simulations.plots``)."""

from __future__ import annotations

from simulations import plots
from simulations.runner import MethodResult


def test_tick_labels_are_plain_units():
    assert [plots.fmt_seconds(v) for v in (0.5, 2, 17.309, 200, 2000, 36000)] == [
        "0.5 s", "2 s", "17.3 s", "200 s", "2,000 s", "10 h"]
    assert [plots.fmt_bytes(v) for v in (500, 2e3, 2e6, 1.5e9, 123_456_789)] == [
        "500 B", "2 kB", "2 MB", "1.5 GB", "123 MB"]


def test_the_target_crossing_is_the_first_evaluated_row_at_or_above_it():
    rows = [{"time": 1.0, "accuracy": 0.4, "wire_bytes_total": 10},
            {"time": 2.0, "wire_bytes_total": 20},
            {"time": 3.0, "accuracy": 0.9, "wire_bytes_total": 30},
            {"time": 4.0, "accuracy": 0.95, "wire_bytes_total": 40}]
    assert plots._crossing(rows, "time", 0.9) == (3.0, 90.0)
    assert plots._crossing(rows, "wire_bytes_total", 0.9) == (30, 90.0)
    assert plots._crossing(rows, "time", 0.99) is None


def test_every_plot_is_titled_with_the_scenario_and_no_curve_is_clipped(tmp_path, monkeypatch):
    rows = [{"time": t, "accuracy": a, "wire_bytes_total": 1e6 * t} for t, a in ((1, 0.05), (10, 0.5), (100, 0.97))]
    nodes = [{"client": 0, "link": "lte", "wire_bytes_up": 5e5, "wire_bytes_down": 2e6}]
    res = [MethodResult("m", rows, {}, nodes, {0: 3})]
    seen = []
    plt = plots._plt()
    real_savefig = plt.Figure.savefig

    def spy(fig, path, *a, **k):
        texts = [ax.get_title() for ax in fig.axes] + ([fig._suptitle.get_text()] if fig._suptitle else [])
        limits = [(ax.get_ylim(), ax.get_xlim()) for ax in fig.axes]
        seen.append((path.name, texts, limits))
        return real_savefig(fig, path, *a, **k)

    monkeypatch.setattr(plt.Figure, "savefig", spy)
    paths = plots.plot_all(res, tmp_path, 0.95, "main")
    assert [p.name for p in paths] == ["accuracy_vs_time.png", "accuracy_vs_wire_bytes.png", "bytes_per_client.png",
                                       "staleness.png"]
    for name, texts, limits in seen:
        assert any("scenario main" in t for t in texts), (name, texts)
        if name.startswith("accuracy"):
            (ylo, yhi), (xlo, xhi) = limits[0]
            assert ylo <= 5.0 and yhi >= 97.0, name  # the lowest and highest accuracies are on the plot
            x = "time" if "time" in name else "wire_bytes_total"
            assert xlo <= min(r[x] for r in rows) and xhi >= max(r[x] for r in rows)


def test_a_method_at_the_target_from_the_start_is_marked_so_and_the_target_line_is_in_view(tmp_path, monkeypatch):
    """The table says 0 s when the starting model meets the target; the plot marked a crossing at the first
    evaluated row (9.09 s), and a target under every accuracy was off the plot."""
    rows = [{"time": t, "accuracy": a, "wire_bytes_total": 1e6 * t} for t, a in ((1, 0.3), (10, 0.5), (100, 0.97))]
    res = [MethodResult("m", rows, {"initial_accuracy": 0.08}, [], {0: 3})]
    seen = []
    plt = plots._plt()
    real_savefig = plt.Figure.savefig

    def spy(fig, path, *a, **k):
        if path.name.startswith("accuracy"):
            ax = fig.axes[0]
            seen.append((ax.get_ylim(), [ln.get_label() for ln in ax.get_lines()],
                         [ln.get_xdata()[0] for ln in ax.get_lines() if ln.get_marker() == "o"]))
        return real_savefig(fig, path, *a, **k)

    monkeypatch.setattr(plt.Figure, "savefig", spy)
    plots.plot_all(res, tmp_path, 0.05, "tiny")
    assert len(seen) == 2
    for (ylo, yhi), labels, marked in seen:
        assert ylo <= 5.0 <= yhi, (ylo, yhi)  # the 5% target line is in view
        assert "m (at the target from the start)" in labels and marked == [], (labels, marked)
