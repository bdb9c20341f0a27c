"""What `exactrl audit run` prints: a rich table for people, JSON for machines, and the exit code
(0: every verdict NOT AFFECTED; 1: some verdict AFFECTED; 2: none AFFECTED, some UNKNOWN or
CONDITIONAL, i.e. the files leave the answer open)."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from exactrl.audit.evidence import Reading
from exactrl.audit.rules import RULES, Status
from exactrl.audit.runs import FACTS, RunAudit

STYLE = {Status.AFFECTED: "bold red", Status.NOT_AFFECTED: "green", Status.CONDITIONAL: "red",
         Status.UNKNOWN: "yellow"}


def _value(fact: str, r: Reading) -> Any:
    return f"{fact[8:]}{r.value or ' (unpinned)'}" if fact.startswith("version:") else r.value


def format_table(audits: list[RunAudit]) -> Group:
    """Human output: a summary when there are several runs, then per run the verdicts, the facts
    with their evidence, and the problems."""
    parts: list[Any] = []
    if len(audits) > 1:
        summary = Table(title="summary")
        for column in ("run", *RULES):
            summary.add_column(column, overflow="fold")
        for a in audits:
            summary.add_row(a.path, *(Text(v.shown, style=STYLE[v.status]) for v in a.verdicts))
        parts.append(summary)
    for audit in audits:
        verdicts = Table("bug", "verdict", "why", "what to do", title=f"run: {audit.path}", show_lines=True,
                         expand=True)
        for v in audit.verdicts:
            verdicts.add_row(v.title, Text(v.shown, style=STYLE[v.status]), v.reason, v.action)
        facts = Table("fact", "value", "evidence", title="facts", expand=True)
        for fact in FACTS:
            for r in audit.facts.get(fact, []):
                facts.add_row(fact, str(_value(fact, r)),
                              ", ".join(e.at for e in r.evidence) + (f" ({r.note})" if r.note else ""))
        parts += [verdicts, facts, *(Text(f"{p.kind}: {p.message}", style="yellow") for p in audit.problems)]
    return Group(*parts)


def to_json(audits: list[RunAudit]) -> dict:
    """Machine output: every fact with its readings and evidence, the problems, the verdicts and
    the exit code."""
    return {"exit_code": exit_code(audits), "runs": [{
        "path": a.path,
        "facts": {f: [{"value": _value(f, r), "note": r.note, "evidence": [e.to_json() for e in r.evidence]}
                      for r in a.facts[f]] for f in FACTS if a.facts.get(f)},
        "problems": [p.to_json() for p in a.problems],
        "verdicts": [v.to_json() for v in a.verdicts],
    } for a in audits]}


def exit_code(audits: list[RunAudit]) -> int:
    """0: every verdict NOT AFFECTED; 1: any AFFECTED; 2: none AFFECTED but some UNKNOWN or CONDITIONAL."""
    statuses = {v.status for a in audits for v in a.verdicts}
    return 1 if Status.AFFECTED in statuses else 2 if statuses & {Status.UNKNOWN, Status.CONDITIONAL} else 0
