"""exactrl's own run directories, read from what exactrl wrote there: `exactrl audit run` recognises
one by its manifest.json (``versions.exactrl``) before reading it as another framework's files
(its config.yaml has ``train.micro_batch_size``, which is also an OpenRLHF flag).

What each file says:
- manifest.json: the installed versions, the launch's world size (``world_size``; a Ray run's
  trainer ranks under ``ray.ranks``), the faults injected on purpose, a study cell's overrides;
- config.yaml: the resolved config of the run, or of each phase (a pipeline's ``sft/`` and ``rl/``
  hold their own; a study's cells train its ``base`` / ``sft`` / ``rl`` / ``mixed`` section with
  the cell's overrides): backend, ZeRO stage, offload, batch sizes, the canary's policy;
- status.json (a study cell: error.txt) and result.json / cell.json / base.json: how it ended,
  the canary's stop among the ways;
- metrics.jsonl: the canary's reading of each logged step (``canary``, ``critic_canary``) and the
  running count of steps it flagged under ``audit.canary=warn`` (``canary_fired``).
The judging is exactrl/audit/own_judging.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from exactrl.audit.evidence import Doc, Evidence

MANIFEST, CONFIG, METRICS, STATUS = "manifest.json", "config.yaml", "metrics.jsonl", "status.json"
FINISHED = ("result.json", "cell.json", "base.json")  # a pipeline phase's, a study cell's, a study base's
PHASES = ("sft", "rl")  # a pipeline's (and the demo's), in the order they run


@dataclass
class Settings:
    """A phase's resolved settings by dotted key, each with the line that says it: a section of a
    config.yaml, under the overrides a study cell trained with."""

    doc: Doc | None
    overrides: dict[str, tuple[Any, Evidence]] = field(default_factory=dict)

    def get(self, key: str) -> tuple[Any, Evidence] | None:
        if key in self.overrides:
            return self.overrides[key]
        return self.doc.get(*key.split(".")) if self.doc is not None else None

    def value(self, key: str, default: Any = None) -> Any:
        got = self.get(key)
        return default if got is None else got[0]


@dataclass
class Phase:
    name: str  # sft, rl, base (a study's pretraining)
    settings: Settings
    manifest: Doc | None  # the phase's own manifest (a phase launched as a command of its own), else the run's
    metrics: list[tuple[dict, Evidence]]
    stop: tuple[str, Evidence] | None  # the canary's message, where it stopped the phase
    finished: Evidence | None  # what says the phase finished (status.json's success, result.json...)
    where: str = ""  # its directory, relative to the run's ("" or "sft/")


@dataclass
class OwnRun:
    root: Path
    manifest: Doc  # the one with the versions (a pipeline phase's directory: its pipeline's)
    phases: list[Phase]
    problems: list[tuple[str, str, Evidence]]  # (kind, message, evidence)


def _doc(path: Path, name: str) -> Doc | None:
    try:
        return Doc.parse(name, path.read_text(errors="replace"), "json" if path.suffix == ".json" else "yaml")
    except (OSError, ValueError):
        return None


def _manifest(directory: Path, name: str = MANIFEST) -> Doc | None:
    doc = _doc(directory / MANIFEST, name) if (directory / MANIFEST).is_file() else None
    return doc if doc is not None and isinstance(doc.data, dict) else None


def _exactrl(doc: Doc | None) -> bool:
    return doc is not None and isinstance(doc.node("versions"), dict) and bool(doc.node("versions", "exactrl"))


def run_root(path: Path) -> Path | None:
    """The directory of the exactrl run ``path`` is (it, or a file in it: its config.yaml alone would read as
    OpenRLHF's), or None."""
    directory = path.parent if path.is_file() else path
    if not directory.is_dir():
        return None
    if _exactrl(_manifest(directory)):
        return directory
    # a pipeline phase's directory: the versions are in its pipeline's manifest
    return directory if (directory / CONFIG).is_file() and _exactrl(_manifest(directory.parent)) else None


def study_cells(root: Path) -> list[Path] | None:
    """A study's directories that trained (its base model, then each cell), or None if ``root`` is no study."""
    manifest = _manifest(root)
    if manifest is None or not isinstance(manifest.node("study"), dict):
        return None
    found = [m.parent for m in [*root.glob(f"*/{MANIFEST}"), *root.glob(f"*/*/{MANIFEST}")]
             if (doc := _manifest(m.parent)) is not None and (doc.has("study_cell") or doc.has("study_base"))]
    return sorted(found, key=lambda p: (p.parent != root, str(p)))  # the base first


def metrics(path: Path, name: str) -> list[tuple[dict, Evidence]]:
    out = []
    try:
        lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
    except OSError:
        return out
    for i, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append((record, Evidence(name, i, line.strip()[:200])))
    return out


def _status(directory: Path, name: str) -> tuple[tuple[str, Evidence] | None, Evidence | None]:
    """(the canary's stop message, what says it finished) from status.json or a study cell's files."""
    status = _doc(directory / STATUS, name + STATUS) if (directory / STATUS).is_file() else None
    if status is not None and isinstance(status.data, dict):
        state = status.node("state")
        if state == "canary":
            return (str(status.node("message")), status.evidence("message")), None
        if state == "success":
            return None, status.evidence("state")
    error = directory / "error.txt"
    if error.is_file():
        first = (error.read_text(errors="replace").splitlines() or [""])[0]
        if first.startswith("CanaryError:"):
            return (first.removeprefix("CanaryError:").strip(), Evidence(name + "error.txt", 1, first[:200])), None
    done = next((f for f in FINISHED if (directory / f).is_file()), None)
    return None, Evidence(name + done, None, f"{done}: the phase finished") if done else None


def _overrides(manifest: Doc, section: str) -> dict[str, tuple[Any, Evidence]]:
    out: dict[str, tuple[Any, Evidence]] = {}
    if section == "mixed":  # the cell runs the mixed section as its method's algorithm (exactrl/pipelines/study.py)
        out["algo.name"] = (manifest.node("study_cell", "method"), manifest.evidence("study_cell", "method"))
    overrides = manifest.node("study_cell", "overrides")
    for i, text in enumerate(overrides if isinstance(overrides, list) else []):
        key, eq, value = str(text).partition("=")
        if eq:
            try:
                parsed = yaml.safe_load(value)
            except yaml.YAMLError:
                parsed = value
            out[key.strip()] = (parsed, manifest.evidence("study_cell", "overrides", i))
    return out


def _study_phase(root: Path, manifest: Doc) -> tuple[list[Phase], list[tuple[str, str, Evidence]]]:
    """A study's cell (or base model): the study's config section it trained, under its overrides."""
    from exactrl.config.schema_study import SFT_BASED

    study = next((p for p in (root.parent, root.parent.parent) if (m := _manifest(p)) and m.has("study")), None)
    config = _doc(study / CONFIG, os.path.relpath(study / CONFIG, root)) if study is not None else None
    if config is None:
        return [], [("missing", f"{CONFIG} of the study this cell belongs to is not beside it: audit the cell "
                                "inside its study directory", Evidence(MANIFEST, None, ""))]
    method = str(manifest.node("study_cell", "method") or "sft")
    section = ("base" if manifest.has("study_base") else "sft" if method == "sft" else "rl" if method in SFT_BASED
               else "mixed")
    settings = Settings(config.sub(section), {} if section == "base" else _overrides(manifest, section))
    stop, finished = _status(root, "")
    name = "base" if section == "base" else "sft" if section == "sft" else "rl"
    return [Phase(name, settings, manifest, metrics(root / METRICS, METRICS), stop, finished)], []


def read_own_run(root: Path) -> OwnRun:
    """The phases of the exactrl run in ``root`` (run_root says whether it is one)."""
    manifest = _manifest(root)
    own = manifest if _exactrl(manifest) else None
    versions = own or _manifest(root.parent, f"../{MANIFEST}")
    if own is not None and (own.has("study_cell") or own.has("study_base")):
        phases, problems = _study_phase(root, own)
        return OwnRun(root, own, phases, problems)
    config = _doc(root / CONFIG, CONFIG) if (root / CONFIG).is_file() else None
    if config is None:
        return OwnRun(root, versions, [], [("missing", f"{CONFIG} (the run's resolved config) is not in the run "
                                                       "directory", Evidence(CONFIG, None, ""))])
    stop, finished = _status(root, "")
    if config.has("train"):  # one training phase: sft, rl (and the mixed methods), rm, dpo...
        name = str((_doc(root / STATUS, STATUS) or config).node("command") or "train")
        return OwnRun(root, versions, [Phase(name, Settings(config), manifest, metrics(root / METRICS, METRICS), stop,
                                             finished)], [])
    phases = []
    present = [p for p in PHASES if config.has(p) and (root / p / CONFIG).is_file()]
    for name in present:
        where = root / name
        doc = _doc(where / CONFIG, f"{name}/{CONFIG}")
        own_stop, own_finished = _status(where, f"{name}/")
        launched = (where / STATUS).is_file()  # a phase of several processes ran as a command of its own
        last = name == present[-1]
        phases.append(Phase(name, Settings(doc), _manifest(where, f"{name}/{MANIFEST}") if launched else manifest,
                            metrics(where / METRICS, f"{name}/{METRICS}"),
                            own_stop if launched else stop if last else None, own_finished or (
                                finished if not launched and last else None), f"{name}/"))
    return OwnRun(root, versions, phases, [])


def iter_readings(phase: Phase, keys: tuple[str, ...]) -> Iterator[tuple[dict, Evidence, str, float]]:
    """(record, evidence, key, value) for every reading of ``keys`` the phase's metrics logged."""
    for record, evidence in phase.metrics:
        for key in keys:
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                yield record, evidence, key, float(value)
