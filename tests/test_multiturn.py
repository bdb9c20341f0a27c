"""Multi-turn episodes, token in and token out (rollout/multiturn.py, checks/trajectory.py): the trained row is
the ids the generator sampled, turn by turn, with observations masked out of the loss; the per-rollout check
catches a row that is not; advantages step through policy tokens only."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from exactrl.advantages import AdvantageInput, get_advantage
from exactrl.algorithms.rl import attach_advantages
from exactrl.checks.trajectory import TrajectoryError, check_episodes
from exactrl.compute import FlopsCounter
from exactrl.config import RLConfig, load_config
from exactrl.data.encode import Prompt
from exactrl.envs.base import EnvError
from exactrl.envs.render import ObservationRenderer
from exactrl.rollout.collect import rollout_stats
from exactrl.rollout.generator import SamplingParams
from exactrl.rollout.hf import HFEngine
from exactrl.rollout.multiturn import EpisodeRunner, to_sample
from exactrl.tasks.tiny_model import build_tiny_model
from exactrl.tasks.tokenizer import build_tokenizer
from multiturn_fixtures import Echo, LocalPool, Scripted, env_cfg


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    return build_tiny_model(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, seed=0).eval()


def prompts(tok, n=3):
    return [Prompt(tok.apply_chat_template([{"role": "user", "content": f"{i}+{i}="}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False), f"{i}+{i}=", str(2 * i), f"row {i}")
            for i in range(n)]


def run(tok, model, make=Echo, mode="template", n=2, **kw):
    runner = EpisodeRunner(LocalPool(make), ObservationRenderer(tok, mode), tok, env_cfg(**kw))
    gen = HFEngine(model, tok, batch_size=16)
    ps = prompts(tok)
    eps = runner.run(gen.generate, ps, [11, 12, 13], SamplingParams(n=n, max_new_tokens=kw.get("turn_tokens", 6)))
    return runner, eps


def test_episode_rows_are_the_sampled_ids(tok, model):
    _, eps = run(tok, model)
    samples = [to_sample(e, 1.0) for e in eps]
    assert check_episodes(samples, eps, tok) == {"env/retokenize_drift_turns": 0}
    for s, e in zip(samples, eps):
        head = len(s.prompt_ids) - 1
        assert len(e.turns) == 3 and e.finished  # Echo ends the third turn
        assert s.reward == pytest.approx(3 * 0.5 + 1.0) and s.turn_rewards == (0.5, 0.5, 0.5)
        mask, origin = s.loss_mask, s.token_origins
        for (a, b), t in zip(s.turn_spans, e.turns):
            assert s.ids[a + 1 : b + 1] == t.generation.response_ids[: b - a]  # target t predicts ids[t + 1]
            assert list(t.generation.prompt_ids) == s.ids[: a + 1]  # each turn saw exactly the row before it
        policy = {t for a, b in s.turn_spans for t in range(a, b)}
        assert [t for t in range(s.num_targets) if mask[t]] == sorted(policy)
        # between turns: the template's tokens and the observation's, never in the loss
        between = [origin[t] for t in range(head, s.num_targets) if t not in policy]
        assert set(between) <= {"template", "environment"} and "environment" in between
        assert tok.decode([s.ids[t + 1] for t in range(head, s.num_targets) if origin[t] == "environment"]) == \
            "ok1ok2"
        assert all(float(s.gen_logprobs[t]) == 0.0 for t in range(s.num_targets) if t not in policy)


def test_same_episodes_whatever_the_batch(tok, model):
    """A turn's stream is keyed by (prompt seed, sample, turn): the episodes do not depend on what shares a batch."""
    _, together = run(tok, model)
    runner = EpisodeRunner(LocalPool(Echo), ObservationRenderer(tok, "template"), tok, env_cfg())
    gen = HFEngine(model, tok, batch_size=1)
    alone = runner.run(gen.generate, prompts(tok)[1:2], [12], SamplingParams(n=2, max_new_tokens=6))
    assert [e.ids for e in alone] == [e.ids for e in together[2:4]]


def test_budgets_end_episodes(tok, model):
    _, eps = run(tok, model, max_turns=2)
    assert all(len(e.turns) == 2 and not e.finished for e in eps)
    _, eps = run(tok, model, max_tokens=9, turn_tokens=6)
    assert all(len(e.ids) <= 9 and not e.finished for e in eps)
    check_episodes([to_sample(e, 0.0) for e in eps], eps, tok)


class Raises(Echo):
    def step(self, action):
        raise RuntimeError("broken tool")


def test_an_environment_error_ends_the_episode_at_reward_zero(tok, model):
    with pytest.warns(UserWarning, match="broken tool"):
        _, eps = run(tok, model, make=Raises)
    assert all(e.error and "broken tool" in e.error and len(e.turns) == 1 for e in eps)
    assert all(to_sample(e, 1.0).reward == 0.0 for e in eps)
    with pytest.raises(EnvError, match="broken tool"):
        run(tok, model, make=Raises, on_error="stop")


def merging_tokenizer():
    """A BPE whose encode merges what the model may sample apart: 'a' 'b' sampled as two ids encodes as 'ab'."""
    vocab = {"<pad>": 0, "<eos>": 1, "a": 2, "b": 3, "ab": 4, "o": 5, "k": 6, "1": 7, "2": 8, "3": 9}
    core = Tokenizer(models.BPE(vocab, merges=[("a", "b")]))
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


def test_trained_ids_are_the_sampled_ids_when_re_encoding_would_merge_them():
    tok = merging_tokenizer()
    assert tok.encode(tok.decode([2, 3]), add_special_tokens=False) == [4]  # the drift this path must not suffer
    gen = Scripted([[2, 3, 1], [2, 3, 3, 1]])
    runner = EpisodeRunner(LocalPool(Echo), ObservationRenderer(tok, "text"), tok, env_cfg())
    p = Prompt([5, 6], "ok", "x", "row 0")
    eps = runner.run(gen.generate, [p], [1], SamplingParams(n=1, max_new_tokens=8))
    s = to_sample(eps[0], 0.0)
    assert check_episodes([s], eps, tok)["env/retokenize_drift_turns"] == 3
    assert [s.ids[a + 1 : b + 1] for a, b in s.turn_spans] == [[2, 3, 1], [2, 3, 3, 1], [2, 3, 1]]
    # a row assembled from the text instead (decode -> encode: the bug this path exists to avoid) is caught by the
    # per-rollout check
    class ReEncoding(EpisodeRunner):
        def _policy_turn(self, generate, live, params, turn):
            super()._policy_turn(generate, live, params, turn)
            for e in live:
                t = e.turns[-1]
                del e.ids[t.start :], e.origin[t.start :], e.logprobs[t.start :]
                t.ids = tok.encode(tok.decode(t.ids, skip_special_tokens=False), add_special_tokens=False)
                e.append(t.ids, "policy", t.generation.logprobs[: len(t.ids)])

    eps = ReEncoding(LocalPool(Echo), ObservationRenderer(tok, "text"), tok, env_cfg()).run(
        Scripted([[2, 3, 1], [2, 3, 3, 1]]).generate, [p], [1], SamplingParams(n=1, max_new_tokens=8))
    with pytest.raises(TrajectoryError, match=r"turn 0's ids in the row \[4, 1\] are not the ids the generator "
                                              r"sampled \[2, 3, 1\]"):
        check_episodes([to_sample(eps[0], 0.0)], eps, tok)


def policy_steps(s) -> tuple[list[int], list[float]]:
    """An episode row's policy targets in order, and the reward at each: a turn's on its last target, the rest of
    the episode's (the final reward) on the last one."""
    steps = [t for a, b in s.turn_spans for t in range(a, b)]
    r = [0.0] * len(steps)
    for (_, b), tr in zip(s.turn_spans, s.turn_rewards):
        r[steps.index(b - 1)] += tr
    r[-1] += s.reward - sum(s.turn_rewards)
    return steps, r


def gae_over_policy_tokens(rewards_at, values, gamma, lam):
    """GAE written out over a list of (reward, value) policy steps (the reference: observations are skipped)."""
    adv, last = [0.0] * len(values), 0.0
    for t in reversed(range(len(values))):
        nxt = values[t + 1] if t + 1 < len(values) else 0.0
        delta = rewards_at[t] + gamma * nxt - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv


def test_gae_steps_through_policy_tokens_only(tok, model):
    cfg = load_config(RLConfig, None, ["algo.name=ppo", "algo.group_size=1", "algo.gamma=0.9", "algo.gae.lam=0.8",
                                       "train.global_batch_size=6", "train.micro_batch_size=2",
                                       "algo.gae.whiten_advantages=false"])
    _, eps = run(tok, model)
    samples = [to_sample(e, 1.0) for e in eps]
    g = torch.Generator().manual_seed(0)
    for s in samples:
        s.old_values = torch.randn(s.num_targets, generator=g)
    attach_advantages(samples, cfg)
    for s in samples:
        steps, r = policy_steps(s)
        want = gae_over_policy_tokens(r, [float(s.old_values[t]) for t in steps], 0.9, 0.8)
        assert torch.allclose(s.advantages[steps].double(), torch.tensor(want, dtype=torch.float64), atol=1e-6)
        assert not s.advantages[[t for t in range(s.num_targets) if t not in steps]].any()


def test_outcome_estimators_see_the_episode_reward(tok, model):
    """GRPO's score of an episode is its whole reward (turn rewards and the final one)."""
    cfg = load_config(RLConfig, None, ["algo.name=grpo", "algo.group_size=2", "train.global_batch_size=6",
                                       "train.micro_batch_size=2"])
    _, eps = run(tok, model)
    samples = [to_sample(e, float(i % 2)) for i, e in enumerate(eps)]
    attach_advantages(samples, cfg)
    adv = get_advantage("grpo")(AdvantageInput(torch.tensor([s.reward for s in samples], dtype=torch.float64),
                                               torch.ones(len(samples), 1, dtype=torch.float64), 2))[0][:, 0]
    for s, a in zip(samples, adv):
        first = s.turn_spans[0][0]
        assert float(s.advantages[first]) == pytest.approx(float(a), abs=1e-6)


def test_figures_count_what_the_generator_did(tok, model):
    """generated_tokens counts the sampled turns only; the FLOPs counter every token each turn's request ran through
    the model (the episode so far, prefilled again, and the turn), re-counted here from the generator's requests."""
    _, eps = run(tok, model)
    samples = [to_sample(e, 0.0) for e in eps]
    for s in samples:
        s.parts = {"env": s.reward}
    cfg = load_config(RLConfig, None, ["algo.group_size=2", "train.global_batch_size=6", "train.micro_batch_size=2"])
    stats = rollout_stats(samples, 0, cfg)
    assert stats["generated_tokens"] == sum(len(t.ids) for e in eps for t in e.turns)
    flops = FlopsCounter(1)
    flops.generated(samples)
    assert flops.generated_tokens == sum(len(t.generation.prompt_ids) + len(t.ids) for e in eps for t in e.turns)


def test_reinforce_pp_whitens_over_policy_tokens_only(tok, model):
    """REINFORCE++'s return to go runs through an episode's policy tokens (a turn's reward on its last one, the
    final reward on the last policy token) and its whitening counts policy tokens alone: written out here."""
    cfg = load_config(RLConfig, None, ["algo.name=reinforce_pp", "algo.group_size=1", "algo.gamma=0.9",
                                       "train.global_batch_size=6", "train.micro_batch_size=2"])
    _, eps = run(tok, model)
    samples = [to_sample(e, float(i % 2)) for i, e in enumerate(eps)]
    attach_advantages(samples, cfg)
    returns, where = [], []
    for s in samples:
        steps, r = policy_steps(s)
        g = 0.0
        for t in reversed(range(len(steps))):
            g = r[t] + 0.9 * g
            returns.append(g)
            where.append((s, steps[t]))
    x = torch.tensor(returns, dtype=torch.float64)
    want = (x - x.mean()) / (x.std() + 1e-6)
    got = torch.tensor([float(s.advantages[t]) for s, t in where], dtype=torch.float64)
    assert torch.allclose(got, want, atol=1e-5)


def _re_rendered_prefix(s, e):  # turn 1 asked with a history other than the row's (a re-rendered conversation)
    g = e.turns[1].generation
    e.turns[1].generation = replace(g, prompt_ids=g.prompt_ids[:-2] + [g.prompt_ids[-1]])


def _observation_in_the_loss(s, e):
    first_obs = s.origin.index("environment")
    s.mask = s.mask[:first_obs] + (1,) + s.mask[first_obs + 1 :]


def _log_probs_one_off(s, e):
    s.gen_logprobs = torch.roll(s.gen_logprobs, 1)


@pytest.mark.parametrize("tamper, message", [
    (_re_rendered_prefix, "turn 1 was sampled from .* ids that differ from the row's"),
    (_observation_in_the_loss, "target [0-9]+ has loss mask 1 but was not sampled"),
    (_log_probs_one_off, "turn 0.s generator log-probs are not the ones it reported"),
])
def test_the_trajectory_check_catches_a_row_that_is_not_the_episode(tok, model, tamper, message):
    _, eps = run(tok, model)
    samples = [to_sample(e, 0.0) for e in eps]
    tamper(samples[1], eps[1])
    with pytest.raises(TrajectoryError, match="episode 1 of this rank's rollout: " + message):
        check_episodes(samples, eps, tok)
