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
        for x, (name, v, _) in zip(xs, milestones):
            ax.annotate(f"{name}\n{100 * v:.1f}%", (x, v), textcoords="offset points", xytext=(0, -28), ha="center",
                        fontsize=8)
    ax.axvline(sft_steps, color="grey", linestyle=":")
    ax.set_title("held-out greedy accuracy")
    ax.set_xlabel("optimizer step (SFT, then RL)")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path = run_dir / "plot.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
