"""The known silent gradient bugs, as pure rules over a run's facts, and how they are judged.

Each rule is a function of one *concrete* assignment of facts (a value or None per fact)
returning an `Outcome`. A run rarely has one value per fact: a range pin admits many
versions, two configs may disagree. `judge` therefore evaluates the rule over every
combination the evidence admits; a single verdict comes out only when every reading leads
to it, otherwise the verdict is UNKNOWN and the reason names the readings that disagree.

Rules (the sources are cited again next to the code that encodes them):

- ``deepspeed-offload-accumulation``: DeepSpeed PR #6550 (v0.15.2) made ZeRO stage 2 with
  ``offload_optimizer: cpu`` drop the intermediate micro-batches of a gradient-accumulation
  window (the optimizer sees about (g_first + g_last)/K); PR #7967 fixed it in v0.19.0.
  AFFECTED iff 0.15.2 <= deepspeed < 0.19.0, stage 2, offload device cpu and K >= 3.
  Measured (FACTS.md): stage 1 + offload reduces only at the boundary and is exact, stage 0
  ignores offload, stage 3 is a separate exact path, K = 2 is accidentally right.
- ``openrlhf-mean-of-means``: OpenRLHF averaged token losses per micro-batch and then
  averaged those means. Commit df78645e (first released in v0.10.3) normalised by token
  counts summed over all ranks, PR #1249 (commit c5bebd14, first in v0.10.4) over the whole
  accumulation window too. AFFECTED iff an OpenRLHF run and openrlhf <= 0.10.2 with K > 1
  or world size > 1, or openrlhf 0.10.3 with K > 1. (Releases 0.10.0-0.10.2 predate both
  commits; the tags of OpenRLHF/OpenRLHF show it.)
- ``transformers-ga-normalisation``: before PR #34191 (first in transformers 4.46.0) the
  Trainer divided each micro-batch's mean loss by K instead of dividing the summed token
  loss by the tokens of the whole step. AFFECTED iff a Trainer-based run (HF Trainer, TRL,
  LLaMA-Factory), transformers < 4.46.0 and gradient_accumulation_steps > 1.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from packaging.version import Version

from exactrl.audit.evidence import Collected, Evidence, Problem, Reading
from exactrl.audit.versions import exact_version, version_candidates


class Status(str, Enum):
    AFFECTED = "AFFECTED"
    NOT_AFFECTED = "NOT AFFECTED"
    UNKNOWN = "UNKNOWN"


@dataclass(frozen=True)
class Outcome:
    status: Status
    reason: str
    missing: tuple[str, ...] = ()


@dataclass(frozen=True)
class BugRule:
    name: str
    title: str
    needs: tuple[str, ...]
    judge: Callable[[Mapping[str, Any]], Outcome]
    fix: str
    note: Callable[[Mapping[str, list[Any]]], str] = lambda candidates: ""


@dataclass(frozen=True)
class Verdict:
    bug: str
    title: str
    status: Status
    reason: str
    action: str
    evidence: tuple[Evidence, ...]

    def to_json(self) -> dict:
        return {"bug": self.bug, "title": self.title, "status": self.status.value, "reason": self.reason,
                "action": self.action, "evidence": [e.to_json() for e in self.evidence]}


V = Version
HF_FAMILY = ("transformers-trainer", "trl", "llamafactory")
NOTHING = "Nothing to do."


def _decide(false_reasons: list[str], missing: list[str], affected: str) -> Outcome:
    """NOT AFFECTED as soon as one condition is known false; UNKNOWN if one is not known."""
    if false_reasons:
        return Outcome(Status.NOT_AFFECTED, "; ".join(false_reasons) + ".")
    if missing:
        return Outcome(Status.UNKNOWN, "", tuple(missing))
    return Outcome(Status.AFFECTED, affected)


# DeepSpeed PR #6550 introduced the drop (v0.15.2); PR #7967 fixed it (v0.19.0).
DS_BROKEN, DS_FIXED = V("0.15.2"), V("0.19.0")


def deepspeed_offload(f: Mapping[str, Any]) -> Outcome:
    uses, stage, device, k, v = (f["uses_deepspeed"], f["zero_stage"], f["offload_optimizer"],
                                 f["effective_k"], f["version:deepspeed"])
    no = []
    if uses is False and stage is None:
        no.append("the run did not use DeepSpeed")
    if stage is not None and stage != 2:
        no.append({0: "ZeRO stage 0 ignores offload_optimizer",
                   1: "ZeRO stage 1 + offload reduces only at the accumulation boundary: exact (measured)",
                   3: "ZeRO stage 3 is a separate code path: exact (measured)"}.get(stage, f"ZeRO stage {stage}"))
    if device is not None and device != "cpu":
        no.append(f"offload_optimizer device is {device}, not cpu")
    if k is not None and k < 3:
        no.append("K = 1: no accumulation" if k <= 1 else
                  "K = 2 is accidentally right (the first and last micro-batches are the only ones)")
    if v is not None and not DS_BROKEN <= v < DS_FIXED:
        no.append(f"deepspeed {v} is {'before PR #6550 (0.15.2)' if v < DS_BROKEN else 'fixed (PR #7967, 0.19.0)'}")
    missing = [n for n, x in (("zero_stage", stage), ("offload_optimizer", device), ("effective_k", k),
                              ("version:deepspeed", v)) if x is None]
    return _decide(no, missing,
                   f"deepspeed {v}, ZeRO stage 2, offload_optimizer cpu and K = {k}: the optimizer saw about "
                   f"(g_first + g_last)/{k} instead of (g_1 + ... + g_{k})/{k} (PR #6550 introduced it, PR #7967 "
                   "fixed it in 0.19.0). Loss curves look normal.")


def deepspeed_note(options: Mapping[str, list[Any]]) -> str:
    """Offload on stage 1/2 with a deepspeed older than 0.19.0: the multi-backward case of PR #7981."""
    stages, devices, versions = (options[n] for n in ("zero_stage", "offload_optimizer", "version:deepspeed"))
    if not (any(s in (1, 2) for s in stages) and "cpu" in devices and any(v is None or v < DS_FIXED for v in versions)):
        return ""
    return ("Separately, PR #7981 (also in 0.19.0) fixed ZeRO-1/2 + offload keeping only the last of several "
            "backward() calls per step when gradient_accumulation_steps = 1 (e.g. OpenRLHF --use_dynamic_batch); "
            "that case is not judged here.")


# OpenRLHF: commit df78645e (first in v0.10.3) sums token counts across ranks; PR #1249 (commit
# c5bebd14, first in v0.10.4) across the accumulation window as well.
ORLHF_RANKS_FIXED, ORLHF_FIXED = V("0.10.3"), V("0.10.4")


def openrlhf_mean_of_means(f: Mapping[str, Any]) -> Outcome:
    is_orlhf, v, k, world = f["is_openrlhf"], f["version:openrlhf"], f["effective_k"], f["world_size"]
    no = []
    if is_orlhf is False:
        no.append("not an OpenRLHF run")
    if v is not None and v >= ORLHF_FIXED:
        no.append(f"openrlhf {v} normalises by the tokens of the whole step (PR #1249, 0.10.4)")
    ranks_fixed = v is not None and ORLHF_RANKS_FIXED <= v < ORLHF_FIXED
    single_micro = k is not None and k <= 1
    if ranks_fixed and single_micro:
        no.append(f"K = 1, and openrlhf {v} already sums token counts across ranks (commit df78645e)")
    elif single_micro and world is not None and world <= 1:
        no.append("K = 1 on one rank: nothing is averaged")
    needed = [("is_openrlhf", is_orlhf), ("version:openrlhf", v), ("effective_k", k)]
    if not ranks_fixed and not (k is not None and k > 1):
        needed.append(("world_size", world))
    missing = [n for n, x in needed if x is None]
    split = f"K = {k}" + (f" on {world} ranks" if world else "")
    return _decide(no, missing,
                   f"openrlhf {v} with {split}: each micro-batch's token losses were averaged on their own and "
                   "those means averaged, so short micro-batches weigh as much as long ones (fixed by "
                   "commit df78645e and PR #1249, first released together in 0.10.4).")


# transformers PR #34191 (num_items_in_batch) is first in 4.46.0: the 4.46.0 wheel's Trainer passes
# num_items_in_batch to compute_loss, the 4.45.2 wheel's does not.
TF_FIXED = V("4.46.0")


def transformers_ga(f: Mapping[str, Any]) -> Outcome:
    hf, v, k = f["uses_hf_trainer"], f["version:transformers"], f["effective_k"]
    no = []
    if hf is False:
        no.append("not a Trainer-based run (HF Trainer, TRL or LLaMA-Factory)")
    if v is not None and v >= TF_FIXED:
        no.append(f"transformers {v} has the num_items_in_batch normalisation (PR #34191, 4.46.0)")
    if k is not None and k <= 1:
        no.append("gradient_accumulation_steps = 1")
    missing = [n for n, x in (("uses_hf_trainer", hf), ("version:transformers", v), ("effective_k", k)) if x is None]
    return _decide(no, missing,
                   f"transformers {v} with gradient_accumulation_steps = {k}: the Trainer averaged each "
                   "micro-batch's loss over its own tokens and divided by K, so micro-batches with few tokens "
                   "weigh as much as long ones (fixed by PR #34191 in 4.46.0).")


RULES: dict[str, BugRule] = {rule.name: rule for rule in (
    BugRule("deepspeed-offload-accumulation", "DeepSpeed ZeRO-2 CPU-offload drops accumulated micro-batches",
            ("uses_deepspeed", "zero_stage", "offload_optimizer", "effective_k", "version:deepspeed"),
            deepspeed_offload,
            "Upgrade to deepspeed>=0.19.0, or use K<=2, or disable offload_optimizer; re-run what depends on it.",
            deepspeed_note),
    BugRule("openrlhf-mean-of-means", "OpenRLHF mean-of-means loss aggregation",
            ("is_openrlhf", "version:openrlhf", "effective_k", "world_size"), openrlhf_mean_of_means,
            "Upgrade to openrlhf>=0.10.4 (PR #1249); re-run what depends on it."),
    BugRule("transformers-ga-normalisation", "Transformers Trainer gradient-accumulation loss normalisation",
            ("uses_hf_trainer", "version:transformers", "effective_k"), transformers_ga,
            "Upgrade to transformers>=4.46.0 (PR #34191; later patch releases fixed follow-ups such as "
            "PR #35438, so prefer a current release); re-run what depends on it."),
)}

VERSION_BOUNDARIES = {"deepspeed": (DS_BROKEN, DS_FIXED), "openrlhf": (ORLHF_RANKS_FIXED, ORLHF_FIXED),
                      "transformers": (TF_FIXED,)}

HINTS = {
    "uses_deepspeed": "whether DeepSpeed was used (a DeepSpeed config or the launch command)",
    "zero_stage": "ZeRO stage (zero_optimization.stage, --zero_stage / --ds.zero_stage, accelerate zero_stage)",
    "offload_optimizer": "optimizer offload device (zero_optimization.offload_optimizer.device, --adam_offload)",
    "effective_k": "gradient accumulation steps (or global batch, micro batch and world size)",
    "world_size": "world size (--num_gpus / --nproc_per_node / num_processes on the launch command)",
    "is_openrlhf": "training framework (a launch command or saved arguments showing whether OpenRLHF trained it)",
    "uses_hf_trainer": "training framework (saved TrainingArguments, a TRL or LLaMA-Factory config)",
}
RELATED = {"effective_k": ("gradient_accumulation_steps", "micro_batch_size", "global_batch_size", "world_size",
                           "deepspeed_config"),
           "zero_stage": ("deepspeed_config",), "offload_optimizer": ("deepspeed_config",)}


def hint(fact: str) -> str:
    if fact.startswith("version:"):
        return f"{fact[8:]} version (pip freeze, conda list, requirements.txt or W&B's requirements.txt)"
    return HINTS.get(fact, fact)


# ---------------------------------------------------------------------------- candidate values


def candidates(fact: str, readings: list[Reading]) -> tuple[list[Any], bool]:
    if not readings:
        return [None], False
    if fact.startswith("version:"):
        return version_candidates(readings, VERSION_BOUNDARIES.get(fact[8:], ()))
    values = list(dict.fromkeys(r.value for r in readings))
    return values, len(values) > 1


# ---------------------------------------------------------------------------- judging


def _describe(fact: str, readings: list[Reading]) -> tuple[str, str]:
    """("deepspeed version", "deepspeed==0.17.1 (pip_freeze.txt:1) vs deepspeed>=0.15 (requirements.txt:2)")."""
    name = f"{fact[8:]} version" if fact.startswith("version:") else fact
    parts = [f"{fact[8:]}{r.value or ' (unpinned)'}" if fact.startswith("version:") else str(r.value) for r in readings]
    return name, " vs ".join(f"{p} ({', '.join(e.at for e in r.evidence)})" for p, r in zip(parts, readings))


def disagreement(fact: str, readings: list[Reading]) -> str:
    return "The readings of {} disagree: {}".format(*_describe(fact, readings))


def judge(rule: BugRule, facts: Mapping[str, list[Reading]], problems: Iterable[Problem] = ()) -> Verdict:
    options = {n: candidates(n, facts.get(n, [])) for n in rule.needs}
    combos = [dict(zip(rule.needs, values)) for values in itertools.product(*(options[n][0] for n in rule.needs))]
    outcomes = [rule.judge(c) for c in combos]
    statuses = list(dict.fromkeys(o.status for o in outcomes))
    varying = [n for n in rule.needs if len(options[n][0]) > 1]
    evidence = tuple(dict.fromkeys(e for n in rule.needs for r in facts.get(n, []) for e in r.evidence))

    def said(n: str, agree: bool) -> str:
        if n.startswith("version:") and not options[n][1] and not any(exact_version(r.value) for r in facts[n]):
            return "The {} is known only as a range, {}: weaker evidence than an exact == pin; ".format(
                *_describe(n, facts[n])) + ("every version it admits gives the same verdict" if agree else
                                            "the versions it admits lead to different verdicts")
        return disagreement(n, facts[n])

    if len(statuses) == 1:
        status, action = statuses[0], rule.fix
        # Explain with the facts every reading shares when they suffice; otherwise by example.
        plain = rule.judge({**combos[0], **{n: None for n in varying}})
        reason = plain.reason if plain.status is status else f"Every reading gives {status.value}, e.g. " + \
            outcomes[0].reason
        if status is Status.NOT_AFFECTED:
            action = NOTHING
        if status is Status.UNKNOWN:
            missing = tuple(dict.fromkeys(m for o in outcomes for m in o.missing))
            reason, action = _unknown_text(missing, problems)
        # Name the disagreement only where it could matter (the verdict needs that fact).
        matters = [n for n in varying if rule.judge({**combos[0], n: None}).status is not status]
        reason += "".join(f" {said(n, True)}." for n in matters)
    else:
        status, cases = Status.UNKNOWN, []
        for each in statuses:
            i = next(i for i, o in enumerate(outcomes) if o.status is each)
            shown = ", ".join(f"{n[8:]} {combos[i][n]}" if n.startswith("version:") else f"{n} = {combos[i][n]}"
                              for n in varying)
            text = outcomes[i].reason or "not enough evidence: " + ", ".join(outcomes[i].missing)
            cases.append(f"with {shown}: {each.value} ({text.rstrip('.')})")
        reason = ("The evidence admits different verdicts. " + " ".join(f"{said(n, False)}." for n in varying)
                  + " " + "; ".join(cases) + ".")
        others, versions = ([n for n in varying if n.startswith("version:") == v] for v in (False, True))
        action = " ".join([f"Resolve {', '.join(others)}: keep only the files the run used."] * bool(others) + [
            f"Pin down the {', '.join(n[8:] for n in versions)} version: provide a pip freeze or conda list of the "
            "run's environment."] * bool(versions))
    note = rule.note({n: options[n][0] for n in rule.needs})
    return Verdict(rule.name, rule.title, status, f"{reason} {note}".strip(), action, evidence)


def _unknown_text(missing: tuple[str, ...], problems: Iterable[Problem]) -> tuple[str, str]:
    related = {m: {m, *RELATED.get(m, ())} for m in missing}
    notes = [p.message for p in problems if p.kind in ("unresolved", "missing", "unreadable", "inconsistent")
             and (p.fact is None or any(p.fact in r for r in related.values()))]
    notes = list(dict.fromkeys(n.rstrip(".") + "." for n in notes))
    reason = " ".join(["Not enough evidence, missing: " + "; ".join(hint(m) for m in missing) + ".", *notes[:3]]
                      + ([f"({len(notes) - 3} more problems are listed with the run.)"] if len(notes) > 3 else []))
    return reason, "Provide " + "; ".join(hint(m) for m in missing) + "."


# ---------------------------------------------------------------------------- derived facts


def derive(c: Collected, complete_lists: list[tuple[Evidence, set[str]]]) -> tuple[dict[str, list[Reading]],
                                                                                  list[Problem]]:
    """The facts the rules read: the readings, plus effective K, world size, uses_deepspeed,
    is_openrlhf and uses_hf_trainer where they follow from others; and the problems found."""
    facts, problems = {k: list(v) for k, v in c.readings.items()}, list(c.problems)
    if facts.get("zero_stage") and not any(r.value is True for r in facts.get("uses_deepspeed", [])):
        facts.setdefault("uses_deepspeed", []).append(Reading(True, facts["zero_stage"][0].evidence, "a ZeRO stage"))
    for fact, weak in c.weak.items():
        facts[fact] = facts.get(fact) or weak
    batch = [facts.get(f, []) for f in ("global_batch_size", "micro_batch_size")]
    given = [Reading(r.value, r.evidence, "given") for r in facts.get("gradient_accumulation_steps", [])]
    derived, worlds = {}, {}
    for g, m, w, d in itertools.product(*batch, facts.get("world_size", []),
                                        facts.get("parallel_divisor") or [Reading(1, ())]):
        ranks = w.value // d.value if w.value % d.value == 0 else 0
        if ranks and g.value % (m.value * ranks) == 0:
            k = g.value // (m.value * ranks)
            derived.setdefault(k, Reading(k, g.evidence + m.evidence + w.evidence + d.evidence,
                                          f"derived: {g.value} / ({m.value} x {ranks})"))
        else:
            problems.append(Problem("inconsistent", f"global batch {g.value} is not a multiple of micro batch "
                                    f"{m.value} x {ranks or w.value} ranks", g.evidence + m.evidence + w.evidence,
                                    "effective_k"))
    if given or derived:
        facts["effective_k"] = given + list(derived.values())
    for g, m, k in itertools.product(*batch, given):  # DeepSpeed: train_batch_size = micro x K x world
        if not facts.get("world_size") and g.value % (m.value * k.value) == 0:
            w = g.value // (m.value * k.value)
            worlds.setdefault(w, Reading(w, g.evidence + m.evidence + k.evidence,
                                         f"derived: {g.value} / ({m.value} x {k.value})"))
    if worlds:
        facts["world_size"] = list(worlds.values())
    _framework(facts, complete_lists)
    for fact, readings in facts.items():
        if ({r.value in HF_FAMILY for r in readings} == {True, False} if fact == "framework"
                else candidates(fact, readings)[1]):
            problems.append(Problem("contradiction", disagreement(fact, readings) + ".",
                                    tuple(e for r in readings for e in r.evidence), fact))
    for fact, evidence in c.autos:
        if not facts.get(fact) and not (fact in RELATED["effective_k"] and facts.get("effective_k")):
            problems.append(Problem("unresolved", f"{fact} is \"auto\" at {evidence.at} and nothing in the run "
                                    "resolves it (the HF Trainer fills it from TrainingArguments)", (evidence,), fact))
    return facts, problems


def _framework(facts: dict[str, list[Reading]], complete_lists: list[tuple[Evidence, set[str]]]) -> None:
    """is_openrlhf / uses_hf_trainer from the detected framework, else from complete package lists."""
    found = facts.get("framework", [])
    for fact, mine, package, other_note in (
            ("is_openrlhf", ("openrlhf",), "openrlhf", "a Trainer-based run"),
            ("uses_hf_trainer", HF_FAMILY, "transformers", "OpenRLHF has its own training loop")):
        yes = [Reading(True, r.evidence, r.value) for r in found if r.value in mine]
        other = [Reading(False, r.evidence, other_note) for r in found if r.value not in mine]
        absent = [Reading(False, (e,), f"{package} is not installed") for e, names in complete_lists
                  if package not in names]
        if yes or other or absent:
            facts[fact] = yes or other or absent
