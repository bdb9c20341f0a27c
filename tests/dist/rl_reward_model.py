"""reward.model's rewards on one scripted rollout, for tests/test_rl_reward_model.py (under torchrun for world
size 2, or as one process); writes one JSON result file on rank 0.

usage: python rl_reward_model.py RM_DIR OUT.json [OVERRIDE ...]

Each rank samples its share of the prompts (a scripted generator: no model decodes), the rollout is gathered,
and the frozen reward model worker scores it (exactrl/rollout/collect.py add_model_reward): the same path as a
run, GRPO's collect_rollout and DAPO's dynamic sampling. Written: every sample's ids, reward and parts.
"""

from __future__ import annotations

import json
import sys
import tempfile

import torch.distributed as dist

from exactrl.config import RLConfig, load_config
from exactrl.data.encode import Prompt
from exactrl.distributed.launch import end_rank, init_process_group, shutdown
from exactrl.rewards import load_rewards
from exactrl.rollout.collect import collect_dynamic_rollout, collect_rollout
from exactrl.rollout.generator import Generation, SamplingParams
from exactrl.tasks.tokenizer import build_tokenizer
from exactrl.workers.reward_model import model_reward
from exactrl.workers.worker import Worker

TOK = build_tokenizer()

ALGOS = ("grpo", "dapo")  # a plain rollout, and DAPO's dynamic sampling (rewards inside its refills)


class ScriptedGenerator:
    """Prompt k's j-th response: a few digits of varied length, ending with EOS (finished) or not (cut off)."""

    def generate(self, prompt_ids, params: SamplingParams, seeds=None):
        out = []
        for i, ids in enumerate(prompt_ids):
            for j in range(params.n):
                text = str((sum(ids) * 7 + j * 13) % 10 ** (1 + (len(ids) + j) % 5))
                finished = (j + len(ids)) % 3 != 0
                resp = TOK(text, add_special_tokens=False)["input_ids"] + ([TOK.eos_token_id] if finished else [])
                out.append(Generation(i, ids, resp, text, finished))
        return out


def rollouts(rm_dir: str, overrides: list[str]) -> dict:
    init_process_group()
    prompts = [Prompt(TOK(f"{k}+{k * 7}=")["input_ids"], f"{k}+{k * 7}=", str(8 * k), f"d:{k}") for k in range(6)]
    out = {}
    for algo in ALGOS:
        cfg = load_config(RLConfig, None, ["train.global_batch_size=24", "train.micro_batch_size=3",
                                           "algo.group_size=4", f"algo.name={algo}", f"reward.model={rm_dir}",
                                           *overrides])
        fns = load_rewards(cfg.reward.specs(), cfg.reward.weights)
        fns.model = model_reward(cfg.reward, TOK, cfg.train.micro_batch_size)
        fns.model.worker = Worker.build(cfg, "reward", rm_dir, run_dir=tempfile.mkdtemp(), phase="rl", longest=64,
                                        pad_id=TOK.pad_token_id)
        if algo == "grpo":
            samples, stats = collect_rollout(ScriptedGenerator(), prompts, fns, cfg, rollout=0)
        else:
            samples, stats = collect_dynamic_rollout(ScriptedGenerator(), prompts, list(range(len(prompts))), 0, fns,
                                                     cfg)
        fns.close()
        out[algo] = {"ids": [s.ids for s in samples], "rewards": [s.reward for s in samples],
                     "parts": [s.parts for s in samples], "stats": stats}
    return out


if __name__ == "__main__":
    result = rollouts(sys.argv[1], sys.argv[3:])
    if not dist.is_initialized() or dist.get_rank() == 0:
        json.dump(result, open(sys.argv[2], "w"))
    shutdown()
    end_rank()
