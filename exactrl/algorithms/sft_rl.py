"""GRPO plus SFT on demonstrations: CHORD's and HPT's objectives (one step holds the rollout's
responses and its prompts' demonstrations, exactrl/rollout/gated.py) and ReLIFT's buffer of
demonstrations, trained by SFT steps of their own between the GRPO steps.

Every loss here is terms of the Objective (losses/objective.py): the GRPO terms on the on-policy
samples, normalised over the step's on-policy tokens, and an NLL term on the demonstration
samples, normalised over the step's demonstration tokens — each its own step-wide token mean
(train.loss_agg chooses the GRPO term's; seq-mean-token-sum-norm, a constant length, is the mode
nearest HPT's and ReLIFT's loss_remove_token_mean: token sums over the padded length). The
official codes average per micro-batch instead (CHORD scales each micro-batch's means by its share of the step's
samples; HPT and ReLIFT take each micro-batch's token mean): exactrl keeps the one rule of the
maths (aggregation.py); ReLIFT's mean of micro-batch means is an option (algo.relift.mean_of_means)
because the seed paper (arXiv 2604.23747) names it as one of the bugs it measures.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from exactrl.data.batch import Sample
from exactrl.distributed.step_plan import StepPlan, plan_samples
from exactrl.losses.objective import Cosine, NLLTerm, Objective, Term
from exactrl.rollout.gated import correct, demonstration_sample

ON_POLICY = ("on_policy",)
DEMONSTRATIONS = ("demonstration",)


def on_policy(terms: list[Term]) -> list[Term]:
    """The GRPO terms (surrogate, KL, entropy) restricted to the responses the policy sampled."""
    return [replace(t, sources=ON_POLICY) for t in terms]


def chord_mu(cfg) -> Cosine:
    """CHORD's mu (arXiv 2508.11408, sec. 4; Trinity-RFT mu_schedule_function): linear warm-up
    from 0 to mu_peak over mu_warmup optimizer steps, half cosine to mu_valley over mu_decay, then held."""
    c = cfg.algo.chord
    return Cosine(c.mu_warmup, c.mu_peak, c.mu_valley, c.mu_warmup + c.mu_decay)


def chord_terms(terms: list[Term], cfg) -> list[Term]:
    """CHORD (Zhang et al. 2025, arXiv 2508.11408): (1 - mu) x GRPO + mu x SFT, mu scheduled
    (chord_mu); with algo.chord.phi the SFT token loss is weighted by sg(p (1 - p)) (CHORD-phi).
    As in Trinity-RFT's MIXCHORDPolicyLossFn, (1 - mu) scales the policy surrogate only (a KL
    or entropy term keeps its own coefficient). Trinity counts steps from 1, exactrl from 0."""
    mu = chord_mu(cfg)
    complement = Cosine(mu.warmup, 1 - mu.peak, 1 - mu.valley, mu.steps, start=1 - mu.start)
    scoped = [replace(t, coef=complement) if t.kind == "policy" else t for t in on_policy(terms)]
    return [*scoped, NLLTerm(coef=mu, sources=DEMONSTRATIONS, weight="p_one_minus_p" if cfg.algo.chord.phi else None)]


def hpt_terms(terms: list[Term], cfg) -> list[Term]:
    """HPT (Lv et al. 2025, arXiv 2509.04419): GRPO on the questions the gate kept, plus
    algo.hpt.sft_coef x SFT on the demonstrations of the others (rollout/gated.py). The official
    script runs without std normalisation (grpo_use_std=False) and without the clip
    (loss_remove_clip=True): algo.std_normalize=false and algo.policy_loss=reinforce."""
    return [*on_policy(terms), NLLTerm(coef=cfg.algo.hpt.sft_coef, sources=DEMONSTRATIONS)]


@dataclass
class SFTBuffer:
    """ReLIFT's buffer (Ma et al. 2025, arXiv 2506.07527; TheRoadQaQ/ReLIFT trainer.py): the
    prompts (their indices) of the questions none of whose responses was correct, newest first;
    once it holds ``size``, the newest ``size`` are released for one SFT step, the rest wait."""

    size: int
    pending: list[int] = field(default_factory=list)

    def push(self, samples: list[Sample], indices: list[int], group_size: int) -> int:
        """Buffer the rollout's questions that no response solved; returns how many."""
        failed = [i for k, i in enumerate(indices)
                  if not any(correct(s) for s in samples[k * group_size : (k + 1) * group_size])]
        self.pending = failed + self.pending
        return len(failed)

    def release(self) -> list[int] | None:
        if len(self.pending) < self.size:
            return None
        out, self.pending = self.pending[: self.size], self.pending[self.size :]
        return out


def sft_step_plan(demos: list[Sample], micro_batch_size: int, world_size: int, mean_of_means: bool) -> StepPlan:
    """The SFT step's plan: one token mean over the step's demonstration tokens, or (ReLIFT's code)
    the mean of micro-batch means."""
    plan = plan_samples(demos, micro_batch_size, "token-mean", world_size=world_size)
    return replace(plan, micro_means=mean_of_means)


SFT_OBJECTIVE = Objective((NLLTerm(),))


def relift_sft(policy, buffer: SFTBuffer, samples: list[Sample], indices: list[int], prompts,
               cfg) -> tuple[dict, list[Sample]]:
    """After a rollout's GRPO steps: buffer its unsolved questions, and once the buffer is full
    train one SFT step on the released demonstrations (with the GRPO steps' optimizer; ReLIFT's
    code keeps a second one of the same learning rate). Returns the step's metrics and the
    demonstrations it trained on (none until the buffer fills)."""
    stats, demos = {"sft_buffered": buffer.push(samples, indices, cfg.algo.group_size)}, []
    released = buffer.release()
    if released is not None:
        demos = [demonstration_sample(prompts[i]) for i in released]
        plan = sft_step_plan(demos, cfg.train.micro_batch_size, policy.world_size, cfg.algo.relift.mean_of_means)
        stats["sft_loss"] = policy.train_step(demos, plan, SFT_OBJECTIVE).loss
    return stats | {"sft_buffer": len(buffer.pending)}, demos
