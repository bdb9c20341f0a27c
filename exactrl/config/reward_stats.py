"""reward_stats.json: what `exactrl rm` saves beside a reward model (its score statistics; a process reward model's
kind and step separator), and its kind, which the config's checks (config/used.py) and the run's
(workers/reward_model.py) both read."""

from __future__ import annotations

import json
from pathlib import Path

STATS_FILE = "reward_stats.json"  # beside a trained reward model's config.json


def saved_kind(directory: str | Path) -> str | None:
    """"process" for a process reward model's directory (its reward_stats.json says kind: process), "pairwise" for
    another (a pairwise run's names no kind; a directory without the file is taken as one), None when the file is
    not the JSON object `exactrl rm` writes (workers/reward_model.py names the error)."""
    stats = Path(directory) / STATS_FILE
    if not stats.is_file():
        return "pairwise"
    try:
        saved = json.loads(stats.read_text())
    except ValueError:
        return None
    if not isinstance(saved, dict):
        return None
    return "process" if saved.get("kind") == "process" else "pairwise"
