"""RL equivalence cases for one backend, run by tests/test_rl_backends.py (under torchrun for
world size 2, or as one process); writes one JSON result file.

usage: python rl_equivalence.py {fsdp2,deepspeed} WORLD OUT.json

Losses: for each policy loss (PPO's clipped ratio with and without clip-higher, KL and
entropy terms; GSPO's sequence ratio; plain REINFORCE) and the critic's clipped value loss,
two optimizer steps on one fixed rollout through the real path (rl.step_plan, Worker.train_step
under the algorithm's objective or Critic.step, the backend's engine, the canary on), from the
same initial model, compared on rank 0 with an independent single-process reference: one
padded forward over the whole rollout, each loss written out from its paper's definition,
plain torch SGD. Old log-probs are perturbed so that the ratio and the clipping are active
from the first step.

Rollout sharing: each rank samples its share of the prompts (a scripted generator), every
rank receives the whole rollout in order, and the advantages every rank computes equal a
one-process computation; computing them from a rank's own share instead differs (the check
can fail).
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist
from equivalence import SMALL, dtype_of, full_state, in_dtype, precision, relative_error
from mixed_references import (
    HPT_SFT_COEF,
    MIXED_MU,
    NORM_LEN,
    ScoredSample,
    aggregate_by_definition,
    hinted,
    in_groups,
    padded,
    reference_group_demo_loss,
    reference_mean_of_means,
    reference_sft_mix_loss,
    spans,
    top_entropy,
    with_demonstrations,
)
from transformers import LlamaForTokenClassification

from exactrl.algorithms.registry import ALGORITHMS
from exactrl.config.methods import METHODS, names
from exactrl.algorithms.rl import attach_advantages, step_plan
from exactrl.algorithms.sft_rl import SFT_OBJECTIVE, sft_step_plan
from exactrl.data.batch import Sample
from exactrl.rollout.collect import collect_rollout
from exactrl.workers.worker import Worker
from exactrl.workers.critic import Critic
from exactrl.distributed.collectives import gather, shard
from exactrl.config import RLConfig, load_config
from exactrl.data.encode import Prompt
from exactrl.distributed.engine import build_engine
from exactrl.distributed.launch import end_rank, shutdown
from exactrl.rewards import load_rewards
from exactrl.rollout.generator import Generation, SamplingParams
from exactrl.tasks.tiny_model import build_tiny_model
from exactrl.tasks.tokenizer import build_tokenizer

LR = 0.5


def fresh_policy(tok, seed=3, dtype=torch.float32):
    model = build_tiny_model(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, seed=seed, **SMALL)
    return in_dtype(model, dtype)


def fresh_critic(tok, dtype=torch.float32):
    policy = fresh_policy(tok)
    config = copy.deepcopy(policy.config)
    config.num_labels, config.classifier_dropout = 1, 0.0
    torch.manual_seed(5)
    critic = LlamaForTokenClassification(config)
    critic.model.load_state_dict(policy.model.state_dict())
    return in_dtype(critic, dtype)


@torch.no_grad()
def make_rollout(tok) -> list[Sample]:
    """8 samples (2 groups of 4) of uneven length, per-token advantages, old log-probs = the initial policy's + noise, a reference
    model's log-probs, the initial critic's values + noise, and returns."""
    g = torch.Generator().manual_seed(11)
    samples = []
    for i in range(8):
        prompt = tok(f"{i}+{i * 7}=")["input_ids"]
        resp = torch.randint(7, 20, (2 + (i * 5) % 9,), generator=g).tolist()
        samples.append(ScoredSample(prompt, resp, reward=float(i % 3 == 0)))
    ids, attn = padded(samples, tok.pad_token_id)
    logp = torch.log_softmax(fresh_policy(tok)(input_ids=ids, attention_mask=attn).logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    ref = torch.log_softmax(fresh_policy(tok, seed=9)(input_ids=ids, attention_mask=attn).logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    values = fresh_critic(tok)(input_ids=ids, attention_mask=attn).logits[:, :-1, 0]
    for b, (s, sl) in enumerate(zip(samples, spans(samples))):
        n = ids.size(1) - 1
        adv = torch.zeros(n)
        adv[sl] = torch.randn(len(s.response_ids), generator=g) + (b % 4 - 1.5)
        s.advantages = adv[: sl.stop]
        s.seq_advantage = float(b % 4 - 1.5)
        s.old_logprobs = (logp[b] + 0.3 * torch.randn(n, generator=g))[: sl.stop]
        s.ref_logprobs = ref[b, : sl.stop].clone()
        s.old_values = (values[b] + 0.2 * torch.randn(n, generator=g))[: sl.stop]
        s.returns = torch.randn(n, generator=g)[: sl.stop]
    return samples


def sequence_advantages(samples: list[Sample]) -> list[Sample]:
    """The rollout with one advantage per response on all its tokens (what GSPO is given)."""
    out = []
    for s, sl in zip(samples, spans(samples)):
        adv = torch.zeros_like(s.advantages)
        adv[sl] = s.seq_advantage
        out.append(copy.copy(s))
        out[-1].advantages = adv
    return out


def reference_policy_loss(model, samples, tok, case):
    ids, attn = padded(samples, tok.pad_token_id)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    logp_all = torch.log_softmax(logits, -1)
    lo, hi = case.get("clip", (0.2, 0.2))
    per_token, hint_nll = [], []
    for b, (s, sl) in enumerate(zip(samples, spans(samples))):
        lp = logp_all[b, sl].gather(-1, ids[b, 1:][sl][:, None])[:, 0]
        old, adv = s.old_logprobs[sl], s.advantages[sl]
        prefix = torch.tensor([o == "demonstration" for o in (s.origin or ("policy",) * s.num_targets)][sl])
        if case["loss"] == "uft":  # GRPO on the continuation; NLL on the hint (below)
            ratio = torch.exp(lp - old)
            per_token.append(-torch.minimum(ratio * adv, ratio.clamp(1 - lo, 1 + hi) * adv)[~prefix])
            hint_nll.append(-lp[prefix])
            continue
        if case["loss"] == "prefix_rft":  # advantages kept on the top-entropy share of the prefix only
            p = torch.softmax(logits[b, sl], -1).detach()
            adv = adv * (~prefix | top_entropy(-(p * torch.log(p)).sum(-1), prefix, case["keep"]))
        if case["loss"] == "gspo":  # one ratio per sequence: the geometric mean of its token ratios
            ratio = torch.exp((lp - old).mean())
            a = s.seq_advantage
            tok_loss = (-torch.minimum(ratio * a, ratio.clamp(1 - lo, 1 + hi) * a)).expand(len(s.response_ids))
        elif case["loss"] == "reinforce":
            tok_loss = -torch.exp(lp - old) * adv
        else:
            ratio = torch.exp(lp - old)
            tok_loss = -torch.minimum(ratio * adv, ratio.clamp(1 - lo, 1 + hi) * adv)
        if case.get("kl"):  # k3 = exp(ref - lp) - (ref - lp) - 1
            d = s.ref_logprobs[sl] - lp
            tok_loss = tok_loss + case["kl"] * (torch.exp(d) - d - 1)
        if case.get("entropy"):
            p = torch.softmax(logits[b, sl], -1)
            tok_loss = tok_loss - case["entropy"] * -(p * torch.log(p)).sum(-1)
        per_token.append(tok_loss)
    if case["loss"] == "uft":
        return aggregate_by_definition(per_token, case["mode"]) + case["nll"] * torch.cat(hint_nll).mean()
    return aggregate_by_definition(per_token, case["mode"])


def reference_value_loss(model, samples, tok, case):
    ids, attn = padded(samples, tok.pad_token_id)
    values = model(input_ids=ids, attention_mask=attn).logits[:, :-1, 0]
    per_token = []
    for b, (s, sl) in enumerate(zip(samples, spans(samples))):
        v, old, ret = values[b, sl], s.old_values[sl], s.returns[sl]
        err = (v - ret) ** 2
        if case.get("value_clip"):
            c = case["value_clip"]
            err = torch.maximum(err, (old + (v - old).clamp(-c, c) - ret) ** 2)
        per_token.append(0.5 * err)
    return aggregate_by_definition(per_token, case["mode"])


def reference(case, samples, tok, dtype) -> tuple[dict, dict]:
    """Parameters after two SGD steps on the loss by definition, and the initial ones, in ``dtype``."""
    critic = case["loss"] == "value"
    fresh = (lambda: fresh_critic(tok, dtype)) if critic else (lambda: fresh_policy(tok, dtype=dtype))  # noqa: E731
    model = fresh()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(2):
        opt.zero_grad()
        if case["loss"] in SFT_MIX:
            reference_sft_mix_loss(model, samples, tok, case, step).backward()
        elif case["loss"] in GROUP_DEMO:
            reference_group_demo_loss(model, samples, tok, case).backward()
        elif case["loss"] == "relift_sft":
            reference_mean_of_means(model, samples, tok, case).backward()
        else:
            (reference_value_loss if critic else reference_policy_loss)(model, samples, tok, case).backward()
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}, fresh().state_dict()


def case_config(case, layout) -> RLConfig:
    algo = {"ppo": "grpo", "gspo": "gspo", "reinforce": "reinforce_pp", "value": "ppo",
            "relift_sft": "relift"}.get(case["loss"], case["loss"])
    lo, hi = case.get("clip", (0.2, 0.2))
    overrides = [*layout, f"distributed.nproc_per_node={dist.get_world_size() if dist.is_initialized() else 1}",
                 "train.global_batch_size=8", f"train.micro_batch_size={case['micro']}", f"train.loss_agg={case['mode']}",
                 "train.max_grad_norm=0", "optim.name=sgd", f"optim.lr={LR}",
                 "optim.scheduler=constant", f"algo.name={algo}", "algo.group_size=4",
                 f"algo.kl_coef={case.get('kl', 0.0)}", f"algo.entropy_coef={case.get('entropy', 0.0)}"]
    if algo != "srft":  # srft takes no ratio to check (config/used.py)
        overrides.append("algo.ratio_check=off")
    # Only the keys this case's run uses (a key the run cannot use is refused, config/used.py USED_WHEN).
    if case["mode"] == "seq-mean-token-sum-norm":
        overrides.append(f"train.loss_agg_norm={NORM_LEN}")
    if algo == "ppo":
        overrides += ["critic.optim.name=sgd", f"critic.optim.lr={LR}", f"critic.value_clip={case.get('value_clip') or 'null'}"]
    if algo == "uft":
        overrides.append(f"algo.uft.nll_coef={case['nll']}")
    if algo == "prefix_rft":
        overrides.append(f"algo.prefix_rft.keep={case['keep']}")
    if algo == "chord":
        warmup, decay, peak, valley = MIXED_MU
        overrides += [f"algo.chord.mu_warmup={warmup}", f"algo.chord.mu_decay={decay}", f"algo.chord.mu_peak={peak}",
                      f"algo.chord.mu_valley={valley}", "algo.chord.phi=true"]
    if algo == "hpt":
        overrides.append(f"algo.hpt.sft_coef={HPT_SFT_COEF}")
    if algo == "relift":
        overrides.append("algo.relift.mean_of_means=true")
    if case["loss"] == "reinforce":
        overrides.append("algo.policy_loss=reinforce")
    else:
        overrides += [f"algo.clip_eps={lo}"] + ([f"algo.clip_eps_high={hi}"] if algo != "srft" else [])
    return load_config(RLConfig, None, overrides)


def exactrl_run(case, samples, tok, layout) -> dict:
    cfg = case_config(case, layout)
    if case["loss"] == "value":
        model = fresh_critic(tok, dtype_of(cfg))
        critic = Critic(cfg, model, 2, tok.pad_token_id)
        for _ in range(2):
            critic.step(samples, step_plan(samples, cfg, critic.engine.world_size))
        return full_state(critic.engine, model)
    model = fresh_policy(tok, dtype=dtype_of(cfg))
    engine = build_engine(model, cfg, total_steps=2)
    policy = Worker("policy", model, engine, pad_id=tok.pad_token_id, packed=cfg.train.padding_free,
                    temperature=cfg.rollout.temperature)
    objective = ALGORITHMS.lookup(cfg.algo.name).objective(cfg)
    for _ in range(2):
        if case["loss"] == "relift_sft":
            policy.train_step(samples, sft_step_plan(samples, cfg.train.micro_batch_size, engine.world_size,
                                                     cfg.algo.relift.mean_of_means), SFT_OBJECTIVE)
        else:
            policy.train_step(samples, step_plan(samples, cfg, engine.world_size), objective)
    return full_state(engine, model)


POLICY_CASES = [
    dict(loss="ppo", mode="token-mean"),
    dict(loss="ppo", mode="seq-mean-token-sum-norm", clip=(0.2, 0.28), kl=0.1, entropy=0.01),
    dict(loss="gspo", mode="seq-mean-token-mean", clip=(0.03, 0.05)),  # clips some sequences (ratios 0.86-1.13), not all
    dict(loss="reinforce", mode="seq-mean-token-sum"),
    dict(loss="uft", mode="token-mean", nll=0.5),  # on hinted(): prefix and policy tokens in one sequence
    dict(loss="prefix_rft", mode="seq-mean-token-sum-norm", keep=0.4),
]
GROUP_DEMO = names(demonstrations_in_group=True)
# demonstrations in the groups, each method's own terms (exactrl/algorithms/luffy_srft.py)
GROUP_DEMO_CASES = [dict(loss="luffy", mode="token-mean"), dict(loss="srft", mode="token-mean")]
# GRPO plus SFT on demonstrations in one step (exactrl/algorithms/sft_rl.py), token-mean per kind of sample
SFT_MIX = names(sft_demonstrations=True)
SFT_MIX_CASES = [dict(loss=name, mode="token-mean") for name in SFT_MIX]
# ReLIFT's SFT step with its code's mean of micro-batch means (algo.relift.mean_of_means)
SFT_MIX_CASES.append(dict(loss="relift_sft", mode="token-mean"))
VALUE_CASES = [dict(loss="value", mode="token-mean", value_clip=0.2), dict(loss="value", mode="seq-mean-token-mean")]


def cases(backend: str) -> list[dict]:
    every = POLICY_CASES + VALUE_CASES + GROUP_DEMO_CASES
    if backend == "fsdp2":
        return [dict(c, micro=2, layout=["distributed.backend=fsdp2"]) for c in every + SFT_MIX_CASES] + \
               [dict(every[0], micro=m, layout=["distributed.backend=fsdp2"]) for m in (1, 4)]
    ds = lambda *kv: ["distributed.backend=deepspeed", *(f"deepspeed.{x}" for x in kv)]  # noqa: E731
    out = []
    for layout in (ds("zero_stage=2", "offload_optimizer=cpu"), ds("zero_stage=3")):
        out += [dict(c, micro=2, layout=layout) for c in every]
    out += [dict(c, micro=2, layout=ds("zero_stage=2", "offload_optimizer=cpu")) for c in SFT_MIX_CASES]
    for layout in (ds("zero_stage=0"), ds("zero_stage=1", "offload_optimizer=cpu"),
                   ds("zero_stage=3", "offload_optimizer=cpu", "offload_param=cpu")):
        out += [dict(c, micro=1, layout=layout) for c in (POLICY_CASES[0], VALUE_CASES[0])]
    return out


class ScriptedGenerator:
    """Deterministic responses: prompt k's j-th response has (k * 3 + j) % 7 + 1 tokens."""

    def generate(self, prompt_ids, params=SamplingParams(), seeds=None):
        out = []
        for i, ids in enumerate(prompt_ids):
            for j in range(params.n):
                resp = [10 + (ids[0] + j) % 5] * ((ids[0] * 3 + j) % 7 + 1)
                out.append(Generation(i, ids, resp, "x" * len(resp), True))
        return out


def response_length_reward(prompts, completions, answers):
    return [float(len(c) % 3) for c in completions]


def rollout_sharing() -> dict:
    """The rollout every rank assembles and its advantages, against one process doing it all."""
    prompts = [Prompt([k], f"p{k}", None, f"d:{k}") for k in range(8)]
    # The reward process imports this file as a module (it is run as a script, __main__).
    fns = load_rewards(f"{'rl_equivalence' if __name__ == '__main__' else __name__}:response_length_reward", None)
    out = {}
    for algo in ("grpo", "reinforce_pp", "rloo"):
        cfg = load_config(RLConfig, None, ["train.global_batch_size=32", "train.micro_batch_size=4", f"algo.name={algo}",
                                            "algo.group_size=4"])
        samples, _ = collect_rollout(ScriptedGenerator(), prompts, fns, cfg, rollout=0)
        gens = ScriptedGenerator().generate([p.input_ids for p in prompts], SamplingParams(n=4))
        one = [Sample(g.prompt_ids, g.response_ids, float(len(g.text) % 3)) for g in gens]
        attach_advantages(samples, cfg)
        attach_advantages(one, cfg)
        local = [Sample(s.prompt_ids, s.response_ids, s.reward) for s in shard(one)]
        attach_advantages(local, cfg)
        everyone = gather([s.advantages for s in samples])
        out[algo] = {
            "same_rollout": [(s.prompt_ids, s.response_ids, s.reward) for s in samples] == [(s.prompt_ids, s.response_ids, s.reward) for s in one],
            "ranks_agree": all(all(torch.equal(a, b) for a, b in zip(adv, everyone[0])) for adv in everyone),
            "max_diff_vs_one_process": max(float((s.advantages - o.advantages).abs().max()) for s, o in zip(samples, one)),
            "max_diff_rank_local": max(float((s.advantages - o.advantages).abs().max()) for s, o in zip(local, shard(one))),
        }
    return out


def synced_generation(backend: str, tok) -> list[dict]:
    """Sampling with parameters sharded over two ranks, where rank 0's rows all end at their
    first token (EOS made certain there) and rank 1's run to the length limit: rank 0 must
    keep stepping with rank 1 (or both hang), and each rank's responses and log-probs must be
    those of the same model unsharded in one process, same seeds."""
    from exactrl.rollout.hf import HFEngine

    layout = ["distributed.backend=fsdp2"] if backend == "fsdp2" else ["distributed.backend=deepspeed", "deepspeed.zero_stage=3"]
    cfg = load_config(RLConfig, None, [*layout, "distributed.nproc_per_node=2", "train.global_batch_size=16", "train.micro_batch_size=4",
                                         "algo.group_size=4"])
    rank = dist.get_rank()
    prompts = [[tok.bos_token_id, 5 + rank, 7 + k] for k in range(3)]

    def run(model, engine_synced):
        if rank == 0:  # EOS certain everywhere on this rank only
            model.lm_head.register_forward_hook(lambda m, a, out: out.index_fill(-1, torch.tensor([tok.eos_token_id]), 1e4))
        gens = HFEngine(model, tok, batch_size=4, synced=engine_synced).generate(prompts, n=2, temperature=1.0, max_new_tokens=10)
        return [(g.response_ids, g.logprobs) for g in gens]

    sharded = fresh_policy(tok)
    engine = build_engine(sharded, cfg, total_steps=1)
    got = run(sharded, True)
    ref = run(fresh_policy(tok), False)
    mine = {"rank": rank, "shards": engine.shards_parameters, "lengths": [len(r) for r, _ in got],
            "same_tokens": [r for r, _ in got] == [r for r, _ in ref],
            "max_logprob_diff": max(max(abs(a - b) for a, b in zip(lg, lr)) for (_, lg), (_, lr) in zip(got, ref))}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def main(backend: str, world: int, out_path: str) -> None:
    tok = build_tokenizer()
    samples = make_rollout(tok)
    results = []
    for case in cases(backend):
        if case["loss"] in SFT_MIX:
            rollout = with_demonstrations(samples, tok)
        elif case["loss"] == "relift_sft":
            rollout = [Sample(s.prompt_ids, s.response_ids, source="demonstration") for s in samples]
        else:
            m = METHODS.get(case["loss"])  # a method's own terms, or a policy loss under grpo
            rollout = (sequence_advantages if case["loss"] == "gspo" else in_groups if m and m.demonstrations_in_group
                       else hinted if m and m.hinted else list)(samples)
        got = exactrl_run(case, rollout, tok, case["layout"])
        if not dist.is_initialized() or dist.get_rank() == 0:
            cfg = case_config(case, case["layout"])
            ref, init = reference(case, rollout, tok, dtype_of(cfg))
            results.append({**{k: v for k, v in case.items() if k != "layout"}, "config": " ".join(case["layout"]),
                            "K": 8 // (case["micro"] * world), "precision": precision(cfg),
                            "rel_err": relative_error(got, ref, init)})
    sharing = rollout_sharing()
    synced = synced_generation(backend, tok) if world == 2 else None
    if not dist.is_initialized() or dist.get_rank() == 0:
        json.dump({"cases": results, "sharing": sharing, "synced_generation": synced}, open(out_path, "w"))
    shutdown()
    end_rank()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
