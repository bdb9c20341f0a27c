"""`exactrl audit run` on the run directories the suite's own runs leave (exactrl/audit/own_*.py):
a test that makes a run checks here that the audit reads it as exactrl's own (not as OpenRLHF's,
whose flag ``train.micro_batch_size`` exactrl's config.yaml also has) and gives each bug the
verdict that run deserves, and the exit code that follows."""

from __future__ import annotations

from pathlib import Path

from exactrl.audit.report import exit_code
from exactrl.audit.runs import RunAudit, audit_runs

DS, ORLHF, TF = "deepspeed-offload-accumulation", "openrlhf-mean-of-means", "transformers-ga-normalisation"
A, N = "AFFECTED", "NOT AFFECTED"


def audited(path: Path) -> list[RunAudit]:
    """The audits of the exactrl run at ``path`` (a study: one per directory that trained), each read as exactrl's."""
    audits = audit_runs([path])
    for a in audits:
        assert [r.value for r in a.facts.get("framework", [])] == ["exactrl"], (a.path, a.facts.get("framework"))
        assert {r.value for f in ("is_openrlhf", "uses_hf_trainer") for r in a.facts[f]} == {False}, a.path
    return audits


def assert_verdicts(path: Path, ds: str = N, orlhf: str = N, tf: str = N, facts: dict | None = None,
                    says: dict[str, str | tuple[str, ...]] | None = None) -> RunAudit:
    """The one run at ``path`` gets these verdicts (and exit code), these facts (name -> the values read, in
    order) and, per bug, a reason containing ``says[bug]`` (each of them, if several)."""
    [audit] = audited(path)
    got = {v.bug: v for v in audit.verdicts}
    assert {bug: v.status.value for bug, v in got.items()} == {DS: ds, ORLHF: orlhf, TF: tf}, \
        {bug: v.reason for bug, v in got.items()}
    for fact, values in (facts or {}).items():
        assert [r.value for r in audit.facts.get(fact, [])] == values, (fact, audit.facts.get(fact))
    for bug, texts in (says or {}).items():
        for text in (texts,) if isinstance(texts, str) else texts:
            assert text in got[bug].reason, got[bug].reason
    assert exit_code([audit]) == (1 if A in (ds, orlhf, tf) else 0)
    return audit
