"""`exactrl eval` with env.*: each held-out prompt answered by a greedy episode (rollout/multiturn.py: the policy
turns greedy, the environment answering between them) and scored as `exactrl rl` scores its evaluation episodes
(run/evaluation.py episode_accuracy: the steps' rewards plus, with env.reward_fn, the eval reward's score of the
final turn), so the two agree on the same model and settings. Beside the accuracy: the tool-call rate (episodes
with a call / all) with its Wilson interval, and the episodes' other env/* figures. pass@k draws
pass_at_k.n sampled episodes per prompt, episode j of prompt i keyed by (pass_at_k.seed, i, j).

samples.jsonl holds each greedy episode: the prompt, each turn's text, each observation's text (the environment's
tokens between two turns, decoded), the environment's reward per step, the final turn's score and the reward.
"""

from __future__ import annotations

import json
from pathlib import Path

from exactrl.progress import progress
from exactrl.rewards import DEFAULT_TIMEOUT
from exactrl.rollout.generator import SamplingParams, prompt_seeds
from exactrl.rollout.hf import HFEngine
from exactrl.rollout.multiturn import Episode, episode_counts
from exactrl.run.evaluation import episode_accuracy, pass_at_k, score_episodes, wilson_interval


def episode_row(e: Episode, tokenizer, final: float, reward: float) -> dict:
    """One greedy episode as samples.jsonl holds it."""
    ends = [t.start + len(t.ids) for t in e.turns]
    gaps = zip(ends, [t.start for t in e.turns[1:]])  # an observation is followed by a turn (multiturn.py)
    observations = [tokenizer.decode([i for i, o in zip(e.ids[a:b], e.origin[a:b]) if o == "environment"])
                    for a, b in gaps]
    return {"prompt": e.prompt.text, "answer": e.prompt.answer, "turns": [t.text for t in e.turns],
            "observations": observations, "env_rewards": list(e.rewards), "final_reward": final, "reward": reward,
            "tool_calls": e.tool_calls, "tool_errors": e.tool_errors, "finished": e.finished, "error": e.error}


def measure_episodes(cfg, model, tok, eval_set, run_dir: Path) -> dict:
    e, pk, env = cfg.eval, cfg.pass_at_k, cfg.env
    engine = HFEngine(model, tok, e.batch_size)
    rows, counts = [], {}
    bar = progress(len(eval_set), "eval greedy episodes", unit="prompt")

    def greedy_batch(chunk, episodes, finals, values):
        rows.extend(episode_row(ep, tok, f, v) for ep, f, v in zip(episodes, finals, values))
        for k, v in episode_counts(episodes).items():
            counts[k] = counts.get(k, 0) + v
        bar.update(len(chunk))

    acc = episode_accuracy(engine.generate, eval_set, batch_size=e.batch_size, max_new_tokens=e.max_new_tokens,
                           stop=(), timeout=DEFAULT_TIMEOUT, fallback=None, reward_fn=env.reward_fn,
                           on_batch=greedy_batch)
    bar.close()
    n, calls = acc.n, counts["env/tool_call_rate"]  # episodes with at least one call
    results = {"prompts": n, "greedy": {"accuracy": acc.value, "ci95": list(acc.ci95), "correct": acc.correct,
                                        "max_new_tokens": e.max_new_tokens, "seconds": round(acc.seconds, 3)},
               "env": {"source": env.tools or env.cls or env.url, "max_turns": env.max_turns,
                       "max_tokens": env.max_tokens, "reward_fn": env.reward_fn,
                       "tool_call_rate": calls / n, "tool_call_ci95": list(wilson_interval(calls, n)),
                       "episodes_with_tool_call": calls, "mean_turns": counts["env/turns"] / n,
                       "tool_calls": counts["env/tool_calls"], "tool_errors": counts["env/tool_errors"],
                       "errors": counts["env/errors"], "finished": counts["env/finished"],
                       **{f"mean_{o}_tokens": counts[f"env/{o}_tokens"] / n
                          for o in ("policy", "template", "environment")}},
               "pass_at_k": None}
    if pk.n:
        bar = progress(len(eval_set), f"eval {pk.n} sampled episodes", unit="prompt")
        correct = correct_episodes(engine.generate, eval_set, pk, e.batch_size, e.max_new_tokens, env.reward_fn,
                                   on_batch=lambda chunk: bar.update(len(chunk)))
        bar.close()
        for row, c in zip(rows, correct):
            row["correct_samples"] = c
        results["pass_at_k"] = {"n": pk.n, "temperature": pk.temperature, "top_p": pk.top_p, "seed": pk.seed,
                                "k": {str(k): sum(pass_at_k(pk.n, c, k) for c in correct) / n
                                      for k in sorted(set(pk.k))}}
    with open(run_dir / "samples.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return results


def correct_episodes(generate, eval_set, pk, batch_size: int, max_new_tokens: int, reward_fn: bool,
                     on_batch=None) -> list[int]:
    """How many of pk.n sampled episodes per prompt earn full reward (>= 1), one count per prompt; about
    ``batch_size`` episodes run together, prompt i's episodes keyed by (pk.seed, i), so the batch size does not
    change them."""
    params = SamplingParams(n=pk.n, temperature=pk.temperature, top_p=pk.top_p, max_new_tokens=max_new_tokens)
    step, counts, failures = max(1, batch_size // pk.n), [], []
    for i in range(0, len(eval_set), step):
        chunk = eval_set.prompts[i : i + step]
        episodes = eval_set.episodes.run(generate, chunk, prompt_seeds("pass@k", pk.seed,
                                                                       positions=range(i, i + len(chunk))), params)
        _, values = score_episodes(eval_set.reward, episodes, DEFAULT_TIMEOUT, None, failures, reward_fn)
        counts += [sum(v >= 1.0 for v in values[j * pk.n : (j + 1) * pk.n]) for j in range(len(chunk))]
        if on_batch is not None:
            on_batch(chunk)
    return counts


def episode_figures(results: dict) -> list[tuple[str, str]]:
    """The report's rows for episodes: accuracy and tool-call rate with their intervals, the other env/* figures."""
    g, env, n = results["greedy"], results["env"], results["prompts"]
    low, high = env["tool_call_ci95"]
    out = [("greedy episode accuracy [95% CI]",
            f"{100 * g['accuracy']:.1f}% [{100 * g['ci95'][0]:.1f}, {100 * g['ci95'][1]:.1f}]"),
           ("correct / episodes", f"{g['correct']} / {n}"),
           ("tool-call rate [95% CI]", f"{100 * env['tool_call_rate']:.1f}% [{100 * low:.1f}, {100 * high:.1f}]"),
           ("episodes with a tool call", f"{env['episodes_with_tool_call']} / {n}"),
           ("mean turns", f"{env['mean_turns']:.2f}"),
           ("tool calls / tool errors", f"{env['tool_calls']} / {env['tool_errors']}"),
           ("episodes ended by the environment / by an error", f"{env['finished']} / {env['errors']}"),
           ("mean policy / environment tokens", f"{env['mean_policy_tokens']:.1f} / "
                                                f"{env['mean_environment_tokens']:.1f}")]
    p = results["pass_at_k"]
    if p:
        out += [(f"pass@{k} of episodes (n={p['n']}, T={p['temperature']:g}, top_p={p['top_p']:g})",
                 f"{100 * v:.1f}%") for k, v in p["k"].items()]
    return out
