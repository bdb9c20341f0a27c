"""`exactrl audit run` on a run that reproduced a known bug on purpose (exactrl's ``fault.*``,
exactrl/config/faults.py): the run's manifest.json records it under ``faults_injected`` (a study's
cell, under ``study_cell.overrides``), and the verdict of the matching rule becomes AFFECTED,
saying the bug was injected on purpose, so such a run is never mistaken for a clean one whatever
else its files say."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from exactrl.audit.evidence import Doc, Evidence, Problem, true
from exactrl.audit.rules import Status, Verdict
from exactrl.config.faults import FAULTS

# fault.* key -> the rule (exactrl/audit/rules.py) of the bug it reproduces
RULE_OF = {"fault.dropped_micro_batches": "deepspeed-offload-accumulation",
           "fault.mean_of_means": "openrlhf-mean-of-means"}


def faults_of(manifest: Doc) -> dict[str, tuple[str, Evidence]]:
    """fault.* key -> (what it reproduces, the manifest line saying so) for each fault the run injected."""
    faults = manifest.node("faults_injected")
    if isinstance(faults, dict):
        return {str(k): (str(what), manifest.evidence("faults_injected", k)) for k, what in faults.items()}
    out = {}  # a study's cell: its grid's faults are among the overrides it trained with
    overrides = manifest.node("study_cell", "overrides")
    for i, text in enumerate(overrides if isinstance(overrides, list) else []):
        key, _, value = str(text).partition("=")
        if key.startswith("fault.") and key[6:] in FAULTS and true(value.strip()):
            out[key] = (FAULTS[key[6:]], manifest.evidence("study_cell", "overrides", i))
    return out


def mark_injected(verdicts: list[Verdict], faults: dict[str, tuple[str, Evidence]],
                  seen: dict[str, str] | None = None) -> tuple[list[Verdict], list[Problem]]:
    """``verdicts`` with each bug in ``faults`` marked AFFECTED, and one problem per fault that says so.
    ``seen``: bug -> what the run's canary made of its steps, kept in the reason."""
    out, problems = list(verdicts), []
    for key, (what, evidence) in faults.items():
        reason = f"exactrl injected this bug ON PURPOSE ({key}=true: {what}), as manifest.json records."
        action = (f"Do not read this run as a clean result: it shows what the bug does. Re-run without {key} for "
                  "the correct one.")
        out = [replace(v, status=Status.AFFECTED, reason=f"{reason} {(seen or {}).get(v.bug, '')}".strip(),
                       action=action, evidence=(evidence,), condition="") if v.bug == RULE_OF.get(key) else v
               for v in out]
        problems.append(Problem("fault-injected", f"{evidence.at}: this run had {key} injected on purpose ({what})",
                                (evidence,)))
    return out, problems


def injected_faults(path: Path, verdicts: list[Verdict]) -> tuple[list[Verdict], list[Problem]]:
    """``verdicts`` marked by the faults the manifest.json at ``path`` (a run directory or the file) records;
    unchanged when it records none."""
    manifest = path / "manifest.json" if path.is_dir() else path
    if manifest.name != "manifest.json" or not manifest.is_file():
        return verdicts, []
    try:
        doc = Doc.parse(manifest.name, manifest.read_text(errors="replace"), "json")
    except ValueError:
        return verdicts, []  # the run reader reports an unreadable file
    return mark_injected(verdicts, faults_of(doc))
