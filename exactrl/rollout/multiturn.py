"""Multi-turn rollouts, token in and token out: the policy samples a turn, the environment answers, again.

An episode is one token sequence: the prompt, then each policy turn's ids exactly as the generator sampled
them, then the ids the chat template closes that turn with where the policy did not sample them, then the
observation's ids (rendered once: exactrl/envs/render.py), and so on. Each token carries its origin
(policy / template / environment) and only policy tokens carry a loss mask, generator log-probs and counts in
the step's normaliser. Nothing the policy produced is decoded and re-encoded: the text an environment or a
reward reads is a view of the ids, never their source (re-tokenising "\\n"+"\\n" sampled as two tokens gives
one: prime-rl PR #1863; verl's docs on why re-applying the template broke PPO).

Seeds: turn t of an episode draws from a stream keyed by (its prompt's seed, its sample index, t) alone, so an
episode does not depend on which others share its batch or rank, or on when they end.
Budgets: env.max_turns policy turns; env.max_tokens after the prompt, a turn sampling at most
min(rollout.max_new_tokens, what is left) (cut after the fact: the ids kept are the ones the stream drew).
Rewards: each step's reward, summed, plus reward.fn's score of the final turn's text with env.reward_fn.
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass, field, replace

import torch

from exactrl.data.batch import Sample
from exactrl.envs.base import Action, EnvError
from exactrl.rollout.generator import Generation, SamplingParams, row_seed, turn_seed


@dataclass
class Turn:
    start: int  # where its sampled ids begin in Episode.ids
    generation: Generation  # as the generator returned it (its ids cut to the episode's budget are ``ids``)
    ids: list[int]
    text: str
    finished: bool


@dataclass
class Episode:
    prompt: object  # the Prompt it started from (data/encode.py)
    seed: int  # its stream's key: row_seed(prompt seed, sample)
    uid: int  # its id in the environment pool
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)  # everything after the prompt
    origin: list[str] = field(default_factory=list)  # per id: policy, template or environment
    logprobs: list[float] = field(default_factory=list)  # the generator's on policy ids, 0 elsewhere
    turns: list[Turn] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)  # each step's (None counted as 0)
    done: bool = False
    finished: bool = False  # ended by the environment (done), not by a budget or an error
    error: str | None = None
    tool_calls: int = 0
    tool_errors: int = 0

    def append(self, ids: list[int], origin: str | list[str], logprobs: list[float] | None = None) -> None:
        self.ids += ids
        self.origin += [origin] * len(ids) if isinstance(origin, str) else list(origin)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    @property
    def final_text(self) -> str:
        """The last policy turn's text: what reward.fn scores."""
        return self.turns[-1].text if self.turns else ""


class EpisodeRunner:
    """Runs episodes against one environment pool (envs/process.py, remote.py) with one renderer."""

    def __init__(self, pool, renderer, tokenizer, env_cfg):
        self.pool, self.renderer, self.tok, self.cfg = pool, renderer, tokenizer, env_cfg
        self._uids = itertools.count()
        self.first_error: str | None = None

    def close(self) -> None:
        self.pool.close()

    def _opening(self, prompt, opened) -> list[int]:
        if opened is None:
            return list(prompt.input_ids)
        if isinstance(opened, str):
            return self.tok.encode(opened, add_special_tokens=False)
        if opened and isinstance(opened[0], dict):
            tools = getattr(self.renderer, "tools", None)  # env.tools: told of them, as the data's prompts are
            return list(self.tok.apply_chat_template(opened, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False, **({"tools": tools} if tools else {})))
        return list(opened)

    def _fail(self, e: Episode, error: EnvError) -> None:
        if self.cfg.on_error == "stop":
            raise error
        if self.first_error is None:  # said once; env/errors counts them all
            self.first_error = str(error)
            warnings.warn(f"{error} (env.on_error=end: the episode ends with reward 0; later errors are counted in "
                          "env/errors)", UserWarning, stacklevel=2)
        e.done, e.error = True, str(error)

    def run(self, generate, prompts: list, seeds: list[int], params: SamplingParams) -> list[Episode]:
        """``params.n`` episodes per prompt (consecutive), prompt i's stream keyed by ``seeds[i]``."""
        episodes = [Episode(p, row_seed(seeds[i], j), next(self._uids), list(p.input_ids))
                    for i, p in enumerate(prompts) for j in range(params.n)]
        opened = self.pool.reset([(e.uid, row_of(e.prompt)) for e in episodes])
        for e, o in zip(episodes, opened):
            if isinstance(o, EnvError):
                self._fail(e, o)
            else:
                e.prompt_ids = self._opening(e.prompt, o)
        for turn in range(self.cfg.max_turns):
            live = [e for e in episodes if not e.done]
            if not live:
                break
            self._policy_turn(generate, live, params, turn)
            self._environment_turn(live, turn)
        self.pool.end([e.uid for e in episodes])
        return episodes

    def _policy_turn(self, generate, live: list[Episode], params: SamplingParams, turn: int) -> None:
        left = [self.cfg.max_tokens - len(e.ids) for e in live]
        cap = min(params.max_new_tokens, max(left))
        gens = generate([e.prompt_ids + e.ids for e in live], replace(params, n=1, max_new_tokens=cap),
                        [turn_seed(e.seed, turn) for e in live])
        for e, g, room in zip(live, gens, left):
            ids = g.response_ids[: min(cap, room)]
            cut = len(ids) < len(g.response_ids)
            text = self.tok.decode(ids, skip_special_tokens=True) if cut else g.text
            lp = [0.0] * len(ids) if g.logprobs is None else g.logprobs[: len(ids)]
            e.turns.append(Turn(len(e.ids), g, ids, text, g.finished and not cut))
            e.append(ids, "policy", lp)

    def _environment_turn(self, live: list[Episode], turn: int) -> None:
        results = self.pool.step([(e.uid, Action(list(t.ids), t.text, t.finished, turn))
                                  for e in live for t in e.turns[-1:]])
        last_turn = turn == self.cfg.max_turns - 1
        for e, r in zip(live, results):
            if isinstance(r, EnvError):
                self._fail(e, r)
                continue
            e.rewards.append(0.0 if r.reward is None else r.reward)
            e.tool_calls += int(r.info.get("tool_calls", 0))
            e.tool_errors += int(r.info.get("tool_errors", 0))
            if r.done:
                e.done = e.finished = True
                continue
            if last_turn or len(e.ids) >= self.cfg.max_tokens:
                e.done = True  # a budget ended it: not finished
                continue
            closing = self.renderer.close_turn(e.turns[-1].ids)
            try:
                obs_ids, obs_origin = self.renderer.observation(r.observation)
            except ValueError as err:  # a template that cannot render this observation (envs/render.py RenderError)
                self._fail(e, EnvError(f"episode {e.uid}, turn {turn}: its observation cannot be rendered: {err}"))
                continue
            if len(e.ids) + len(closing) + len(obs_ids) >= self.cfg.max_tokens:  # no room left for a turn after it
                e.done = True
                continue
            e.append(closing, "template")
            e.append(obs_ids, obs_origin)


def row_of(prompt) -> dict:
    """The data row an environment's reset reads: the prompt's text, answer and source, and its other columns."""
    return {**(prompt.columns or {}), "prompt": prompt.text, "answer": prompt.answer, "source": prompt.source}


def to_sample(e: Episode, final: float) -> Sample:
    """The episode as one training row: policy ids masked in, everything else masked out (origin kept); its
    reward the steps' rewards (each also kept on its turn, for the estimators that place it there) plus
    ``final`` (reward.fn's score of the final turn). An episode an error ended is worth 0."""
    head = len(e.prompt_ids) - 1
    versions = {t.generation.weights_version for t in e.turns}
    if len(versions) > 1:  # a rollout is sampled with one set of weights (rollout/schedule.py)
        raise RuntimeError(f"an episode's turns were sampled with weights versions {sorted(versions)}")
    g = e.turns[0].generation if e.turns else None
    turn_rewards = None if e.error else tuple(e.rewards) + (0.0,) * (len(e.turns) - len(e.rewards))
    reward = 0.0 if e.error else sum(turn_rewards) + final
    return Sample(e.prompt_ids, e.ids, reward, e.finished, {}, 0.0,
                  weights_version=g.weights_version if g else None, weights_digest=g.weights_digest if g else None,
                  mask=(0,) * head + tuple(int(o == "policy") for o in e.origin),
                  origin=("policy",) * head + tuple(e.origin),
                  turn_spans=tuple((head + t.start, head + t.start + len(t.ids)) for t in e.turns),
                  turn_rewards=turn_rewards,
                  # an episode that sampled nothing (its reset failed) has zeros, as a row beside sampled ones must
                  gen_logprobs=None if g and g.logprobs is None else torch.tensor([0.0] * head + e.logprobs))


# counts reported as totals over the rollout; the others are means per episode
SUMMED = ("env/errors", "env/retokenize_drift_turns")


def episode_counts(episodes: list[Episode]) -> dict:
    """What the episodes did, summed over them (collect.py merge_counts divides all but SUMMED by their number):
    turns, tool calls (tool_call_rate: episodes with one), errors, how they ended, tokens by origin."""
    count = {o: sum(e.origin.count(o) for e in episodes) for o in ("policy", "template", "environment")}
    return {"env/turns": sum(len(e.turns) for e in episodes),
            "env/tool_call_rate": sum(e.tool_calls > 0 for e in episodes),
            "env/tool_calls": sum(e.tool_calls for e in episodes),
            "env/tool_errors": sum(e.tool_errors for e in episodes),
            "env/errors": sum(e.error is not None for e in episodes),
            "env/finished": sum(e.finished for e in episodes),
            **{f"env/{o}_tokens": c for o, c in count.items()}}


def episode_runner(env_cfg, tokenizer, say=None) -> EpisodeRunner:
    """The run's episode runner: env.*'s environments in their pool, and observations rendered as env.render
    says ('template': the chat template, checked at start-up to extend a conversation append-only)."""
    from exactrl.checks.template import check_template
    from exactrl.envs import make_env_pool
    from exactrl.envs.render import ObservationRenderer

    mode = env_cfg.render or ("template" if getattr(tokenizer, "chat_template", None) else "text")
    pool = make_env_pool(env_cfg)
    tools = getattr(pool, "tools", None)  # env.tools: the template renders the conversation with their schemas
    try:
        if mode == "template":
            report = check_template(tokenizer, tools=tools)
            if not report.append_only and say is not None:
                say(f"note: {report.detail}")
        return EpisodeRunner(pool, ObservationRenderer(tokenizer, mode, tools=tools), tokenizer, env_cfg)
    except BaseException:
        pool.close()
        raise
