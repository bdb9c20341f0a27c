"""How the rules (exactrl/audit/rules.py) are judged on what a run left behind.

A run rarely has one value per fact: a range pin admits many versions, two configs may
disagree, a launcher may not say how many GPUs it used. `judge` evaluates a rule over every
combination the evidence admits; a single verdict comes out only when every reading leads to
it, otherwise the verdict is UNKNOWN and the reason names the readings that disagree. When only
the world size N is open and the batch sizes are known, DeepSpeed's own constraint (global =
micro x K x N, K whole) lists the possible N: one verdict if they all agree, else CONDITIONAL
("AFFECTED if run on <= 21 GPUs"). `derive` turns the readings into the facts the rules read.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import replace
from fractions import Fraction
from typing import Any

from exactrl.audit.evidence import Collected, Evidence, Problem, Reading
from exactrl.audit.rules import (
    HF_FAMILY,
    NOTHING,
    RELATED,
    VERSION_BOUNDARIES,
    BugRule,
    Status,
    Verdict,
    hint,
    sentence,
)
from exactrl.audit.versions import exact_version, version_candidates


def candidates(fact: str, readings: list[Reading]) -> tuple[list[Any], bool]:
    if not readings:
        return [None], False
    if fact.startswith("version:"):
        return version_candidates(readings, VERSION_BOUNDARIES.get(fact[8:], ()))
    values = list(dict.fromkeys(r.value for r in readings))
    return values, len(values) > 1


def _describe(fact: str, readings: list[Reading]) -> tuple[str, str]:
    """("deepspeed version", "deepspeed==0.17.1 (pip_freeze.txt:1) vs deepspeed>=0.15 (requirements.txt:2)")."""
    package = fact[8:]

    def part(r: Reading) -> str:
        if not fact.startswith("version:"):
            return str(r.value)
        if str(r.value).startswith("@"):
            return f"{package} installed from git commit {r.value[1:9]}"
        return f"{package}{r.value or ' (unpinned)'}"

    name = f"{package} version" if fact.startswith("version:") else fact
    return name, " vs ".join(f"{part(r)} ({', '.join(e.at for e in r.evidence)})" for r in readings)


def disagreement(fact: str, readings: list[Reading]) -> str:
    return "The readings of {} disagree: {}".format(*_describe(fact, readings))


def _commits(readings: list[Reading]) -> list[str]:
    return [str(r.value)[1:9] for r in readings if str(r.value).startswith("@")]


def judge(rule: BugRule, facts: Mapping[str, list[Reading]], problems: Iterable[Problem] = ()) -> Verdict:
    verdict = _judge(rule, facts, problems)
    if verdict.status is Status.UNKNOWN and "effective_k" in rule.needs:
        return _over_world_sizes(rule, facts, problems) or verdict
    return verdict


def _judge(rule: BugRule, facts: Mapping[str, list[Reading]], problems: Iterable[Problem]) -> Verdict:
    options = {n: candidates(n, facts.get(n, [])) for n in rule.needs}
    combos = [dict(zip(rule.needs, values)) for values in itertools.product(*(options[n][0] for n in rule.needs))]
    outcomes = [rule.judge(c) for c in combos]
    statuses = list(dict.fromkeys(o.status for o in outcomes))
    varying = [n for n in rule.needs if len(options[n][0]) > 1]
    evidence = tuple(dict.fromkeys(e for n in rule.needs for r in facts.get(n, []) for e in r.evidence))

    def said(n: str, agree: bool) -> str:
        if n.startswith("version:") and _commits(facts[n]) and not options[n][1]:
            package, commit = n[8:], _commits(facts[n])[0]
            return (f"The {package} version is not in the files: {_describe(n, facts[n])[1]}; `git tag --contains "
                    f"{commit}` in a clone of {package} lists the releases that include it")
        if n.startswith("version:") and not options[n][1] and not any(exact_version(r.value) for r in facts[n]):
            return "The {} is known only as a range, {}: weaker evidence than an exact == pin; ".format(
                *_describe(n, facts[n])) + ("every version it admits gives the same verdict" if agree else
                                            "the versions it admits lead to different verdicts")
        return disagreement(n, facts[n])

    missing: tuple[str, ...] = ()
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
            reason, action = _unknown_text(missing, facts, problems)
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
                  + " " + sentence("; ".join(cases)) + ".")
        others, versions = ([n for n in varying if n.startswith("version:") == v] for v in (False, True))
        commits = {n[8:]: _commits(facts[n]) for n in versions if _commits(facts[n])}
        action = " ".join([f"Resolve {', '.join(others)}: keep only the files the run used."] * bool(others) + [
            f"Find the {package} release that contains commit {c[0]} (git tag --contains {c[0]}) and add "
            f"{package}==<that release> to the run's files." for package, c in commits.items()] + [
            f"Pin down the {', '.join(n[8:] for n in versions if n[8:] not in commits)} version: provide a pip "
            "freeze or conda list of the run's environment."] * bool([n for n in versions if n[8:] not in commits]))
    note = rule.note({n: options[n][0] for n in rule.needs})
    return Verdict(rule.name, rule.title, status, f"{reason} {note}".strip(), action, evidence, missing=missing)


def _batch_only(facts: Mapping[str, list[Reading]]) -> tuple[Reading, Reading, Reading] | None:
    """(global, micro, parallel divisor) when they are known once each and nothing says N or K."""
    if facts.get("world_size") or facts.get("gradient_accumulation_steps"):
        return None
    g, m = facts.get("global_batch_size", []), facts.get("micro_batch_size", [])
    d = facts.get("parallel_divisor") or [Reading(1, ())]
    if not (len(g) == len(m) == len(d) == 1) or g[0].value % m[0].value:
        return None
    return g[0], m[0], d[0]


def _over_world_sizes(rule: BugRule, facts: Mapping[str, list[Reading]], problems: Iterable[Problem]) -> Verdict | None:
    """The verdict for every world size DeepSpeed would have accepted; None if some stay UNKNOWN."""
    batch = _batch_only(facts)
    if batch is None:
        return None
    g, m, d = batch
    slots, evidence = g.value // m.value, g.evidence + m.evidence + d.evidence  # slots = K x data-parallel ranks

    def at(ranks: int, k: Any) -> Verdict:
        n = ranks * d.value
        return _judge(rule, {**facts, "effective_k": [Reading(k, evidence, f"if N = {n}")],
                             "world_size": [Reading(n, evidence, "assumed")]}, problems)

    whole = {r * d.value: at(r, slots // r) for r in range(1, slots + 1) if slots % r == 0}
    statuses = {v.status for v in whole.values()}
    per = f"{m.value} x N" + (f" / {d.value}" if d.value > 1 else "")
    why = (f"The files do not say how many GPUs (N) the run used; K = {g.value} / ({per}) must be whole, "
           f"so N is one of {', '.join(map(str, whole))}.")
    every = tuple(dict.fromkeys(e for v in whole.values() for e in v.evidence))
    if Status.UNKNOWN in statuses:
        return _unknown_besides_world(rule, whole, why, every, facts, problems)
    if len(statuses) == 1:
        n = min(whole, key=lambda n: abs(n - 8))  # a typical node for the example
        first = whole[n]
        return replace(first, reason=f"{why} Every one gives {first.status.value}; e.g. on N = {n}: {first.reason}",
                       evidence=every)
    hit = [n for n, v in whole.items() if v.status is Status.AFFECTED]
    missed = [n for n in whole if n not in hit]
    if max(hit) < min(missed) or min(hit) > max(missed):
        # Where the verdict turns between two accepted N, with K = slots / ranks as a real number:
        # "K >= 3" is "N <= 21" for K = 128 / (2 x N).
        below = max(hit) < min(missed)  # AFFECTED on few GPUs (K large), NOT AFFECTED on many
        inside, outside = (max(hit), min(missed)) if below else (min(hit), max(missed))
        lo, hi = inside // d.value, outside // d.value  # ranks: AFFECTED at lo, not at hi; bisect between
        while abs(hi - lo) > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if at(mid, Fraction(slots, mid)).status is Status.AFFECTED else (lo, mid)
        condition = f"run on {'<=' if below else '>='} {lo * d.value} GPUs"
    else:
        condition = "run on " + " or ".join(map(str, hit)) + " GPUs"
    # The two world sizes either side of the turn make the clearest example.
    yes = max(((n, v) for n, v in whole.items() if v.status is Status.AFFECTED), key=lambda x: x[0])
    no = min(((n, v) for n, v in whole.items() if v.status is Status.NOT_AFFECTED), key=lambda x: x[0])
    reason = f"{why} AFFECTED if {condition}. On N = {yes[0]}: {yes[1].reason} On N = {no[0]}: {no[1].reason}"
    action = f"Find how many GPUs the run used; if it was {condition[7:]}: {rule.fix}"
    return Verdict(rule.name, rule.title, Status.CONDITIONAL, reason, action, every, condition)


def _unknown_besides_world(rule: BugRule, whole: dict[int, Verdict], why: str, every: tuple[Evidence, ...],
                           facts: Mapping[str, list[Reading]], problems: Iterable[Problem]) -> Verdict | None:
    """UNKNOWN for some world sizes: ask only for what else is missing, and say what N alone decides."""
    missing = tuple(dict.fromkeys(m for v in whole.values() for m in v.missing if m not in (
        "effective_k", "world_size")))
    if not missing:
        return None
    reason, action = _unknown_text(missing, facts, problems)
    known = {n: v for n, v in whole.items() if v.status is not Status.UNKNOWN}
    if not known:
        return Verdict(rule.name, rule.title, Status.UNKNOWN, f"{reason} The world size would not change that.",
                       action, every, missing=missing)
    what = " and ".join(f"{m[8:]} version" if m.startswith("version:") else m for m in missing)
    decided = []
    for status in dict.fromkeys(v.status for v in known.values()):
        sizes = [n for n, v in known.items() if v.status is status]
        decided.append(f"On {' or '.join(map(str, sizes))} GPUs the run is {status.value} whatever the {what} is; "
                       f"e.g. on N = {sizes[0]}: {known[sizes[0]].reason}")
    return Verdict(rule.name, rule.title, Status.UNKNOWN, " ".join([reason, why, *decided]), action, every,
                   missing=missing)


def _unknown_text(missing: tuple[str, ...], facts: Mapping[str, list[Reading]],
                  problems: Iterable[Problem]) -> tuple[str, str]:
    if {"effective_k", "world_size"} <= set(missing):  # name the world size once: by itself if it is all K lacks
        missing = tuple(m for m in missing if m != ("effective_k" if _batch_only(facts) else "world_size"))
    related = {m: {m, *RELATED.get(m, ())} for m in missing}
    notes = [p.message for p in problems if p.kind in ("unresolved", "missing", "unreadable", "inconsistent")
             and (p.fact is None or any(p.fact in r for r in related.values()))]
    notes = list(dict.fromkeys(sentence(n).rstrip(".") + "." for n in notes))
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
            problems.append(Problem("unresolved", f"DeepSpeed's {fact} is \"auto\" at {evidence.at} and nothing in the "
                                    "run resolves it (the HF Trainer fills it from TrainingArguments)", (evidence,),
                                    fact))
    return facts, problems


def _framework(facts: dict[str, list[Reading]], complete_lists: list[tuple[Evidence, set[str]]]) -> None:
    """is_openrlhf / uses_hf_trainer from the detected framework, else from complete package lists."""
    found = facts.get("framework", [])
    for fact, mine, package in (("is_openrlhf", ("openrlhf",), "openrlhf"),
                                ("uses_hf_trainer", HF_FAMILY, "transformers")):
        yes = [Reading(True, r.evidence, r.value) for r in found if r.value in mine]
        other = [Reading(False, r.evidence, f"a {r.value} run") for r in found if r.value not in mine]
        absent = [Reading(False, (e,), f"{package} is not installed") for e, names in complete_lists
                  if package not in names]
        if yes or other or absent:
            facts[fact] = yes or other or absent
