"""The rollout of LUFFY's and SRFT's groups (exactrl/rollout/mixed.py): per prompt, the policy's
group_size - m samples then m copies of its demonstration, scored by the same reward."""

from __future__ import annotations

import torch

from exactrl.config import RLConfig, load_config
from exactrl.data.encode import Prompt
from exactrl.rewards import load_rewards
from exactrl.rollout.generator import Generation
from exactrl.rollout.mixed import mixed_rollout


class Scripted:
    """Prompt k's j-th response is j + 1 tokens (never a right answer)."""

    weights_version = 0

    def __init__(self, tok):
        self.tok = tok

    def generate(self, prompt_ids, params, seeds=None):
        return [Generation(i, ids, [5] * (j + 1), "5" * (j + 1), True, [-0.5] * (j + 1))
                for i, ids in enumerate(prompt_ids) for j in range(params.n)]


def test_groups_hold_the_policys_samples_then_the_demonstrations(tokenizer):
    demo = tokenizer("#### 4", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    # the demonstration is right for the prompt whose answer is 4, wrong for the other
    prompts = [Prompt([1, 7 + k], f"p{k}", answer, f"rows:{k + 1}", demo) for k, answer in enumerate(("4", "7"))]
    cfg = load_config(RLConfig, None, ["algo.name=luffy", "algo.group_size=5", "algo.luffy.demonstrations=2",
                                       "train.global_batch_size=10", "train.micro_batch_size=5"])
    with load_rewards("exactrl.tasks.arithmetic:reward") as fns:
        samples, stats = mixed_rollout(Scripted(tokenizer), prompts, [1, 0], 0, fns, cfg)
    assert [s.source for s in samples] == (["on_policy"] * 3 + ["demonstration"] * 2) * 2
    assert [s.prompt_ids for s in samples] == [[1, 8]] * 5 + [[1, 7]] * 5  # groups in the drawn order
    assert [len(s.response_ids) for s in samples] == [1, 2, 3, len(demo), len(demo)] * 2
    assert [s.reward for s in samples] == [0.0] * 5 + [0.0] * 3 + [1.0] * 2  # scored like any response
    demos = [s for s in samples if s.source == "demonstration"]
    assert demos[0] is not demos[1] and all(s.response_ids == demo for s in demos)
    assert all(torch.equal(s.gen_logprobs, torch.zeros(len(s.ids) - 1)) for s in demos)  # behaviour probability 1
    assert (stats["rollout_prompts"], stats["rollout_responses"], stats["demo_reward_mean"]) == (2, 6, 0.5)
