"""`exactrl audit run` on a run that reproduced a known bug on purpose (exactrl's ``fault.*``,
exactrl/config/faults.py): the run's manifest.json records it under ``faults_injected``, and the
verdict of the matching rule becomes AFFECTED, saying the bug was injected on purpose, so such
a run is never mistaken for a clean one whatever else its files say."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from exactrl.audit.evidence import Doc, Problem
from exactrl.audit.rules import Status, Verdict

# fault.* key -> the rule (exactrl/audit/rules.py) of the bug it reproduces
RULE_OF = {"fault.dropped_micro_batches": "deepspeed-offload-accumulation",
           "fault.mean_of_means": "openrlhf-mean-of-means"}


def injected_faults(path: Path, verdicts: list[Verdict]) -> tuple[list[Verdict], list[Problem]]:
    """``verdicts`` with each bug an exactrl run at ``path`` reproduced on purpose marked AFFECTED,
    and one problem per such fault that says so; unchanged when the run injected none."""
    manifest = path / "manifest.json" if path.is_dir() else path
    if manifest.name != "manifest.json" or not manifest.is_file():
        return verdicts, []
    try:
        doc = Doc.parse(manifest.name, manifest.read_text(errors="replace"), "json")
    except ValueError:
        return verdicts, []  # the run reader reports an unreadable file
    faults = doc.node("faults_injected")
    if not isinstance(faults, dict):
        return verdicts, []
    out, problems = list(verdicts), []
    for key, what in faults.items():
        evidence = doc.evidence("faults_injected", key)
        reason = f"exactrl injected this bug ON PURPOSE ({key}=true: {what}), as manifest.json records."
        action = (f"Do not read this run as a clean result: it shows what the bug does. Re-run without {key} for "
                  "the correct one.")
        out = [replace(v, status=Status.AFFECTED, reason=reason, action=action, evidence=(evidence,), condition="")
               if v.bug == RULE_OF.get(key) else v for v in out]
        problems.append(Problem("fault-injected", f"{evidence.at}: this run had {key} injected on purpose ({what})",
                                (evidence,)))
    return out, problems
