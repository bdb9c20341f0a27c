"""`exactrl eval` with env.*: greedy episodes on the untrained built-in model against tests/eval_envs.py:Codes
(2-3 turns, a reward per turn, a tool call counted on some turns, observations, all read from the turns' texts).
What the report says is recomputed here from samples.jsonl alone: each episode's reward (the environment's
rewards from the turns' texts plus the eval reward of the final turn), the accuracy, the tool-call rate and its
interval, and the observations' texts."""

from __future__ import annotations

import json
import math

import pytest

from exactrl.run.evaluation import pass_at_k, wilson_interval
from reward_fixtures import length
from test_cli_failures import exactrl, one_line_error

# length (len(final turn) / 10) is below 1 for turns of at most 8 tokens, and each of Codes' rewards is too: the
# accuracy moves with either part.
EPISODES = ["model.path=builtin", "data.eval_size=24", "eval.max_new_tokens=8", "eval.batch_size=8",
            "eval.reward_fn=reward_fixtures:length", "env.cls=eval_envs:Codes", "env.max_turns=3",
            "env.max_tokens=48"]


@pytest.fixture(scope="module")
def cache(cli_cache):
    return cli_cache


def code(text: str) -> int:
    """Codes' reading of a turn, written out again."""
    return sum(map(ord, text)) % 7


def env_rewards(turns: list[str]) -> list[float]:
    """Codes' reward per step, written out: the turn's code in eighths."""
    return [code(text) / 8 for text in turns]


def env_observations(turns: list[str]) -> list[str]:
    """What Codes answers after each turn but the last: the running sum of the codes, as a tool message's content
    (turn 0), as text (turn 1); turn 2 is the last of env.max_turns=3."""
    out, total = [], 0
    for t, text in enumerate(turns[:-1]):
        total += code(text)
        out.append([f"sum {total}", f" sum {total};"][t])
    return out


def test_episode_accuracy_and_tool_call_rate_are_the_episodes_recomputed(cache, tmp_path):
    proc = exactrl(["eval", *EPISODES, f"output_dir={tmp_path / 'ev'}"], tmp_path, cache)
    assert proc.returncode == 0, proc.stderr
    results = json.loads((tmp_path / "ev" / "results.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "ev" / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 24 and all(r["error"] is None and 2 <= len(r["turns"]) <= 3 for r in rows)
    finals = length([r["prompt"] for r in rows], [r["turns"][-1] for r in rows], None)
    totals = []
    for r, final in zip(rows, finals):
        assert len(r["turns"]) == 2 + code(r["turns"][0]) % 2
        env = env_rewards(r["turns"])
        assert r["env_rewards"] == pytest.approx(env, abs=1e-12) and r["final_reward"] == pytest.approx(final)
        assert r["observations"] == env_observations(r["turns"])
        totals.append(sum(env) + final)
    correct = sum(t >= 1.0 for t in totals)
    # both parts decide some episodes: neither alone gives the same count
    alone = sum(f >= 1.0 for f in finals), sum(sum(env_rewards(r["turns"])) >= 1.0 for r in rows)
    assert 0 < correct < 24 and correct not in alone
    g = results["greedy"]
    assert (g["correct"], g["accuracy"], g["ci95"]) == (correct, correct / 24, list(wilson_interval(correct, 24)))
    calls = sum(any(code(text) % 2 for text in r["turns"]) for r in rows)  # Codes counts an odd code a call
    env = results["env"]
    assert 0 < calls < 24
    assert (env["episodes_with_tool_call"], env["tool_call_rate"], env["tool_call_ci95"]) == (
        calls, calls / 24, list(wilson_interval(calls, 24)))
    assert env["mean_turns"] == sum(len(r["turns"]) for r in rows) / 24 and env["errors"] == 0
    low, high = env["tool_call_ci95"]
    shown = f"{100 * calls / 24:.1f}% [{100 * low:.1f}, {100 * high:.1f}]"
    assert shown in proc.stderr and shown in (tmp_path / "ev" / "report.md").read_text()


def test_pass_at_k_of_sampled_episodes(cache, tmp_path):
    """n seeded episodes per prompt: the estimator over the counts, and the counts do not depend on the batch."""
    got = []
    for batch in (8, 3):
        out = tmp_path / f"ev{batch}"
        proc = exactrl(["eval", *EPISODES, "data.eval_size=12", f"eval.batch_size={batch}", "pass_at_k.n=4",
                        "pass_at_k.k=[1,4]", "pass_at_k.temperature=1.5", f"output_dir={out}"], tmp_path, cache)
        assert proc.returncode == 0, proc.stderr
        counts = [json.loads(line)["correct_samples"] for line in (out / "samples.jsonl").read_text().splitlines()]
        got.append((counts, json.loads((out / "results.json").read_text())["pass_at_k"]))
    (counts, p), (counts3, p3) = got
    assert counts == counts3 and p == p3
    assert any(0 < c < 4 for c in counts)
    for k in (1, 4):
        want = sum(1 - math.comb(4 - c, k) / math.comb(4, k) for c in counts) / len(counts)
        assert p["k"][str(k)] == pytest.approx(want, rel=1e-12) == sum(pass_at_k(4, c, k) for c in counts) / 12


def test_episode_refusals_are_one_line(cache, tmp_path):
    line = one_line_error(exactrl(["eval", "model.path=builtin-sft", "task.name=calculator"], tmp_path, cache), 2)
    assert "task.name=calculator is a tool task" in line and "env.tools=exactrl.tasks.calculator_tools" in line, line
    assert "eval.max_new_tokens" in line, line
    line = one_line_error(exactrl(["eval", *EPISODES, "pass_at_k.n=2", "pass_at_k.preference=true"], tmp_path,
                                  cache), 2)
    assert "pass_at_k.preference with env.*" in line, line
    line = one_line_error(exactrl(["eval", f"model.path={tmp_path}", "data.eval=x.jsonl", "eval.reward_fn=a:b",
                                   "task.name=calculator"], tmp_path, cache), 2)
    assert "task.* chooses what" in line, line
    assert not list(tmp_path.glob("runs/*"))
