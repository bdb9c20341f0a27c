"""Verdicts on exactrl's own runs: each phase's facts (exactrl/audit/own_facts.py) judged by the rules
of exactrl/audit/rules.py, with what the canary saw at each step as the evidence of what reached the
optimizer.

- DeepSpeed's offload drop: the rule, on the phase's backend, ZeRO stage, offload, K = global /
  (micro x world) and the DeepSpeed version the manifest records. Where that stack is in the bug's
  range (or the files leave it open), the canary, which reads each step's gradient where the
  optimizer takes it, decides: it stopped the run before applying a step that lacked micro-batches
  (AFFECTED: the bug struck, though nothing the run saved carries that step), it flagged steps under
  ``audit.canary=warn`` (AFFECTED: those updates were applied), or it found every applied step whole
  (NOT AFFECTED). With ``audit.canary=off`` the rule's verdict stands.
- OpenRLHF's mean of means: exactrl divides each step's summed loss by one normaliser for the whole
  step (exactrl/losses/aggregation.py): NOT AFFECTED, unless the run chose ReLIFT's own mean of
  micro-batch means (``algo.relift.mean_of_means``) or injected the fault.
- The HF Trainer's normalisation: exactrl does not train with the Trainer: NOT AFFECTED.
A run of several phases (a pipeline) takes, per bug, its worst phase's verdict, each phase's reason
named. Then each fault injected on purpose (exactrl/audit/faults.py) marks its bug AFFECTED.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from exactrl.audit.evidence import Evidence, Problem, Reading
from exactrl.audit.faults import faults_of, mark_injected
from exactrl.audit.judging import judge
from exactrl.audit.own_facts import Canary, framework_facts, phase_facts
from exactrl.audit.own_run import OwnRun, Phase, read_own_run
from exactrl.audit.recorded import recorded_facts
from exactrl.audit.rules import NOTHING, RULES, Status, Verdict

DS, ORLHF, TF = "deepspeed-offload-accumulation", "openrlhf-mean-of-means", "transformers-ga-normalisation"
WORST = (Status.AFFECTED, Status.CONDITIONAL, Status.UNKNOWN, Status.NOT_AFFECTED)


def offload_verdict(facts: dict[str, list[Reading]], problems: list[Problem], canary: Canary) -> Verdict:
    """The rule on the phase's stack, then what the canary saw where that stack could drop micro-batches."""
    deepspeed = any(r.value is True for r in facts.get("uses_deepspeed", []))
    # another backend: only that decides (an installed DeepSpeed, K and the rest are beside the point)
    judged = facts if deepspeed else {k: v for k, v in facts.items() if k in ("uses_deepspeed", "fsdp")}
    base = judge(RULES[DS], judged, problems)
    said = canary.sentence()
    if base.status is Status.NOT_AFFECTED or not deepspeed:
        return replace(base, reason=f"{base.reason} {said}")
    evidence = base.evidence + tuple(e for e in (canary.policy[1], canary.stop and canary.stop[1],
                                                 canary.flagged and canary.flagged[1]) if e)
    stack = (base.reason if base.status is Status.AFFECTED else
             f"This DeepSpeed run's version is in the bug's range and the files leave the rest open. {base.reason}")
    if canary.stop or canary.flagged:
        action = RULES[DS].fix if canary.flagged else ("Upgrade to deepspeed>=0.19.0, or use K<=2, or disable "
                                                       "offload_optimizer, and run it again.")
        return replace(base, status=Status.AFFECTED, reason=f"{stack} {said}", action=action, evidence=evidence,
                       condition="", missing=())
    if canary.verified():
        return replace(base, status=Status.NOT_AFFECTED, reason=f"{stack} But: {said} So no micro-batch was lost "
                       "in this run.", action=NOTHING, evidence=evidence, condition="", missing=())
    return replace(base, reason=f"{base.reason} {said}", evidence=evidence)


def mean_of_means_verdict(phase: Phase, facts: dict[str, list[Reading]]) -> Verdict:
    rule, s = RULES[ORLHF], phase.settings
    made = facts["framework"][0]
    chosen = s.get("algo.relift.mean_of_means")
    if s.value("algo.name") == "relift" and chosen and chosen[0] is True:
        return Verdict(rule.name, rule.title, Status.AFFECTED,
                       f"The run chose ReLIFT's own normalisation of its SFT steps (algo.relift.mean_of_means=true, "
                       f"{chosen[1].at}): the mean of micro-batch means, this bug's distortion, reproduced on "
                       "purpose for comparison.", "If this run is not meant to reproduce ReLIFT's code, re-run with "
                       "algo.relift.mean_of_means=false (exactrl's one normaliser per step).", (chosen[1],))
    agg = s.get("train.loss_agg") or ("token-mean", made.evidence[0])
    return Verdict(rule.name, rule.title, Status.NOT_AFFECTED,
                   f"Not an OpenRLHF run: {_who(made)} trained it, dividing each "
                   "step's summed loss by one normaliser computed for the whole step (every micro-batch and rank) "
                   f"before its first backward (train.loss_agg={agg[0]}; exactrl/losses/aggregation.py), never by "
                   "each micro-batch's own.", NOTHING, (*made.evidence, agg[1]))


def trainer_verdict(facts: dict[str, list[Reading]]) -> Verdict:
    rule, made = RULES[TF], facts["framework"][0]
    return Verdict(rule.name, rule.title, Status.NOT_AFFECTED,
                   f"Not a Trainer-based run: {_who(made)} trained it with its own "
                   "step (exactrl/workers/worker.py), which divides the step's summed loss by one normaliser for the "
                   "whole step, not with the Hugging Face Trainer.", NOTHING, made.evidence)


def _who(made: Reading) -> str:
    """"exactrl 0.1.0": who wrote the manifest, as its framework fact says."""
    return made.note.removesuffix(" wrote the manifest")


def _merge(per_phase: list[tuple[str, Verdict]]) -> Verdict:
    """One verdict per bug for a run of several phases: the worst, each phase's reason named."""
    if len(per_phase) == 1:
        return per_phase[0][1]
    worst = min((v for _, v in per_phase), key=lambda v: WORST.index(v.status))
    reasons = list(dict.fromkeys(v.reason for _, v in per_phase))
    reason = reasons[0] if len(reasons) == 1 else " ".join(f"{name} phase: {v.reason}" for name, v in per_phase)
    evidence = tuple(dict.fromkeys(e for _, v in per_phase for e in v.evidence))
    return replace(worst, reason=reason, evidence=evidence)


def audit_own_run(root: Path) -> tuple[dict[str, list[Reading]], list[Problem], list[Verdict]]:
    """Facts, problems and verdicts of the exactrl run in ``root`` (own_run.run_root says whether it is one)."""
    run = read_own_run(root)
    problems = [Problem(kind, message, (at,)) for kind, message, at in run.problems]
    per_phase: dict[str, list[tuple[str, list[Reading]]]] = {}
    verdicts: dict[str, list[tuple[str, Verdict]]] = {DS: [], ORLHF: [], TF: []}
    seen: dict[str, str] = {}
    for phase in run.phases:
        c = phase_facts(run, phase)
        problems += c.problems
        mine = c.readings
        canary = Canary.of(phase)
        seen[DS] = " ".join(filter(None, [seen.get(DS), canary.sentence() if canary.stop or canary.flagged else ""]))
        verdicts[DS].append((phase.name, offload_verdict(mine, c.problems, canary)))
        verdicts[ORLHF].append((phase.name, mean_of_means_verdict(phase, mine)))
        verdicts[TF].append((phase.name, trainer_verdict(mine)))
        for fact, readings in {**mine, **_recorded(root, phase)}.items():
            per_phase.setdefault(fact, []).append((phase.name, readings))
    facts = {fact: _phase_readings(each, len(run.phases)) for fact, each in per_phase.items()}
    if run.phases:
        out = [_merge(verdicts[bug]) for bug in RULES]
    else:
        facts = framework_facts(run)
        out = [_nothing_trained(run, bug, problems) for bug in RULES]
    out, injected = mark_injected(out, faults_of(run.manifest) if run.manifest else {}, seen)
    return facts, injected + problems, out


def _phase_readings(each: list[tuple[str, list[Reading]]], phases: int) -> list[Reading]:
    """A fact's readings over the phases: once where every phase read the same, else each named by its phase."""
    def key(readings: list[Reading]) -> list:
        return [(r.value, r.evidence) for r in readings]

    if len(each) == phases and all(key(readings) == key(each[0][1]) for _, readings in each):
        return each[0][1]
    return [replace(r, note="; ".join(filter(None, [f"{name} phase", r.note]))) for name, rs in each for r in rs]


def _recorded(root: Path, phase: Phase) -> dict[str, list[Reading]]:
    """What the phase's manifest records about its maths (exactrl/audit/recorded.py), its files named from the run's
    directory."""
    return {fact: [replace(r, evidence=tuple(replace(e, file=phase.where + e.file) for e in r.evidence))
                   for r in readings] for fact, readings in recorded_facts(root / phase.where).items()}


def _nothing_trained(run: OwnRun, bug: str, problems: list[Problem]) -> Verdict:
    rule = RULES[bug]
    missing = [p for p in problems if p.kind == "missing"]
    if missing:
        return Verdict(bug, rule.title, Status.UNKNOWN, f"Not enough evidence: {missing[0].message}.",
                       "Audit the run directory as exactrl wrote it.", missing[0].evidence)
    at = run.manifest.evidence("versions", "exactrl") if run.manifest else Evidence("manifest.json", None, "")
    return Verdict(bug, rule.title, Status.NOT_AFFECTED, "This exactrl run trained nothing (its config has no "
                   "training phase, e.g. `exactrl eval`).", NOTHING, (at,))
