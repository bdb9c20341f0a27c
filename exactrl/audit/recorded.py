"""What an exactrl run records in its manifest.json about the maths it chose, and `exactrl audit
run` reporting it as facts beside the ones read from other frameworks' files. Today: each RL
phase's rollout-trainer gap correction (``rollout_correction.<phase>``), reported as e.g.
``rl: tis decoupled C=2.0 (generator log-probs over the vocabulary)`` or ``rl: icepop decoupled
kept band [0.5, 5.0] (...)``, with the manifest line as evidence. A run from before the key
existed (or an SFT run) records none, and nothing is reported."""

from __future__ import annotations

from pathlib import Path

from exactrl.audit.evidence import Doc, Reading


def describe(phase: str, entry: dict) -> str:
    """One line for a phase's recorded correction."""
    what = entry.get("correction", "?")
    if what != "none":
        cap, low = entry.get("cap"), entry.get("cap_low")
        band = f"kept band [{1 / low:.3g}, {cap}]" if isinstance(low, (int, float)) and low else f"C={cap}"
        what = f"{what} {entry.get('form', '?')} {band}"
    over = entry.get("generator_logprobs_over", "?")
    replay = ", kept set replayed on the trainer" if entry.get("kept_set_replayed") else ""
    return f"{phase}: {what} (generator log-probs over the {over}{replay})"


def recorded_facts(path: Path) -> dict[str, list[Reading]]:
    """The facts an exactrl run at ``path`` (its directory or its manifest.json) records about itself."""
    manifest = path / "manifest.json" if path.is_dir() else path
    if manifest.name != "manifest.json" or not manifest.is_file():
        return {}
    try:
        doc = Doc.parse(manifest.name, manifest.read_text(errors="replace"), "json")
    except ValueError:
        return {}  # the run reader reports an unreadable file
    phases = doc.node("rollout_correction")
    if not isinstance(phases, dict):
        return {}
    return {"rollout_correction": [Reading(describe(phase, entry), (doc.evidence("rollout_correction", phase),),
                                           "recorded by exactrl")
                                   for phase, entry in phases.items() if isinstance(entry, dict)]}
