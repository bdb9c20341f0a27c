"""The known silent gradient bugs, as pure rules over one concrete assignment of a run's facts.

Each rule returns an `Outcome` for a value (or None) per fact; exactrl/audit/judging.py
evaluates it over every combination the evidence admits. A rule first models what the run
computed (which trainer and loss, which engine) and only then applies the bug's conditions.

Rules (the sources are cited again next to the code that encodes them):

- ``deepspeed-offload-accumulation``: DeepSpeed PR #6550 (v0.15.2) made ZeRO stage 2 with
  ``offload_optimizer: cpu`` drop the intermediate micro-batches of a gradient-accumulation
  window (the optimizer sees about (g_first + g_last)/K); PR #7967 fixed it in v0.19.0.
  AFFECTED iff a DeepSpeed run, 0.15.2 <= deepspeed < 0.19.0, stage 2, offload device cpu
  and DeepSpeed's K >= 3, whatever the loss. Measured (FACTS.md): stage 1 + offload reduces
  only at the boundary and is exact, stage 0 ignores offload, stage 3 is a separate exact
  path, K = 2 is accidentally right. FSDP runs (verl, Accelerate FSDP) never reach this code;
  OpenRLHF ``--use_dynamic_batch`` (0.8.7+, PR #1078) sets DeepSpeed's K to 1 and calls
  backward() once per micro-batch, the case PR #7981 (also 0.19.0) fixed.
- ``openrlhf-mean-of-means``: OpenRLHF averaged token losses per micro-batch and then
  averaged those means. Which losses: SFT (GPTLMLoss, a token mean) in every release before
  the fix; PPO from 0.7.0 (PR #923, commit 9673a87c: ``token_level_loss``), and before 0.7.0
  only with ``--packing_samples`` (0.6.x PolicyLoss averages each sequence, then the
  sequences: exact over equal-sized micro-batches); never DPO, RM or KTO, which average one
  loss per pair or example (unless ``--nll_loss_coef`` adds a token-averaged term). Commit
  df78645e (first released in v0.10.3) normalised by token counts summed over all ranks, PR
  #1249 (commit c5bebd14, first in v0.10.4) over the whole accumulation window too. AFFECTED
  iff such a loss and openrlhf <= 0.10.2 with K > 1 or world size > 1, or openrlhf 0.10.3
  with K > 1 (checked with `git tag --contains` on OpenRLHF/OpenRLHF).
- ``transformers-ga-normalisation``: before PR #34191 (first in transformers 4.46.0) the
  Trainer divided each micro-batch's mean loss by K instead of dividing the summed token
  loss by the tokens of the whole step. AFFECTED iff a Trainer-based run (HF Trainer, TRL,
  LLaMA-Factory) whose loss is a token mean (SFT, pre-training; not DPO / RM / KTO, one loss
  per pair), transformers < 4.46.0 and gradient_accumulation_steps > 1.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from packaging.version import Version

from exactrl.audit.evidence import Evidence


class Status(str, Enum):
    AFFECTED = "AFFECTED"
    NOT_AFFECTED = "NOT AFFECTED"
    CONDITIONAL = "CONDITIONAL"  # AFFECTED or not depending on one fact the files leave open (the world size)
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
    condition: str = ""  # for CONDITIONAL: when the run is AFFECTED, e.g. "run on <= 21 GPUs"
    missing: tuple[str, ...] = field(default=(), repr=False)  # for UNKNOWN: the facts it lacks

    @property
    def shown(self) -> str:
        return f"AFFECTED if {self.condition}" if self.status is Status.CONDITIONAL else self.status.value

    def to_json(self) -> dict:
        return {"bug": self.bug, "title": self.title, "status": self.status.value, "condition": self.condition,
                "reason": self.reason, "action": self.action, "evidence": [e.to_json() for e in self.evidence]}


V = Version
HF_FAMILY = ("transformers-trainer", "trl", "llamafactory")
# Trainers whose loss is one value per pair or example: micro-batches of equal size make the
# mean of their means the mean of the step, so token-averaging bugs cannot touch them.
PER_EXAMPLE = {"dpo": "DPO averages one loss per pair", "rm": "a reward model averages one loss per pair",
               "reward_modeling": "a reward model averages one loss per pair",
               "kto": "KTO averages one loss per example"}
NOTHING = "Nothing to do."


def sentence(text: str) -> str:
    """Capitalise a sentence that starts with a plain word; one that starts with a file name or a
    key (training_args.bin, micro_batch_size) keeps it as written."""
    return text[:1].upper() + text[1:] if re.match(r"[a-z]+[ ,:;]", text) else text


def _decide(false_reasons: list[str], missing: list[str], affected: str) -> Outcome:
    """NOT AFFECTED as soon as one condition is known false; UNKNOWN if one is not known."""
    if false_reasons:
        return Outcome(Status.NOT_AFFECTED, sentence("; ".join(false_reasons)) + ".")
    if missing:
        return Outcome(Status.UNKNOWN, "", tuple(missing))
    return Outcome(Status.AFFECTED, affected)


def _per_example(trainer: Any) -> str | None:
    """Why a trainer's loss is immune to token-averaging bugs, or None."""
    return None if trainer is None else PER_EXAMPLE.get(str(trainer))


# DeepSpeed PR #6550 introduced the drop (v0.15.2); PR #7967 fixed it (v0.19.0).
DS_BROKEN, DS_FIXED = V("0.15.2"), V("0.19.0")


def deepspeed_offload(f: Mapping[str, Any]) -> Outcome:
    uses, stage, device, k, v = (f["uses_deepspeed"], f["zero_stage"], f["offload_optimizer"],
                                 f["effective_k"], f["version:deepspeed"])
    fsdp, dynamic = f.get("fsdp"), f.get("dynamic_batch")
    no = []
    if fsdp:
        no.append(f"{fsdp} trained this run, not DeepSpeed: its parameter / optimizer offload is another code path")
    elif uses is False and stage is None:
        no.append("the run did not use DeepSpeed")
    if stage is not None and stage != 2:
        no.append({0: "ZeRO stage 0 ignores offload_optimizer",
                   1: "ZeRO stage 1 + offload reduces only at the accumulation boundary: exact (measured)",
                   3: "ZeRO stage 3 is a separate code path: exact (measured)"}.get(stage, f"ZeRO stage {stage}"))
    if device is not None and device != "cpu":
        no.append(f"the offload_optimizer device is {device}, not cpu")
    if dynamic:
        no.append("OpenRLHF --use_dynamic_batch sets DeepSpeed's gradient_accumulation_steps to 1")
        k = None
    elif k is not None and k < 3:
        no.append("K = 1: no accumulation" if k <= 1 else
                  "K = 2 is accidentally right (the first and last micro-batches are the only ones)")
    if v is not None and not DS_BROKEN <= v < DS_FIXED:
        when = "before PR #6550 (0.15.2)" if v < DS_BROKEN else "fixed (PR #7967, 0.19.0)"
        no.append(f"the deepspeed version {v} is {when}")
    missing = [n for n, x in (("zero_stage", stage), ("offload_optimizer", device), ("effective_k", k),
                              ("version:deepspeed", v)) if x is None and not (n == "effective_k" and dynamic)]
    return _decide(no, missing,
                   f"With deepspeed {v}, ZeRO stage 2, offload_optimizer cpu and K = {k}, the optimizer saw about "
                   f"(g_first + g_last)/{k} instead of (g_1 + ... + g_{k})/{k} (PR #6550 introduced it, PR #7967 "
                   "fixed it in 0.19.0). Loss curves look normal.")


def deepspeed_note(options: Mapping[str, list[Any]]) -> str:
    """K = 1 with several backward() calls per step (OpenRLHF --use_dynamic_batch) on ZeRO-1/2 +
    offload before 0.19.0: the case of PR #7981, which this audit does not judge."""
    stages, devices, versions = (options[n] for n in ("zero_stage", "offload_optimizer", "version:deepspeed"))
    if not (True in options.get("dynamic_batch", []) and any(s in (1, 2) for s in stages) and "cpu" in devices
            and any(v is None or v < DS_FIXED for v in versions)):
        return ""
    return ("Separately, PR #7981 (also in 0.19.0) fixed ZeRO-1/2 + offload keeping only the last of several "
            "backward() calls per step when gradient_accumulation_steps = 1, which is what --use_dynamic_batch "
            "does; that case is not judged here.")


# OpenRLHF: PR #923 (commit 9673a87c, first in v0.7.0) made the PPO policy loss token-level; commit
# df78645e (first in v0.10.3) sums token counts across ranks; PR #1249 (commit c5bebd14, first in
# v0.10.4) across the accumulation window as well.
ORLHF_TOKEN_PPO, ORLHF_RANKS_FIXED, ORLHF_FIXED = V("0.7.0"), V("0.10.3"), V("0.10.4")


def openrlhf_mean_of_means(f: Mapping[str, Any]) -> Outcome:
    is_orlhf, v, k, world = f["is_openrlhf"], f["version:openrlhf"], f["effective_k"], f["world_size"]
    trainer, packing = f.get("trainer"), f.get("packing_samples")
    no = []
    if is_orlhf is False:
        no.append("not an OpenRLHF run")
    if _per_example(trainer):
        no.append(f"{_per_example(trainer)}; every micro-batch holds as many, so the mean of their means is exact")
    old_ppo = trainer == "ppo" and v is not None and v < ORLHF_TOKEN_PPO
    if old_ppo and packing is False:
        no.append(f"PPO in openrlhf {v} without --packing_samples averages each sequence over its tokens, then the "
                  "sequences: exact over equal-sized micro-batches (token-level averaging arrived in 0.7.0, PR #923)")
    if v is not None and v >= ORLHF_FIXED:
        no.append(f"the openrlhf version {v} normalises by the tokens of the whole step (PR #1249, 0.10.4)")
    ranks_fixed = v is not None and ORLHF_RANKS_FIXED <= v < ORLHF_FIXED
    single_micro = k is not None and k <= 1
    if ranks_fixed and single_micro:
        no.append(f"K = 1, and openrlhf {v} already sums token counts across ranks (commit df78645e, 0.10.3)")
    elif single_micro and world is not None and world <= 1:
        no.append("K = 1 on one rank: nothing is averaged")
    needed = [("is_openrlhf", is_orlhf), ("trainer", trainer), ("version:openrlhf", v), ("effective_k", k)]
    if old_ppo:
        needed.append(("packing_samples", packing))
    if not ranks_fixed and not (k is not None and k > 1):
        needed.append(("world_size", world))
    missing = [n for n, x in needed if x is None]
    split = f"K = {k}" + (f" on {world} rank{'s' * (world != 1)}" if world else "")
    return _decide(no, missing,
                   f"With openrlhf {v}{f' ({trainer})' if trainer else ''}, {split}, each micro-batch's token "
                   "losses were averaged on their own and those means averaged, so short micro-batches weigh as "
                   "much as long ones (commit df78645e, in 0.10.3, summed token counts across ranks; PR #1249, in "
                   "0.10.4, across the accumulation window).")


# transformers PR #34191 (num_items_in_batch) is first in 4.46.0: the 4.46.0 wheel's Trainer passes
# num_items_in_batch to compute_loss, the 4.45.2 wheel's does not.
TF_FIXED = V("4.46.0")


def transformers_ga(f: Mapping[str, Any]) -> Outcome:
    hf, v, k, trainer = f["uses_hf_trainer"], f["version:transformers"], f["effective_k"], f.get("trainer")
    no = []
    if hf is False:
        no.append("not a Trainer-based run (HF Trainer, TRL or LLaMA-Factory)")
    if hf is not False and _per_example(trainer):
        no.append(f"{_per_example(trainer)}; the Trainer's division by K is exact over equal-sized micro-batches")
    if v is not None and v >= TF_FIXED:
        no.append(f"the transformers version {v} has the num_items_in_batch normalisation (PR #34191, 4.46.0)")
    if k is not None and k <= 1:
        no.append("gradient_accumulation_steps = 1")
    missing = [n for n, x in (("uses_hf_trainer", hf), ("version:transformers", v), ("effective_k", k)) if x is None]
    return _decide(no, missing,
                   f"With transformers {v} and gradient_accumulation_steps = {k}, the Trainer averaged each "
                   "micro-batch's loss over its own tokens and divided by K, so micro-batches with few tokens "
                   "weigh as much as long ones (fixed by PR #34191 in 4.46.0).")


RULES: dict[str, BugRule] = {rule.name: rule for rule in (
    BugRule("deepspeed-offload-accumulation", "DeepSpeed ZeRO-2 CPU-offload drops accumulated micro-batches",
            ("uses_deepspeed", "zero_stage", "offload_optimizer", "effective_k", "version:deepspeed", "fsdp",
             "dynamic_batch"), deepspeed_offload,
            "Upgrade to deepspeed>=0.19.0, or use K<=2, or disable offload_optimizer; re-run what depends on it.",
            deepspeed_note),
    BugRule("openrlhf-mean-of-means", "OpenRLHF mean-of-means loss aggregation",
            ("is_openrlhf", "version:openrlhf", "effective_k", "world_size", "trainer", "packing_samples"),
            openrlhf_mean_of_means, "Upgrade to openrlhf>=0.10.4 (PR #1249); re-run what depends on it."),
    BugRule("transformers-ga-normalisation", "Transformers Trainer gradient-accumulation loss normalisation",
            ("uses_hf_trainer", "version:transformers", "effective_k", "trainer"), transformers_ga,
            "Upgrade to transformers>=4.46.0 (PR #34191; later patch releases fixed follow-ups such as "
            "PR #35438, so prefer a current release); re-run what depends on it."),
)}

VERSION_BOUNDARIES = {"deepspeed": (DS_BROKEN, DS_FIXED), "openrlhf": (ORLHF_TOKEN_PPO, ORLHF_RANKS_FIXED, ORLHF_FIXED),
                      "transformers": (TF_FIXED,)}

HINTS = {
    "uses_deepspeed": "whether DeepSpeed was used (a DeepSpeed config or the launch command)",
    "zero_stage": "ZeRO stage (zero_optimization.stage, --zero_stage / --ds.zero_stage, accelerate zero_stage)",
    "offload_optimizer": "optimizer offload device (zero_optimization.offload_optimizer.device, --adam_offload)",
    "effective_k": "gradient accumulation steps (or global batch, micro batch and world size)",
    "world_size": "world size (--num_gpus / --nproc_per_node / num_processes on the launch command)",
    "is_openrlhf": "training framework (a launch command or saved arguments showing whether OpenRLHF trained it)",
    "uses_hf_trainer": "training framework (saved TrainingArguments, a TRL or LLaMA-Factory config)",
    "trainer": "which trainer ran (the launch command's program, e.g. openrlhf.cli.train_sft or train_dpo)",
    "packing_samples": "whether the run was given --packing_samples (the launch command)",
}
RELATED = {"effective_k": ("gradient_accumulation_steps", "micro_batch_size", "global_batch_size", "world_size",
                           "deepspeed_config"),
           "zero_stage": ("deepspeed_config",), "offload_optimizer": ("deepspeed_config",)}


def hint(fact: str) -> str:
    if fact.startswith("version:"):
        return f"{fact[8:]} version (pip freeze, conda list, requirements.txt or W&B's requirements.txt)"
    return HINTS.get(fact, fact)
