"""The training-curve plot of a run directory."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from exactrl.metrics import read_metrics


def plot_run(run_dir: Path, milestones: list[tuple[str, float, tuple[float, float]]] | None = None,
             records: list[dict] | None = None) -> Path:
    """SFT loss, RL reward and held-out greedy accuracy against the optimizer step.

    The accuracy panel runs SFT steps then RL steps on one axis; ``milestones`` (name,
    accuracy, 95% CI) are drawn with error bars at the start, the SFT/RL boundary and the end.
    ``records``: the metrics to draw (default: the run directory's metrics.jsonl).
    """
    records = read_metrics(run_dir / "metrics.jsonl") if records is None else records
    sft_steps = max((r["step"] for r in records if r.get("phase") == "sft"), default=0)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for phase, ax, key, label in (("sft", axes[0], "loss", "SFT loss"), ("rl", axes[
        1], "reward_mean", "RL mean reward")):
        pts = [(r["step"], r[key]) for r in records if r.get("phase") == phase and key in r]
        if pts:
            ax.plot(*zip(*pts))
        ax.set_title(label)
        ax.set_xlabel(f"{phase.upper()} optimizer step")
    ax = axes[2]
    for phase, offset in (("sft", 0), ("rl", sft_steps)):
        pts = [(offset + r["step"], r["eval_accuracy"]) for r in records if r.get("phase") == phase
               and "eval_accuracy" in r]
        if pts:
            ax.plot(*zip(*pts), "o-", label=f"during {phase.upper()} (eval subset)")
    if milestones:
        rl_steps = max((r["step"] for r in records if r.get("phase") == "rl"), default=0)
        xs = [0, sft_steps, sft_steps + rl_steps][: len(milestones)]
        values = [v for _, v, _ in milestones]
        yerr = [[max(0.0, v - lo) for _, v, (lo, _) in milestones], [max(0.0, hi - v) for _, v, (_, hi) in milestones]]
        ax.errorbar(xs, values, yerr=yerr, fmt="D", color="black", capsize=5, label="phase end (all eval, 95% CI)")
    ax.axvline(sft_steps, color="grey", linestyle=":")
    ax.set_title("held-out greedy accuracy")
    ax.set_xlabel("optimizer step (SFT, then RL)")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    if milestones:  # placed once the layout is final: where they land on the page decides what overlaps
        _label(fig, ax, [(x, v, f"{name}\n{100 * v:.1f}%") for x, (name, v, _) in zip(xs, milestones)])
    path = run_dir / "plot.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# Where a milestone's label may go, in points from its marker, first choice first: below it, above it, then beside.
PLACES = (((0, -12), "center", "top"), ((0, 12), "center", "bottom"), ((-8, -12), "right", "top"),
          ((8, -12), "left", "top"), ((-8, 12), "right", "bottom"), ((8, 12), "left", "bottom"))


def _label(fig, ax, points: list[tuple[float, float, str]]) -> None:
    """Each (x, y, text) labelled at the first place of PLACES inside the panel where it overlaps neither the
    legend nor a label placed before it (a short RL phase puts after_sft and after_rl a few pixels apart)."""
    renderer = fig.canvas.get_renderer()
    panel, taken = ax.get_window_extent(renderer), [ax.get_legend().get_window_extent(renderer)]
    for x, y, text in points:
        for offset, ha, va in PLACES:
            label = ax.annotate(text, (x, y), textcoords="offset points", xytext=offset, ha=ha, va=va, fontsize=8)
            box = label.get_window_extent(renderer)
            inside = panel.x0 <= box.x0 and box.x1 <= panel.x1 and panel.y0 <= box.y0 and box.y1 <= panel.y1
            if inside and not any(box.overlaps(other) for other in taken):
                break
            label.remove()
        else:  # crowded everywhere: below, as before
            label = ax.annotate(text, (x, y), textcoords="offset points", xytext=PLACES[0][0], ha="center", va="top",
                                fontsize=8)
            box = label.get_window_extent(renderer)
        taken.append(box)
