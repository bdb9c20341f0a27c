"""The pipeline's plot (exactrl/report.py): its milestone labels stay apart and inside their panel, however
short a phase is."""

from __future__ import annotations

import pytest

from exactrl import report


@pytest.mark.parametrize("sft_steps,rl_steps,values", [
    (200, 2, (0.02, 0.40, 0.41)),  # a short RL phase: after_sft and after_rl a few pixels apart
    (2, 200, (0.30, 0.31, 0.70)),  # a short SFT phase: before and after_sft
    (1, 1, (0.5, 0.5, 0.5)),  # both short, and level
    (100, 100, (0.01, 0.5, 0.99)),  # the panel's edges
])
def test_milestone_labels_do_not_overlap(tmp_path, monkeypatch, sft_steps, rl_steps, values):
    figures = []
    monkeypatch.setattr(report.plt, "close", figures.append)  # keep the figure to measure it
    records = [{"phase": "sft", "step": s, "loss": 1.0 / s} for s in range(1, sft_steps + 1)]
    records += [{"phase": "rl", "step": s, "reward_mean": 0.5} for s in range(1, rl_steps + 1)]
    names = ("before", "after_sft", "after_rl")
    report.plot_run(tmp_path, [(n, v, (v - 0.03, v + 0.03)) for n, v in zip(names, values)], records)
    assert (tmp_path / "plot.png").stat().st_size > 0
    (fig,) = figures
    ax = fig.axes[2]
    renderer = fig.canvas.get_renderer()
    labels = {t.get_text().split("\n")[0]: t.get_window_extent(renderer) for t in ax.texts}
    assert sorted(labels) == sorted(names)
    panel = ax.get_window_extent(renderer)
    for i, a in enumerate(names):
        box = labels[a]
        assert panel.x0 <= box.x0 and box.x1 <= panel.x1 and panel.y0 <= box.y0 and box.y1 <= panel.y1, a
        for b in names[:i]:
            assert not box.overlaps(labels[b]), (a, b)
