"""A study's figures: accuracy with 95% intervals over seeds and problems, paired differences,
the tables (clean, and each --with-bugs grid beside it), the accuracy-against-FLOPs plot,
summary.json and report.md.

Intervals are percentile bootstraps over both sources of noise at once: each draw resamples the
seeds and, independently, the held-out problems (the same problems for every seed, so the two
are crossed, not nested), and takes the mean correctness of the resampled cells. A difference
between two methods resamples the seeds both finished and the same problems for both (paired),
so it is far tighter than the two intervals side by side suggest.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from rich.console import Console
from rich.table import Table

from exactrl.config.schema_study import SFT_BASED, StudyConfig

DRAWS = 2000
REFERENCE = "sft_rl"  # differences are taken against SFT-then-RL, the seed paper's claim


def outcomes(results: dict, grid: str, method: str, cfg: StudyConfig) -> dict[int, list[int]]:
    """Seed -> per-problem correctness of ``method`` in ``grid`` (a method a bugs grid does not
    run with faults keeps its clean cells)."""
    source = grid if grid == "clean" or method in cfg.bugs.methods else "clean"
    return {c.seed: r["outcomes"] for c, r in results.items() if c.grid == source and c.method == method}


def _draws(matrix: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """DRAWS bootstrap means of ``matrix`` [seeds, problems], seeds and problems resampled independently."""
    seeds = rng.integers(0, matrix.shape[0], size=(DRAWS, matrix.shape[0], 1))
    problems = rng.integers(0, matrix.shape[1], size=(DRAWS, 1, matrix.shape[1]))
    # 200 draws at a time: a [draws, seeds, problems] gather of all of them at once can take gigabytes
    return np.concatenate([matrix[seeds[i : i + 200], problems[i : i + 200]].mean(axis=(1, 2))
                           for i in range(0, DRAWS, 200)])


def interval(by_seed: dict[int, list[int]], other: dict[int, list[int]] | None = None) -> tuple[float, float, float]:
    """(estimate, low, high): the mean correctness over seeds and problems with its 95% bootstrap
    interval; with ``other``, of the difference (paired over the seeds both have)."""
    seeds = sorted(by_seed if other is None else set(by_seed) & set(other))
    if not seeds:
        return (float("nan"),) * 3
    a = np.array([by_seed[s] for s in seeds], dtype=np.float64)
    b = np.zeros_like(a) if other is None else np.array([other[s] for s in seeds], dtype=np.float64)
    draws = _draws(a - b, np.random.default_rng(0))
    low, high = np.percentile(draws, [2.5, 97.5])
    return float((a - b).mean()), float(low), float(high)


def _pct(x: tuple[float, float, float], signed: bool = False) -> str:
    if np.isnan(x[0]):
        return "-"
    sign = "+" if signed else ""
    return f"{100 * x[0]:{sign}.1f} [{100 * x[1]:{sign}.1f}, {100 * x[2]:{sign}.1f}]"


def grid_rows(cfg: StudyConfig, grid: str, results: dict) -> list[dict]:
    """One row per method of the grid: accuracy, difference to SFT-then-RL, FLOPs, wall time, rank."""
    ref = outcomes(results, grid, REFERENCE, cfg) if REFERENCE in cfg.methods else None
    rows = []
    for m in cfg.methods:
        by_seed = outcomes(results, grid, m, cfg)
        cells = [r for c, r in results.items() if c.method == m and c.grid == (
            grid if grid == "clean" or m in cfg.bugs.methods else "clean")]
        rows.append({"method": m, "seeds": len(by_seed), "accuracy": interval(by_seed),
                     "vs_reference": interval(by_seed, ref) if ref and m != REFERENCE else (float("nan"),) * 3,
                     "flops": float(np.mean([r["flops"] for r in cells])) if cells else float("nan"),
                     "seconds": float(np.mean([r["seconds"] for r in cells])) if cells else float("nan"),
                     "canary_flagged": sum(r.get("canary_flagged", 0) for r in cells),
                     "faulty": grid != "clean" and m in cfg.bugs.methods})
    scores = [r["accuracy"][0] for r in rows if r["seeds"]]
    for r in rows:  # 1 + how many did better: ties share a place
        if r["seeds"]:
            r["rank"] = 1 + sum(x > r["accuracy"][0] for x in scores)
    return rows


def _table(title: str, rows: list[dict]) -> Table:
    t = Table(title=title)
    for col in ("method", "greedy accuracy % [95% CI]", f"vs {REFERENCE} (points)", "FLOPs", "wall time", "rank"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["method"] + (" (fault)" if r["faulty"] else ""), _pct(r["accuracy"]),
                  _pct(r["vs_reference"], signed=True), f"{r['flops']:.3g}", f"{r['seconds']:.0f} s",
                  str(r.get("rank", "-")))
    return t


def _bugs_table(grids: list[str], rows: dict[str, list[dict]]) -> Table:
    t = Table(title="The bugs, side by side: accuracy % [95% CI] (rank) per grid")
    t.add_column("method")
    for g in grids:
        t.add_column(g)
    for i, r in enumerate(rows["clean"]):
        cells = []
        for g in grids:
            x = rows[g][i]
            mark = " *" if x["faulty"] else ""
            cells.append(f"{_pct(x['accuracy'])} ({x.get('rank', '-')}){mark}")
        t.add_row(r["method"], *cells)
    return t


def _moves(cfg: StudyConfig, grids: list[str], results: dict) -> list[str]:
    """What each bug did: how far it moved each faulty method (paired over seeds and problems),
    whether SFT-then-RL's rank changed, and what the canary said."""
    lines = []
    clean = {r["method"]: r for r in grid_rows(cfg, "clean", results)}
    for g in grids[1:]:
        rows = {r["method"]: r for r in grid_rows(cfg, g, results)}
        for m in (m for m in cfg.methods if m in cfg.bugs.methods):
            moved = interval(outcomes(results, g, m, cfg), outcomes(results, "clean", m, cfg))
            lines.append(f"- **{g}** moved **{m}** by {_pct(moved, signed=True)} points "
                         f"(rank {clean[m].get('rank', '-')} -> {rows[m].get('rank', '-')}); the canary flagged "
                         f"{rows[m]['canary_flagged']} steps")
    return lines


def plot(path: Path, grids: list[str], rows: dict[str, list[dict]]) -> None:
    fig, ax = plt.subplots(figsize=(8, 5))
    for g, marker in zip(grids, "osD^v<>"):
        pts = [r for r in rows[g] if r["seeds"] and (g == "clean" or r["faulty"])]
        for r in pts:
            acc = r["accuracy"]
            ax.errorbar(r["flops"], 100 * acc[0], yerr=[[100 * (acc[0] - acc[1])], [100 * (acc[2] - acc[0])]],
                        fmt=marker, capsize=3, label=f"{g}: {r['method']}")
            ax.annotate(r["method"], (r["flops"], 100 * acc[0]), fontsize=7, xytext=(4, 4),
                        textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("total FLOPs (6ND training, 2ND generation)")
    ax.set_ylabel("held-out greedy accuracy (%)")
    ax.legend(fontsize=6, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_study_report(where: Path, cfg: StudyConfig, grids: list[str], cells: list, results: dict,
                       failures: dict, console: Console, base: dict | None = None) -> dict:
    rows = {g: grid_rows(cfg, g, results) for g in grids}
    tables = [_table(f"Study: held-out accuracy on {cfg.eval_size} problems x {len(cfg.seeds)} seed(s)", rows["clean"])]
    if len(grids) > 1:
        tables.append(_bugs_table(grids, rows))
    for t in tables:
        console.print(t, width=140)
    moves = _moves(cfg, grids, results) if len(grids) > 1 else []
    for line in moves:
        console.print(line.replace("**", ""), soft_wrap=True)
    missing = [c for c in cells if c not in results]
    if missing:
        console.print(f"[red]{len(missing)} cell(s) did not finish[/red]: "
                      + ", ".join(f"{c.folder}/{c.name}" for c in missing) + " (run the study again with "
                      f"output_dir={where} to retry them)", soft_wrap=True)
    plot(where / "plot.png", grids, rows)
    start = ("the task's initial model" if base is None else
             f"the base model (the initial model pretrained on the task's problems worked with every carry forgotten: "
             f"{100 * base['accuracy']:.1f}% greedy, {base['flops']:.3g} FLOPs counted in no cell)")
    summary = {"start": None if base is None else {k: v for k, v in base.items() if k != "outcomes"},
               "grids": {g: rows[g] for g in grids}, "failed": {f"{c.folder}/{c.name}": failures.get(c, "not run")
                                                                 for c in missing}}
    (where / "summary.json").write_text(json.dumps(summary, indent=2))
    text = Console(record=True, width=140, file=open("/dev/null", "w"))
    for t in tables:
        text.print(t)
    sft_based = ", ".join(m for m in cfg.methods if m in SFT_BASED)
    report = ["# exactrl study", "",
              f"Methods {', '.join(cfg.methods)} x seeds {cfg.seeds}, at equal data (the task's SFT problems and "
              f"their demonstrations), each starting from {start}; every cell's final model answers the same "
              f"{cfg.eval_size} held-out problems greedily. Intervals: 95% bootstrap over seeds and problems; "
              "differences paired. FLOPs: 6ND per trained token, 2ND per generated one (N parameters). SFT-based "
              "methods (" + sft_based + ") include "
              "their SFT phase in FLOPs and wall time.", "",
              "```", text.export_text().rstrip(), "```", "",
              *(["## What the bugs did", "", *moves, ""] if moves else []),
              *(["## Cells that did not finish", "", *(f"- {k}: {v}" for k, v in summary["failed"].items()), ""]
                if missing else []),
              "![accuracy against FLOPs](plot.png)", ""]
    (where / "report.md").write_text("\n".join(report))
    console.print(f"study directory: {where}  (report.md, summary.json, plot.png, one directory per cell)")
    return summary
