"""The policy terms of two mixed-policy methods whose GRPO groups hold demonstrations beside the
policy's samples (exactrl/rollout/mixed.py puts them there; advantages come from the whole group).

LUFFY (Yan et al. 2025, "Learning to Reason under Off-Policy Guidance", arXiv 2504.14945; code
github.com/ElliottYan/LUFFY, verl/mix_src): the clipped ratio on the policy's tokens, the shaped
f(p) = p / (p + gamma) with behaviour probability 1 and no clip on the demonstrations', one
token-mean over both (its objective). Where its official code (exp_scripts/train.sh) differs, exactrl
follows the paper and exposes the code's choice:
  - the code drops the clip on the policy's tokens (loss_remove_clip=True): algo.luffy.clip=false;
  - the code does not divide advantages by the group std (grpo_use_std=False): algo.std_normalize=false;
  - the code divides the loss sum by the padded response length, a constant, not by the tokens
    (loss_remove_token_mean=True): train.loss_agg=seq-mean-token-sum-norm with
    train.loss_agg_norm = the response length limit;
  - the code counts the demonstration inside rollout.n=8 (n_prefix=1), as algo.group_size does here.

SRFT (Fu et al. 2025, "SRFT: A Single-Stage Method with Supervised and Reinforcement Fine-Tuning
for Reasoning", arXiv 2506.19767; code github.com/fyqqyf/SRFT, a fork of LUFFY's verl/mix_src):
  L = w_SFT NLL(demo) + L_RL(demo) + [w_RL NLL(y+) + log p(y-)], with
  w_SFT = 0.5 sg(exp(-H)), w_RL = 0.1 sg(exp(H)) and L_RL(demo) = -min(p A, clip(p) A) (behaviour
  probability 1, advantages over the group with the demonstration, as LUFFY, on which it builds).
  Where its official code differs (mix_core_alg.py compute_token_on_off_policy_loss and
  exp_scripts/train.sh, as read by secondary sources: the repository is not reachable from here),
  exactrl follows the paper and exposes the code's choice:
  - the code weighs the demonstrations' NLL by sg(exp(+H)), not exp(-H) (its 0.5 is the script's
    sft_loss_coef=-0.5, subtracted): algo.srft.sft_weight=exp_entropy;
  - the code's demonstration term is LUFFY's shaped, unclipped one (off_policy_reshape=p_div_p_0.1):
    algo.srft.demo_gamma=0.1 algo.srft.demo_clip=false;
  - the script adds an entropy bonus of 0.001 (entropy_coeff): algo.entropy_coef=0.001.
  Choices the paper leaves open, made here: H is each token's own entropy (not a batch mean); the
  demonstration terms share one normaliser over the demonstrations' tokens, the positive and
  negative terms one over the policy's tokens (the paper's expectations, each over its samples);
  "positive" is a reward >= algo.srft.positive_reward.
"""

from __future__ import annotations

from exactrl.losses.objective import DemonstrationTerm, MixedPolicyTerm, NLLTerm, OutcomeTerm, Term

DEMO, ON = ("demonstration",), ("on_policy",)


def luffy_terms(cfg, agg: dict) -> list[Term]:
    a = cfg.algo
    loss = a.policy_loss or ("ppo" if a.luffy.clip else "reinforce")
    return [MixedPolicyTerm(loss=loss, gamma=a.luffy.gamma, clip_low=a.clip_eps, clip_high=a.clip_eps_high
                            or a.clip_eps, dual_clip=a.dual_clip, **agg)]


def srft_terms(cfg, agg: dict) -> list[Term]:
    a, s = cfg.algo, cfg.algo.srft
    clip = (a.clip_eps, a.clip_eps) if s.demo_clip else None  # p <= 1: only the lower bound can act
    return [NLLTerm(coef=s.sft_coef, weight=s.sft_weight, sources=DEMO, **agg),
            DemonstrationTerm(clip=clip, gamma=s.demo_gamma, sources=DEMO, **agg),
            OutcomeTerm(sign="positive", coef=s.positive_coef, weight="exp_entropy", threshold=s.positive_reward,
                        sources=ON, **agg),
            OutcomeTerm(sign="negative", threshold=s.positive_reward, sources=ON, **agg)]
