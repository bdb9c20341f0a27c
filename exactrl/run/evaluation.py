"""Held-out accuracy: generate for every eval prompt, score with the verifier, Wilson 95% CI.

Evaluation scores with the run's own reward: eval.reward_fn if set, else in `rl` the first
reward.fn (or reward.url), in `sft` the built-in task's checker. Its data is data.eval; at its
default ('auto') that is the built-in problems only when data.train is built-in too, and
nothing (with a notice) when you train on your own file."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from exactrl.data.encode import Prompt, load_prompts
from exactrl.distributed.launch import is_main
from exactrl.rewards import DEFAULT_TIMEOUT, Reward, Rewards, require_answers, score
from exactrl.rollout.generator import Generation, SamplingParams, prompt_seeds
from exactrl.rollout.hf import HFEngine


@dataclass(frozen=True)
class Accuracy:
    value: float
    ci95: tuple[float, float]
    correct: int
    n: int
    seconds: float
    generated_tokens: int
    reward_failures: int = 0  # answers the reward failed on, scored with reward.fallback instead
    extra: dict = field(default_factory=dict)  # further figures as metrics (episodes: eval_env/tool_call_rate, ...)

    def as_dict(self) -> dict:
        return {"value": self.value, "ci95": list(self.ci95), "correct": self.correct, "n": self.n}

    def __str__(self) -> str:
        return f"{100 * self.value:5.1f}% [{100 * self.ci95[0]:.1f}, {100 * self.ci95[1]:.1f}]"


def wilson_interval(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (well-behaved near 0 and 1)."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # At k = 0 or k = n the bound is exactly 0 or 1; rounding must not push it past p.
    low = 0.0 if k == 0 else max(0.0, centre - half)
    high = 1.0 if k == n else min(1.0, centre + half)
    return (low, high)


def evaluate_accuracy(generate: Callable, prompts: list[Prompt], reward: Reward, *, batch_size: int,
                      max_new_tokens: int, greedy: bool = True, temperature: float = 1.0, top_p: float = 1.0,
                      top_k: int = 0, stop: tuple[str, ...] = (), timeout: float = DEFAULT_TIMEOUT,
                      fallback: float | None = None, seed: int = 0, on_batch=None) -> Accuracy:
    """Share of prompts whose (greedy or sampled) answer gets full reward (>= 1) from ``reward``,
    decoded and scored ``batch_size`` prompts at a time, each call under the run's reward.timeout
    and reward.fallback. A sampled answer is keyed by ``seed`` and its prompt's position, so the
    batch size does not change it. ``on_batch(prompts, generations, rewards)`` after each batch.
    ``generate(prompt_ids, params, seeds)``: a generator's (e.g. HFEngine(model, tokenizer, batch_size).generate),
    or a worker's decoding where its model lives (greedy_accuracy)."""
    t0 = time.perf_counter()
    params = SamplingParams(greedy=greedy, temperature=temperature, top_p=top_p, top_k=top_k, stop=tuple(stop),
                            max_new_tokens=max_new_tokens)
    rewards, failures, tokens = [], [], 0
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        seeds = prompt_seeds("eval", seed, positions=range(i, i + len(chunk)))
        gens = generate([p.input_ids for p in chunk], params, seeds)
        values = score(reward, [p.text for p in chunk], [g.text for g in gens], [p.answer for p in chunk],
                       [p.source for p in chunk], timeout, fallback, failures)
        rewards += values
        tokens += sum(len(g.response_ids) for g in gens)
        if on_batch is not None:
            on_batch(chunk, gens, values)
    k = sum(r >= 1.0 for r in rewards)
    return Accuracy(k / len(prompts), wilson_interval(k, len(prompts)), k, len(prompts), time.perf_counter() - t0,
                    tokens, len(failures))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt from ``n`` samples of which ``c`` are correct (Chen et al.
    2021, "Evaluating Large Language Models Trained on Code", eq. 1): 1 - C(n-c, k) / C(n, k),
    the chance that k of the n samples drawn without replacement include a correct one."""
    if not (1 <= k <= n and 0 <= c <= n):
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n (n={n}, c={c}, k={k})")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)  # exact integers; one rounding in the division


def correct_samples(model, tokenizer, prompts: list[Prompt], reward: Reward, n: int, *, batch_size: int,
                    max_new_tokens: int, temperature: float, top_p: float, seed: int, timeout: float = DEFAULT_TIMEOUT,
                    on_batch=None, on_samples=None) -> list[int]:
    """How many of ``n`` sampled answers per prompt get full reward (>= 1), one count per prompt,
    about ``batch_size`` sequences decoded together; sample j of prompt i keyed by (``seed``, i, j),
    so the batch size does not change it. ``on_batch(prompts)`` after each batch; ``on_samples(prompt, [(text,
    reward)] * n)`` for each prompt, in order."""
    engine, counts = HFEngine(model, tokenizer, batch_size), []
    step = max(1, batch_size // n)
    for i in range(0, len(prompts), step):
        chunk = prompts[i : i + step]
        gens = engine.generate([p.input_ids for p in chunk], n=n, temperature=temperature, top_p=top_p,
                               max_new_tokens=max_new_tokens,  # each prompt's n samples together, in order
                               seeds=prompt_seeds("pass@k", seed, positions=range(i, i + len(chunk))))
        values = score(reward, [p.text for p in chunk for _ in range(n)], [g.text for g in gens],
                       [p.answer for p in chunk for _ in range(n)], [f"{p.source} sample {j}" for p in chunk
                                                                     for j in range(n)],
                       timeout)
        counts += [sum(v >= 1.0 for v in values[j * n : (j + 1) * n]) for j in range(len(chunk))]
        for j, p in enumerate(chunk if on_samples is not None else ()):
            on_samples(p, [(g.text, v) for g, v in zip(gens[j * n : (j + 1) * n], values[j * n : (j + 1) * n])])
        if on_batch is not None:
            on_batch(chunk)
    return counts


BUILTIN_CHECKER = "exactrl.tasks.arithmetic:reward"


@dataclass
class EvalSet:
    """Held-out prompts and the reward that scores them (``owned``: a reward process of its own, closed with it)."""

    prompts: list[Prompt]
    reward: Reward
    owned: Rewards | None = None
    episodes: object | None = None  # env.*'s episode runner (rollout/multiturn.py): answers are whole episodes

    def __len__(self) -> int:
        return len(self.prompts)

    def close(self) -> None:
        if self.owned is not None:
            self.owned.close()


def eval_data(cfg) -> str | None:
    """data.eval with 'auto' decided: the built-in problems for built-in training data, else none."""
    if cfg.data.eval != "auto":
        return cfg.data.eval
    return "builtin" if cfg.data.train == "builtin" else None


def no_eval_note(cfg) -> str | None:
    """What a run with data.eval left at 'auto' on data of the user's own says when it starts (RunContext): no
    evaluation. Said once everything is checked, so that it never precedes the error that stops a run."""
    if cfg.data.eval != "auto" or eval_data(cfg):
        return None
    return (f"note: no evaluation -- data.train={cfg.data.train} is your own data and data.eval is unset; set "
            "data.eval=FILE ({prompt, answer} rows) to measure accuracy, or data.eval=builtin for the built-in "
            "problems")


def eval_reward_spec(cfg) -> str:
    """The reward evaluation scores with: eval.reward_fn, else the run's first reward, else (sft)
    the built-in checker."""
    if cfg.eval.reward_fn:
        return cfg.eval.reward_fn
    return cfg.reward.specs()[0] if hasattr(cfg, "reward") else BUILTIN_CHECKER


def prompt_tools(cfg) -> list[dict] | None:
    """The tools' schemas an `rl` run with env.tools renders into its message prompts (as the model is told of
    them at inference), else None."""
    env = getattr(cfg, "env", None)
    if env is None or env.tools is None:
        return None
    from exactrl.envs.tools import schemas  # transformers' schema builder: only for a run with tools

    return schemas(env.tools)


def load_eval_set(cfg, tokenizer, eval_path: str | None, reward: Reward | None = None) -> EvalSet | None:
    """The first data.eval_size eval rows, each checked to carry the answer the reward needs.
    Without ``reward`` (sft), the eval reward gets a process of its own."""
    if not eval_path:
        return None
    prompts, note = load_prompts(eval_path, tokenizer, cfg.data, first=cfg.data.eval_size, tools=prompt_tools(cfg))
    if note and is_main():
        print(note)
    owned = None if reward is not None else Rewards(eval_reward_spec(cfg))
    reward = reward or owned.eval
    try:
        require_answers(prompts, [reward], "the evaluation reward")
    except Exception:
        if owned is not None:
            owned.close()
        raise
    return EvalSet(prompts, reward, owned)


def decode_with(model, tokenizer, batch_size: int, prompt_ids: list[list[int]], params: SamplingParams,
                seeds: list[int]) -> list[Generation]:
    """``model``'s answers through the decode loop, ``batch_size`` sequences at a time: module-level, so a
    worker runs it where its model lives (Worker.apply)."""
    return HFEngine(model, tokenizer, batch_size).generate(prompt_ids, params, seeds)


def greedy_accuracy(cfg, policy, tokenizer, eval_set: EvalSet) -> Accuracy:
    """Greedy accuracy of the ``policy`` worker on ``eval_set`` as the run's eval.* and reward.* say (rl: answers
    end at rollout.stop too), decoded where its model lives (on every rank) and scored here."""
    r, rollout = getattr(cfg, "reward", None), getattr(cfg, "rollout", None)
    decode = functools.partial(policy.apply, decode_with, tokenizer, cfg.eval.batch_size)
    if eval_set.episodes is not None:
        return episode_accuracy(decode, eval_set, batch_size=cfg.eval.batch_size,
                                max_new_tokens=cfg.eval.max_new_tokens, stop=tuple(rollout.stop),
                                timeout=r.timeout, fallback=r.fallback, reward_fn=cfg.env.reward_fn)
    return evaluate_accuracy(decode, eval_set.prompts, eval_set.reward, batch_size=cfg.eval.batch_size,
                             max_new_tokens=cfg.eval.max_new_tokens, stop=tuple(rollout.stop) if rollout else (),
                             timeout=r.timeout if r else DEFAULT_TIMEOUT,
                             fallback=r.fallback if r else None)


def score_episodes(reward: Reward, episodes: list, timeout: float, fallback: float | None, failures: list,
                   reward_fn: bool) -> tuple[list[float], list[float]]:
    """Each episode's final-turn score (``reward``'s, with ``reward_fn``; else 0) and its reward: its steps'
    rewards plus that score, 0 for an episode an error ended (as rollout/multiturn.py to_sample trains on it)."""
    ps = [e.prompt for e in episodes]
    finals = score(reward, [p.text for p in ps], [e.final_text for e in episodes], [p.answer for p in ps],
                   [p.source for p in ps], timeout, fallback, failures) if reward_fn else [0.0] * len(episodes)
    return finals, [0.0 if e.error else sum(e.rewards) + f for e, f in zip(episodes, finals)]


def episode_accuracy(generate: Callable, eval_set: EvalSet, *, batch_size: int, max_new_tokens: int,
                     stop: tuple[str, ...], timeout: float, fallback: float | None, reward_fn: bool,
                     on_batch=None) -> Accuracy:
    """Share of held-out prompts whose greedy episode (rollout/multiturn.py: every turn greedy, the environment
    answering) earns full reward (>= 1): its steps' rewards plus, with ``reward_fn``, the eval reward's score of
    its final turn. ``extra``: the episodes' env/* figures (tool-call rate, turns). ``on_batch(prompts, episodes,
    final scores, rewards)`` after each batch."""
    from exactrl.rollout.multiturn import episode_counts  # rollout imports run/ in its turn

    t0, runner = time.perf_counter(), eval_set.episodes
    params = SamplingParams(greedy=True, stop=stop, max_new_tokens=max_new_tokens)
    rewards, failures, tokens, counts = [], [], 0, {}
    for i in range(0, len(eval_set), batch_size):
        chunk = eval_set.prompts[i : i + batch_size]
        episodes = runner.run(generate, chunk, prompt_seeds("eval", positions=range(i, i + len(chunk))), params)
        finals, values = score_episodes(eval_set.reward, episodes, timeout, fallback, failures, reward_fn)
        rewards += values
        tokens += sum(len(t.ids) for e in episodes for t in e.turns)  # sampled, not observed
        for k, v in episode_counts(episodes).items():
            counts[k] = counts.get(k, 0) + v
        if on_batch is not None:
            on_batch(chunk, episodes, finals, values)
    k, n = sum(r >= 1.0 for r in rewards), len(eval_set)
    extra = {f"eval_{key}": v if key == "env/errors" else v / n for key, v in counts.items()}
    return Accuracy(k / n, wilson_interval(k, n), k, n, time.perf_counter() - t0, tokens, len(failures), extra)


def pairwise_accuracy(chosen: torch.Tensor, rejected: torch.Tensor, kinds: list[str | None] | None = None) -> dict:
    """Share of pairs whose chosen answer scores strictly above the rejected one (a tie counts as wrong), with
    its Wilson 95% interval, and the mean score margin; with ``kinds`` (each pair's kind, None: none), the same
    for each kind under "by_kind" (a style a scorer can tell apart is not a correctness it judges)."""
    k, n = int((chosen > rejected).sum()), chosen.numel()
    out = {"pairwise_accuracy": k / n, "ci95": list(wilson_interval(k, n)), "correct": k, "n": n,
           "mean_margin": float((chosen - rejected).mean())}
    named = sorted({kind for kind in kinds or () if kind is not None})
    if named:
        out["by_kind"] = {}
        for kind in named:
            idx = torch.tensor([i for i, x in enumerate(kinds) if x == kind])
            out["by_kind"][kind] = pairwise_accuracy(chosen[idx], rejected[idx])
    return out


def pairwise_report(out: dict, what: str = "") -> tuple[dict, list[str]]:
    """``out`` (pairwise_accuracy's) per kind as metrics (eval_pairwise_accuracy/KIND) and the printed lines: the
    whole, then each kind."""
    kinds = out.get("by_kind", {})
    lines = [f"held-out pairwise accuracy{what} on {v['n']} pairs{name} {100 * v['pairwise_accuracy']:.1f}% "
             f"[{100 * v['ci95'][0]:.1f}, {100 * v['ci95'][1]:.1f}]"
             for name, v in [("", out)] + [(f" of kind {k}", v) for k, v in kinds.items()]]
    return {f"eval_pairwise_accuracy/{k}": v["pairwise_accuracy"] for k, v in kinds.items()}, lines
