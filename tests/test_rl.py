"""The RL loop's pieces: the on-policy ratio check, weighted rewards, the policy loss
micro-batch path against a one-pass reference, advantages over a rollout, and every
algorithm run end to end."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from exactrl.algorithms.rl import AdaptiveKL, attach_advantages, train_rl
from exactrl.checks.on_policy import OnPolicyCheckError, on_policy_check
from exactrl.config import RLConfig, load_config
from exactrl.config.methods import names
from exactrl.data.batch import Sample
from exactrl.distributed.engine import build_engine
from exactrl.distributed.step_plan import plan_step
from exactrl.tasks.builtin import BuiltinSpec, ensure_builtin
from reward_fixtures import length, varied
from rl_helpers import attach_logprobs, consecutive, policy_micro_batch_loss

ROOT_EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def response_advantages(prompt, response, value: float) -> torch.Tensor:
    """One advantage on every response target, zero on the prompt's (as attach_advantages stores them)."""
    return torch.tensor([0.0] * (len(prompt) - 1) + [value] * len(response))


def make_samples(tokenizer, n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = tokenizer(f"{i}+{i * 7}=")["input_ids"]
        length = 2 + (i * 5) % 9  # uneven response lengths
        resp = torch.randint(7, 20, (length,), generator=g).tolist()
        out.append(Sample(prompt, resp, reward=float(i % 3 == 0), advantages=response_advantages(prompt, resp, float(
            i % 4) - 1.5)))
    return out


def rl_cfg(*overrides):
    return load_config(RLConfig, None, ["train.global_batch_size=8", "train.micro_batch_size=2", "algo.group_size=4",
                                         "optim.name=sgd", "optim.lr=0.5", "train.max_grad_norm=0", *overrides])


def run_first_update(model, tokenizer, samples, cfg):
    engine = build_engine(model, cfg, total_steps=10)
    attach_logprobs(model, samples, "old_logprobs", consecutive(len(samples), cfg.train.micro_batch_size),
                    tokenizer.pad_token_id,
                    cfg.rollout.temperature, contextlib.nullcontext)
    plan = plan_step([len(s.response_ids) for s in samples], cfg.train.micro_batch_size, cfg.train.loss_agg,
                     cfg.train.loss_agg_norm or cfg.rollout.max_new_tokens)
    devs = []
    engine.begin_step(len(plan.micro_batches))
    for mb in plan.micro_batches:
        loss, share, m = policy_micro_batch_loss(model, engine, [samples[i] for i in mb], plan.normalizer, cfg,
                                                 tokenizer.pad_token_id)
        engine.backward(loss, share, len(mb))
        devs.append(m["ratio_dev"])
    engine.step(plan)
    return max(devs), engine


def test_ratio_is_exactly_one_at_first_update_and_stale_logprobs_are_caught(tokenizer, make_model):
    model, cfg = make_model(1), rl_cfg()
    samples = make_samples(tokenizer)
    dev, engine = run_first_update(model, tokenizer, samples, cfg)
    assert dev == 0.0
    on_policy_check(cfg, rollout=0).verify(dev)
    # Reuse the old log-probs after the update (the DeepSpeed-Chat staleness): the check fires.
    plan = plan_step([len(s.response_ids) for s in samples], 2, "token-mean")
    _, _, m = policy_micro_batch_loss(model, engine, samples[:2], plan.normalizer, cfg, tokenizer.pad_token_id)
    assert m["ratio_dev"] > cfg.algo.ratio_tol
    with pytest.raises(OnPolicyCheckError, match="rollout 7"):
        on_policy_check(cfg, rollout=7).verify(m["ratio_dev"])
    with pytest.warns(UserWarning, match="on-policy check failed"):
        on_policy_check(rl_cfg("algo.ratio_check=warn"), rollout=7).verify(m["ratio_dev"])
    on_policy_check(rl_cfg("algo.ratio_check=off"), rollout=7).verify(m["ratio_dev"])


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("kl,ent", [(0.0, 0.0), (0.1, 0.0), (0.0, 0.05)], ids=["plain", "kl", "entropy-bonus"])
def test_policy_step_equals_one_pass_reference(tokenizer, make_model, mode, kl, ent):
    """The first GRPO update through micro-batches equals a hand-written one-pass gradient."""
    norm = ["train.loss_agg_norm=12"] if mode == "seq-mean-token-sum-norm" else []  # only that mode reads it
    cfg = rl_cfg(f"train.loss_agg={mode}", f"algo.kl_coef={kl}", f"algo.entropy_coef={ent}", *norm)
    samples = make_samples(tokenizer)
    model, ref_model = make_model(1), make_model(1)
    ref_policy = make_model(2)  # a different frozen reference for the KL term
    if kl:
        attach_logprobs(ref_policy, samples, "ref_logprobs", consecutive(len(samples), 2), tokenizer.pad_token_id, 1.0,
                        contextlib.nullcontext)
    before = [p.detach().clone() for p in model.parameters()]
    run_first_update(model, tokenizer, samples, cfg)

    # Reference: all 8 sequences in one forward, loss written out from the definitions.
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [tokenizer.pad_token_id] * (width - len(s)) for s in seqs])
    attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    logits = ref_model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    total = 0.0
    n_tokens = sum(len(s.response_ids) for s in samples)
    for b, s in enumerate(samples):
        sl = slice(len(s.prompt_ids) - 1, len(s.prompt_ids) - 1 + len(s.response_ids))
        lp = logp[b, sl]
        ratio = torch.exp(lp - lp.detach())  # old log-probs = current ones at the first update
        adv = float(s.advantages[-1])
        tok = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
        if kl:
            lr_ = s.ref_logprobs[sl] - lp
            tok = tok + kl * (torch.exp(lr_) - 1 - lr_)
        if ent:  # entropy of the next-token distribution, written out: -sum p log p
            probs = torch.softmax(logits[b, sl].float(), -1)
            tok = tok - ent * -(probs * torch.log(probs)).sum(-1)
        seq_sum, n = tok.sum(), len(s.response_ids)
        total = total + {"token-mean": seq_sum / n_tokens, "seq-mean-token-mean": seq_sum / n / 8,
                         "seq-mean-token-sum": seq_sum / 8, "seq-mean-token-sum-norm": seq_sum / (8 * 12)}[mode]
    total.backward()
    num = sum(((p0 - 0.5 * q.grad) - p).norm() ** 2 for p0, q, p in zip(before, ref_model.parameters(),
                                                                        model.parameters()))
    den = sum((0.5 * q.grad).norm() ** 2 for q in ref_model.parameters())
    assert (num / den).sqrt().item() <= 1e-5


def test_attach_advantages_puts_the_kl_in_the_reward_for_reinforce_pp(tokenizer):
    """REINFORCE++ with algo.kl_in_reward: r_t = -beta (log p_old - log p_ref) on every response
    token, the outcome reward on the last, return to go, whitened over every response token of
    the rollout -- computed here token by token."""
    samples = make_samples(tokenizer, n=6)
    g = torch.Generator().manual_seed(3)
    for s in samples:
        n = len(s.prompt_ids) + len(s.response_ids) - 1
        s.old_logprobs, s.ref_logprobs = -torch.rand(n, generator=g), -torch.rand(n, generator=g)
    cfg = rl_cfg("algo.name=reinforce_pp", "algo.group_size=1", "algo.kl_coef=0.1", "algo.kl_in_reward=true",
                 "train.global_batch_size=6", "train.micro_batch_size=3")
    attach_advantages(samples, cfg)
    returns = []
    for s in samples:
        start = len(s.prompt_ids) - 1
        r = [-0.1 * float(s.old_logprobs[start + i] - s.ref_logprobs[start + i]) for i in range(len(s.response_ids))]
        r[-1] += s.reward
        returns.append([sum(r[i:]) for i in range(len(r))])
    flat = [x for row in returns for x in row]
    mean = sum(flat) / len(flat)
    std = (sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)) ** 0.5
    for s, row in zip(samples, returns):
        start = len(s.prompt_ids) - 1
        assert torch.all(s.advantages[:start] == 0)
        assert s.advantages[start:].tolist() == pytest.approx([(x - mean) / (std + 1e-6) for x in row], rel=1e-5,
                                                              abs=1e-6)


@pytest.mark.parametrize("algo", names(demonstrations=False, policy_term=True))  # on_policy_distill: its own test
def test_every_algorithm_trains_end_to_end(algo, tmp_path, monkeypatch):
    monkeypatch.setenv("EXACTRL_CACHE", str(tmp_path / "cache"))
    cfg = load_config(RLConfig, None, ["data.eval=null", "train.global_batch_size=8", "train.micro_batch_size=4",
                                       "algo.group_size=4",
                                       "train.max_steps=2", "train.log_every=1", "rollout.max_new_tokens=8",
                                       "optim.lr=1e-3", f"algo.name={algo}",
                                       "algo.kl_coef=0.05", f"algo.kl_in_reward={algo.startswith('reinforce')}",
                                       "reward.fn=reward_fixtures:varied", f"output_dir={tmp_path / 'run'}"])
    result = train_rl(cfg, spec=BuiltinSpec(n_sft=20, n_rl=40, n_eval=10))
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(math.isfinite(r["loss"]) and r["canary"] == 1.0 for r in steps)
    assert ("kl" in steps[0]) == (not algo.startswith("reinforce"))  # in the loss unless it went into the reward
    before = load_file(ensure_builtin(BuiltinSpec(n_sft=20, n_rl=40, n_eval=10)).model / "model.safetensors")
    after = load_file(result.final_model / "model.safetensors")
    assert any(not before[k].equal(after[k]) for k in before)


def test_weighted_rewards_sum_and_each_component_is_logged(tmp_path, monkeypatch):
    from exactrl.rewards import load_rewards, score_all

    with load_rewards(["reward_fixtures:varied", "reward_fixtures:length"], [2.0, -0.5]) as fns:
        total, parts = score_all(fns, ["p", "p"], ["12ab", "x"], [None, None], ["s:1", "s:2"])
    a, b = varied(None, ["12ab", "x"], None), length(None, ["12ab", "x"], None)
    assert total == pytest.approx([2 * a[i] - 0.5 * b[i] for i in range(2)], rel=1e-12)
    assert parts == {"reward_fixtures:varied": a, "reward_fixtures:length": b}
    with pytest.raises(Exception, match="reward.weights has 1 entries for 2 reward.fn entries"):
        load_config(RLConfig, None, ["reward.fn=[reward_fixtures:varied,reward_fixtures:length]",
                                     "reward.weights=[1.0]"])
    monkeypatch.setenv("EXACTRL_CACHE", str(tmp_path / "cache"))
    cfg = load_config(RLConfig, None, ["data.eval=null", "train.global_batch_size=8", "train.micro_batch_size=4",
                                       "algo.group_size=4",
                                       "train.max_steps=1", "train.log_every=1", "rollout.max_new_tokens=8",
                                       "reward.fn=[reward_fixtures:varied,reward_fixtures:length]",
                                       "reward.weights=[1.0,0.1]",
                                       f"output_dir={tmp_path / 'run'}"])
    result = train_rl(cfg, spec=BuiltinSpec(n_sft=20, n_rl=40, n_eval=10))
    (row,) = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    mean = row["reward/reward_fixtures:varied"] + 0.1 * row["reward/reward_fixtures:length"]
    assert row["reward_mean"] == pytest.approx(mean, rel=1e-6)


def test_adaptive_kl_by_hand():
    samples = [Sample([1, 2], [3, 4], 0.0, old_logprobs=torch.tensor([0.0, -1.0, -2.0]), ref_logprobs=torch.tensor([
        5.0, -1.5, -2.5])),
               Sample([1], [3, 4, 5], 0.0, old_logprobs=torch.tensor([-1.0, -1.0, -1.0]),
                      ref_logprobs=torch.tensor([-1.0, -1.2, -1.4]))]
    # per-response KL sums over response targets only: (0.5 + 0.5) and (0 + 0.2 + 0.4) -> mean 0.8
    control = AdaptiveKL(0.1, target=2.0, horizon=10)
    assert control.update(samples) == pytest.approx(0.8)
    assert control.coef == pytest.approx(0.1 * (1 - 0.2 * 2 / 10))  # 0.8 / 2 - 1 = -0.6, clipped to -0.2
    control = AdaptiveKL(0.1, target=0.7, horizon=10)
    control.update(samples)
    assert control.coef == pytest.approx(0.1 * (1 + (0.8 / 0.7 - 1) * 2 / 10))
    fixed = AdaptiveKL(0.1, target=None, horizon=10)
    fixed.update(samples)
    assert fixed.coef == 0.1
    with pytest.raises(Exception,
                       match=r"algo.kl_target=0.1 has no effect: there is no KL term \(algo.kl_coef=0\); "
                             r"set a starting algo.kl_coef > 0"):
        load_config(RLConfig, None, ["algo.kl_target=0.1"])


def test_overlong_penalty_by_hand():
    from exactrl.rollout.collect import overlong_penalty

    assert [overlong_penalty(n, 48, 8, 0.5) for n in (10, 40, 44, 48)] == [0.0, 0.0, -0.25, -0.5]
    assert overlong_penalty(48, 48, 0, 1.0) == 0.0  # off


class ScriptedEngine:
    """Answers prompt k with k's text repeated, except on odd prompts where each response differs."""

    def generate(self, prompt_ids, params, seeds=None):
        from exactrl.rollout.generator import Generation

        out = []
        for i, ids in enumerate(prompt_ids):
            for j in range(params.n):
                text = f"{ids[0]}" + ("" if ids[0] % 2 == 0 else "x" * j)
                out.append(Generation(i, ids, [5] * len(text), text, True))
        return out


def test_dynamic_sampling_drops_flat_groups_and_refills_deterministically():
    from exactrl.data.encode import Prompt
    from exactrl.rewards import load_rewards
    from exactrl.rollout.collect import RolloutError, collect_dynamic_rollout

    prompts = [Prompt([k], f"p{k}", None, f"d:{k}") for k in range(20)]
    cfg = rl_cfg("algo.name=dapo", "algo.group_size=4", "train.global_batch_size=16", "train.micro_batch_size=4")
    fns = load_rewards("reward_fixtures:length_of_text")
    runs = [collect_dynamic_rollout(ScriptedEngine(), prompts, [0, 1, 2, 3], rollout=5, rewards_cfg=fns, cfg=cfg)
            for _ in range(2)]
    (samples, stats), (again, _) = runs
    assert len(samples) == 16 and all(s.prompt_ids[0] % 2 == 1 for s in samples)  # only groups with varied rewards
    assert [s.prompt_ids for s in samples] == [s.prompt_ids for s in again]  # the refill draw is reproducible
    assert stats["groups_dropped"] >= 2 and stats["refill_rounds"] >= 1
    even_only = [Prompt([2 * k], f"p{k}", None, f"d:{k}") for k in range(10)]
    with pytest.raises(RolloutError, match="kept 0 of 2 groups after algo.dapo.max_refill_rounds=1"):
        collect_dynamic_rollout(ScriptedEngine(), even_only, [0, 1], rollout=0, rewards_cfg=fns,
                                cfg=rl_cfg("algo.name=dapo", "algo.group_size=4", "algo.dapo.max_refill_rounds=1"))


def test_dynamic_sampling_reports_the_groups_it_trains_on():
    """Reward, accuracy and length describe the kept groups (the flat ones it dropped are not
    trained on); generated_tokens counts every response of every round."""
    from exactrl.data.encode import Prompt
    from exactrl.rewards import load_rewards
    from exactrl.rollout.collect import collect_dynamic_rollout

    class Counting(ScriptedEngine):
        tokens = 0

        def generate(self, prompt_ids, params, seeds=None):
            out = super().generate(prompt_ids, params, seeds)
            Counting.tokens += sum(len(g.response_ids) for g in out)
            return out

    prompts = [Prompt([k], f"p{k}", None, f"d:{k}") for k in range(20)]
    cfg = rl_cfg("algo.name=dapo", "algo.group_size=4", "train.global_batch_size=16", "train.micro_batch_size=4")
    samples, stats = collect_dynamic_rollout(Counting(), prompts, [0, 1, 2, 3], rollout=5,
                                             rewards_cfg=load_rewards("reward_fixtures:length_of_text"), cfg=cfg)
    assert stats["refill_rounds"] >= 1 and stats["groups_dropped"] >= 2
    lengths = [len(s.response_ids) for s in samples]
    assert stats["reward_mean"] == pytest.approx(sum(s.reward for s in samples) / len(samples))
    assert stats["response_length"] == pytest.approx(sum(lengths) / len(samples))
    assert stats["rollout_responses"] == len(samples) == 16
    assert stats["generated_tokens"] == Counting.tokens > sum(lengths)


def test_fragile_settings_warn_with_their_reason():
    from exactrl.algorithms.rl import fragile_settings

    assert fragile_settings(rl_cfg()) == []
    assert fragile_settings(load_config(RLConfig, ROOT_EXAMPLES / "ppo.yaml")) == []  # the examples are not fragile
    msgs = fragile_settings(rl_cfg("algo.ppo_epochs=2", "algo.ratio_check=off"))
    assert len(msgs) == 1 and "DeepSpeed-Chat" in msgs[0]
    assert "without bound" in fragile_settings(rl_cfg("algo.mini_batches=2", "algo.policy_loss=reinforce"))[0]
    assert "1-4" in fragile_settings(rl_cfg("algo.ppo_epochs=5"))[0]
    assert "length bias" in fragile_settings(rl_cfg("algo.name=dr_grpo"))[0]
    assert fragile_settings(rl_cfg("algo.name=dr_grpo", "train.loss_agg=seq-mean-token-sum-norm")) == []
    assert "3e-4" in fragile_settings(rl_cfg("algo.name=gspo"))[0]
