"""The facts of one phase of an exactrl run (read by exactrl/audit/own_run.py) that the rules of
exactrl/audit/rules.py read -- backend, ZeRO stage and offload as exactrl configured DeepSpeed, batch
sizes, world size, K, versions -- and what the phase's canary saw (`Canary`), each with its file:line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from exactrl.audit.evidence import Collected, Doc, Evidence, Reading, whole
from exactrl.audit.own_run import CONFIG, OwnRun, Phase, iter_readings


@dataclass
class Canary:
    """What a phase's canary saw: its policy, the readings logged, the steps flagged, a stop."""

    policy: tuple[str, Evidence | None]
    tol: float
    readings: int
    worst: tuple[float, Evidence] | None  # the reading farthest from 1
    flagged: tuple[int, Evidence] | None  # canary_fired, a running count: its largest
    stop: tuple[str, Evidence] | None
    finished: Evidence | None

    @classmethod
    def of(cls, phase: Phase) -> Canary:
        s = phase.settings
        policy = s.get("audit.canary") or ("error", None)
        tol = s.value("audit.canary_tol", 1e-5)
        values = [(abs(v - 1), v, e) for _, e, _, v in iter_readings(phase, ("canary", "critic_canary"))]
        fired = [(int(v), e) for _, e, _, v in iter_readings(phase, ("canary_fired",))]
        worst = max(values, key=lambda x: x[0]) if values else None
        most = max(fired, key=lambda x: x[0]) if fired else None
        return cls((str(policy[0]), policy[1]), float(tol), len(values), worst and (worst[1], worst[2]),
                   most if most and most[0] > 0 else None, phase.stop, phase.finished)

    def describe(self) -> str:
        """The fact's value: policy and what it saw."""
        if self.stop:
            return f"{self.policy[0]}: stopped the run ({self.stop[0][:120]})"
        if self.flagged:
            return f"{self.policy[0]}: flagged {self.flagged[0]} step(s) (canary_fired)"
        if self.policy[0] == "off":
            return "off: no step checked"
        seen = (f"{self.readings} logged reading(s), the farthest from 1: {self.worst[0]:.7g}" if self.worst else
                "no reading logged")
        return f"{self.policy[0]} (tolerance {self.tol:g}): {seen}, none flagged"

    def sentence(self) -> str:
        """What it saw, as a sentence of a verdict's reason."""
        if self.stop:
            message, at = self.stop
            return (f"The canary stopped the run before applying a step whose gradient did not carry the whole step "
                    f"({at.at}: \"{message[:200]}\"): nothing the run saved carries that step, and the run did not "
                    "finish.")
        if self.flagged:
            far = f"; a reading of {self.worst[0]:.6g} at {self.worst[1].at}" if self.worst else ""
            return (f"The canary (audit.canary=warn) flagged {self.flagged[0]} step(s) ({self.flagged[1].at}, "
                    f"canary_fired{far}): those updates were applied without part of their micro-batches.")
        if self.policy[0] == "off":
            return "audit.canary=off: nothing checked the applied gradients."
        logged = (f"{self.readings} logged reading(s), all within {self.tol:g} of 1; the farthest from it: "
                  f"{self.worst[0]:.7g} at {self.worst[1].at}" if self.worst else "no step logged")
        return (f"The canary (audit.canary={self.policy[0]}) read the gradient of every applied step where the "
                f"optimizer takes it and found it whole ({logged}; none flagged).")

    def verified(self) -> bool:
        """Every applied step was checked and found whole: under error a failed check stops the run; under warn
        the count covers the steps up to the last record, all of them once the phase finished."""
        if self.stop or self.flagged or self.policy[0] == "off":
            return False
        return self.policy[0] == "error" or self.finished is not None


def _version(doc: Doc | None, run: OwnRun, package: str) -> tuple[str | None, Evidence]:
    for d in (doc, run.manifest):
        if d is not None and d.has("versions", package):
            value = d.node("versions", package)
            return (str(value) if value else None), d.evidence("versions", package)
    return None, Evidence(run.manifest.file if run.manifest else "manifest.json", None, "")


def _world(run: OwnRun, phase: Phase) -> Reading | None:
    s = phase.settings
    docs = [d for d in (phase.manifest, run.manifest) if d is not None]
    if s.value("ray.enabled"):
        for d in docs:
            if whole(d.node("ray", "ranks")):
                return Reading(whole(d.node("ray", "ranks")), (d.evidence("ray", "ranks"),), "Ray trainer ranks")
        got = s.get("ray.ranks")
        return Reading(whole(got[0]), (got[1],), "Ray trainer ranks") if got and whole(got[0]) else None
    for d in docs:
        if whole(d.node("world_size")):
            return Reading(whole(d.node("world_size")), (d.evidence("world_size"),), "processes of the launch")
    got = s.get("distributed.nproc_per_node")
    if got and whole(got[0]):
        return Reading(whole(got[0]), (got[1],), "exactrl's own launcher; the manifest of a run from before it "
                       "recorded world_size does not say whether torchrun was started with more")
    return None


def _deepspeed_settings(run: OwnRun, phase: Phase, facts: Collected) -> None:
    """ZeRO stage and offload as exactrl configured DeepSpeed: the user's JSON (deepspeed.config) wins over
    deepspeed.zero_stage / offload_optimizer for what it sets (exactrl/distributed/deepspeed_engine.py)."""
    s = phase.settings
    named = s.get("deepspeed.config")
    user = Collected()
    if named and named[0]:
        path = Path(str(named[0]))
        found = next((p for p in (path, run.root / path, run.root / path.name) if p.is_file()), None)
        doc = None
        if found is not None:
            try:
                doc = Doc.parse(str(named[0]), found.read_text(errors="replace"), "json")
            except ValueError as e:
                facts.problem("unreadable", f"{named[0]}: not read as JSON ({e})", named[1], fact="deepspeed_config")
        if doc is None:
            facts.problem("missing", f"{named[1].at} names deepspeed.config {named[0]}, which is not in the run "
                          "directory: copy it there to read the ZeRO stage and offload it set", named[1],
                          fact="deepspeed_config")
            return
        if doc.has("zero_optimization", "stage"):
            user.value("zero_stage", doc.get("zero_optimization", "stage"))
        if doc.has("zero_optimization", "offload_optimizer", "device"):
            user.value("offload_optimizer", doc.get("zero_optimization", "offload_optimizer", "device"))
    for fact, key in (("zero_stage", "deepspeed.zero_stage"), ("offload_optimizer", "deepspeed.offload_optimizer")):
        for r in user.readings.get(fact) or ([Reading(s.get(key)[0], (s.get(key)[1],))] if s.get(key) else []):
            facts.add(fact, r.value, *r.evidence)


def framework_facts(run: OwnRun, manifest: Doc | None = None) -> dict[str, list[Reading]]:
    """exactrl trained it, which is neither OpenRLHF nor the Hugging Face Trainer."""
    version, at = _version(manifest, run, "exactrl")
    return {"framework": [Reading("exactrl", (at,), f"exactrl {version} wrote the manifest")],
            **{fact: [Reading(False, (at,), "an exactrl run")] for fact in ("is_openrlhf", "uses_hf_trainer")}}


def phase_facts(run: OwnRun, phase: Phase) -> Collected:
    """The facts the rules read, for one phase of an exactrl run."""
    s, c = phase.settings, Collected()
    c.readings.update(framework_facts(run, phase.manifest))
    algo = s.get("algo.name")
    section = s.doc.evidence("train") if s.doc is not None and s.doc.has("train") else None
    c.add("trainer", phase.name + (f" ({algo[0]})" if algo else ""), *(e for e in (algo and algo[1], section) if e))
    for package in ("deepspeed", "transformers", "torch", "accelerate"):
        value, where = _version(phase.manifest, run, package)
        if value:
            c.add(f"version:{package}", f"=={value}", where, note="installed when the run started")
        # a continued run: its earlier launches may have run on another stack (their manifests, kept)
        doc = phase.manifest if phase.manifest is not None and phase.manifest.has("versions") else run.manifest
        earlier = doc.node("previous_attempts") if doc is not None else None
        for i, attempt in enumerate(earlier if isinstance(earlier, list) else []):
            old = attempt.get("versions", {}).get(package) if isinstance(attempt, dict) else None
            if old and old != value:
                c.add(f"version:{package}", f"=={old}", doc.evidence("previous_attempts", i, "versions", package),
                      note="installed when an earlier launch of the run started")
    backend = s.get("distributed.backend") or ("single", Evidence(CONFIG, None, "distributed.backend: single"))
    c.add("uses_deepspeed", backend[0] == "deepspeed", backend[1], note=f"distributed.backend={backend[0]}")
    if backend[0] == "fsdp2":
        c.add("fsdp", "FSDP2 (distributed.backend=fsdp2)", backend[1])
    if backend[0] == "deepspeed":
        _deepspeed_settings(run, phase, c)
    for fact, key in (("micro_batch_size", "train.micro_batch_size"), ("global_batch_size", "train.global_batch_size")):
        if s.get(key):
            c.value(fact, s.get(key))
    world = _world(run, phase)
    if world is not None:
        c.readings["world_size"] = [world]
    g, m = (c.readings.get(f, [None])[0] for f in ("global_batch_size", "micro_batch_size"))
    if g and m and world:
        if g.value % (m.value * world.value) == 0:
            k = g.value // (m.value * world.value)
            c.add("effective_k", k, *g.evidence, *m.evidence, *world.evidence,
                  note=f"derived: {g.value} / ({m.value} x {world.value})")
        else:
            c.problem("inconsistent", f"global batch {g.value} is not a multiple of micro batch {m.value} x "
                      f"{world.value} ranks", *g.evidence, *m.evidence, *world.evidence, fact="effective_k")
    c.add("canary", Canary.of(phase).describe(), *(e for e in (s.get("audit.canary") or (None, None))[1:] if e))
    return c
