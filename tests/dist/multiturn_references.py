"""Multi-turn episodes for the exactness tests (tests/test_multiturn_exactness.py in one process,
multiturn_equivalence.py on FSDP2 and DeepSpeed at world size 2), and their one-pass reference: GRPO's clipped
surrogate, a k3 KL to a reference model and an entropy bonus, written from their definitions over each episode's
policy tokens (found from the episode's own turn records, not the row's mask or origins), one padded forward of
the whole batch, plain torch SGD: no exactrl loss, term, plan or aggregation code.

Eight episodes (two prompts x four samples) run by rollout/multiturn.py's EpisodeRunner against tests/
multiturn_fixtures.py's Chatty environment and SeededTurns generator, rendered by the built-in tokenizer's chat
template: 1 to 4 turns of 1 to 14 sampled ids, each followed by the template's closing id and a user message of 0 to
40 characters wrapped in template ids. Rows then hold very different numbers of policy, template and environment
tokens. Every target, policy or not, carries an advantage, old and reference log-probs (the noise is drawn for all
of them), so only the mask keeps the others out of the loss.
"""

from __future__ import annotations

import torch
from equivalence import SMALL, in_dtype
from mixed_references import NORM_LEN, aggregate_by_definition, padded

from exactrl.algorithms.rl import attach_advantages
from exactrl.config import RLConfig, load_config
from exactrl.data.encode import Prompt
from exactrl.envs.base import EnvError
from exactrl.envs.render import ObservationRenderer
from exactrl.rollout.generator import SamplingParams
from exactrl.rollout.multiturn import EpisodeRunner, to_sample
from exactrl.tasks.tiny_model import build_tiny_model
from multiturn_fixtures import Chatty, LocalPool, SeededTurns, env_cfg

LR, CLIP, KL, ENTROPY, GROUP = 0.5, (0.2, 0.28), 0.1, 0.01, 4
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
QUESTIONS = ("12+34=", "7*8=")


def fresh_model(tok, seed: int = 3, dtype=torch.float64):
    return in_dtype(build_tiny_model(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, seed=seed,
                                     **SMALL), dtype)


def overrides(mode: str, micro: int, world: int = 1) -> list[str]:
    """The RL config of a case: GRPO with a KL and an entropy term, one SGD step, no clipping of the gradient."""
    return ["train.global_batch_size=8", f"train.micro_batch_size={micro}", f"train.loss_agg={mode}",
            *([f"train.loss_agg_norm={NORM_LEN}"] if mode == "seq-mean-token-sum-norm" else []),
            f"distributed.nproc_per_node={world}", "train.max_grad_norm=0", "optim.name=sgd", f"optim.lr={LR}",
            "optim.scheduler=constant", "algo.name=grpo", f"algo.group_size={GROUP}", f"algo.kl_coef={KL}",
            f"algo.entropy_coef={ENTROPY}", f"algo.clip_eps={CLIP[0]}", f"algo.clip_eps_high={CLIP[1]}",
            "algo.ratio_check=off"]  # old log-probs are perturbed: the ratio starts away from 1 on purpose


class ResetFails(LocalPool):
    """The pool with the environment of each of ``episodes`` (their positions) failing at reset: those episodes end
    before their first turn (env.on_error=end), rows without a policy token."""

    def __init__(self, make, episodes: tuple[int, ...]):
        super().__init__(make)
        self.failing = episodes

    def reset(self, episodes):
        opened = super().reset(episodes)
        return [EnvError(f"env episode {uid}: reset failed") if i in self.failing else o
                for i, ((uid, _), o) in enumerate(zip(episodes, opened))]


def make_episodes(tok, failed_resets: tuple[int, ...] = ()) -> list:
    runner = EpisodeRunner(ResetFails(Chatty, failed_resets), ObservationRenderer(tok, "template"), tok,
                           env_cfg(max_turns=4, max_tokens=160))
    prompts = [Prompt(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False), q, None, f"row {i}")
               for i, q in enumerate(QUESTIONS)]
    return runner.run(SeededTurns(tok, range(7, 100)).generate, prompts, [5, 6],
                      SamplingParams(n=GROUP, max_new_tokens=14))


def policy_targets(e) -> torch.Tensor:
    """The targets whose next token the policy sampled, from the episode's turns: target t predicts id t + 1."""
    head = len(e.prompt_ids) - 1
    return torch.tensor([head + t.start + j for t in e.turns for j in range(len(t.ids))], dtype=torch.long)


@torch.no_grad()
def make_samples(tok, failed_resets: tuple[int, ...] = ()) -> tuple[list, list]:
    """(samples, episodes): each episode as to_sample makes it, with GRPO's advantages (attach_advantages) plus
    noise, old log-probs (the initial policy's plus noise, so ratios clip), a reference model's log-probs."""
    episodes = make_episodes(tok, failed_resets)
    samples = [to_sample(e, float(i % 3 == 0)) for i, e in enumerate(episodes)]
    attach_advantages(samples, load_config(RLConfig, None, overrides("token-mean", 8)))
    ids, attn = padded(samples, tok.pad_token_id)

    def logprobs(seed):
        logits = fresh_model(tok, seed)(input_ids=ids, attention_mask=attn).logits[:, :-1]
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]

    policy, ref, g = logprobs(3), logprobs(9), torch.Generator().manual_seed(17)
    for b, s in enumerate(samples):
        n = s.num_targets
        s.advantages = s.advantages.double() + 0.5 * torch.randn(n, generator=g, dtype=torch.float64)
        s.old_logprobs = policy[b, :n] + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
        s.ref_logprobs = ref[b, :n].clone()
    return samples, episodes


def reference_loss(model, samples, episodes, pad_id: int, mode: str) -> torch.Tensor:
    """The step's loss over every episode's policy tokens: -min(r A, clip(r) A) + KL k3 - ENTROPY H per token,
    aggregated by ``mode``'s definition over the whole batch's sequences that have a policy token."""
    ids, attn = padded(samples, pad_id)
    logp_all = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits[:, :-1], -1)
    per_seq = []
    for b, (s, e) in enumerate(zip(samples, episodes)):
        t = policy_targets(e)
        if not len(t):  # an episode that ended before its first turn: no sequence of the policy's
            continue
        assert ids[b, t + 1].tolist() == [i for turn in e.turns for i in turn.ids]  # the sampled ids, in order
        lp = logp_all[b, t].gather(-1, ids[b, t + 1][:, None])[:, 0]
        ratio, adv = torch.exp(lp - s.old_logprobs[t]), s.advantages[t]
        surrogate = -torch.minimum(ratio * adv, ratio.clamp(1 - CLIP[0], 1 + CLIP[1]) * adv)
        d = s.ref_logprobs[t] - lp
        entropy = -(logp_all[b, t].exp() * logp_all[b, t]).sum(-1)
        per_seq.append(surrogate + KL * (torch.exp(d) - d - 1) - ENTROPY * entropy)
    return aggregate_by_definition(per_seq, mode)


def sgd_reference(tok, samples, episodes, mode: str, dtype=torch.float64) -> tuple[dict, float]:
    """(parameters after one SGD step on the reference loss, the loss)."""
    model = fresh_model(tok, dtype=dtype)
    loss = reference_loss(model, samples, episodes, tok.pad_token_id, mode)
    loss.backward()
    with torch.no_grad():
        return {k: (v - LR * v.grad).detach() for k, v in model.named_parameters()}, float(loss)


def token_counts(samples) -> dict:
    """Per row, its targets by origin (what makes these rows uneven)."""
    return {o: [s.token_origins[len(s.prompt_ids) - 1 :].count(o) for s in samples]
            for o in ("policy", "template", "environment")}
