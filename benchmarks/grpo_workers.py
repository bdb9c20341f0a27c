"""One measured GRPO run of exactrl or of TRL, for benchmarks/bench.py and gpu_bench.py; prints one JSON line.

usage: python grpo_workers.py {exactrl,trl} MODEL_DIR PROMPTS.jsonl PROMPTS_PER_STEP GROUP MAX_NEW STEPS THREADS OUT_DIR
                              [OPTIONS_JSON]

Both sides, from the same initial model and the same {prompt, answer} rows (the built-in
task's RL prompts, the prompt text passed as is): PROMPTS_PER_STEP prompts x GROUP sampled
responses per optimizer step, one generation batch per step (HF ``generate``, KV cache, all
PROMPTS_PER_STEP x GROUP sequences in one call), at most MAX_NEW new tokens, temperature 1,
top_p 1, no top_k; reward = the built-in verifier (exactrl/tasks/arithmetic.py's ``reward``,
loaded from its file, which needs only the stdlib); KL coefficient 0 (no reference model);
one PPO-clip update per rollout (clip 0.2, advantages normalised by the group's std, token-
mean loss over the whole batch = TRL's loss_type="dapo"); micro-batch = batch; AdamW lr 1e-6
constant, clip 1.0; fp32, no gradient checkpointing. STEPS + 1 optimizer steps run; the first
is a warm-up: the time is measured from the end of step 1 to the end of the last step (each end
stamped after a device sync by a global optimizer-step hook, the same on both sides).
Options (worker_common.OPTIONS): ``dtype`` (bf16: autocast over the fp32 weights), ``device``,
``max_length`` (exactrl's data.max_length), ``lr`` (1e-6), ``exactrl_set`` (exactrl's side only)
and ``reward``: "arithmetic" (the verifier, default) or "text" (a fixed pseudo-random score of the
completion's text, for rows that have no answer: gpu_bench.py's random prompts).

Not the same, by design of each system (the measured time includes them):
* both take the old log-probs from the update's own forward (one update per rollout);
  exactrl also compares them with the log-probs its generator recorded while sampling (its
  on-policy check, exactrl/algorithms/rl.py: reuses_first_forward);
* TRL computes log-probs with transformers' fused lm-head loss, exactrl from full logits;
* each side draws prompts from the same rows in its own seeded shuffle (the built-in prompts
  all have the same length, so only which problems are drawn differs).

Checked and reported, not assumed: optimizer steps taken (a global torch optimizer-step hook),
completions per step and responses per distinct prompt (seen by the reward function), and
the generated tokens (EOS included) of the timed steps. Runs under .venv (exactrl) or
.venv-bench (TRL) and imports only its side's libraries.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import zlib
from collections import Counter
from pathlib import Path

from worker_common import Device, count_optimizer_steps, options, run


def load_verifier():
    """exactrl/tasks/arithmetic.py by its path: stdlib only, so TRL's side needs no exactrl package."""
    spec = importlib.util.spec_from_file_location("bench_arithmetic",
                                                  Path(__file__).resolve().parents[1] / "exactrl/tasks/arithmetic.py")
    # its dataclasses look their module up there
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


arithmetic = load_verifier()

CALLS: list[dict] = []  # one per reward call, i.e. per generation batch


def text_reward(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """A score in [0, 1] fixed by the completion's text: random rows have no right answer, and a group's
    rewards must still differ, so that its advantages (and the update) are not all zero, alike on both sides."""
    return [zlib.crc32(c.encode()) % 1000 / 999 for c in completions]


REWARDS = {"arithmetic": lambda *a: arithmetic.reward(*a), "text": text_reward}


def scored(prompts: list[str], answers: list[str], completions: list[str],
           lengths: list[int] | None = None) -> list[float]:
    rewards = REWARDS[os.environ.get("EXACTRL_BENCH_REWARD", "arithmetic")](prompts, completions, answers)
    CALLS.append({"completions": len(completions), "per_prompt": sorted(set(Counter(prompts).values())),
                  "prompts": len(set(prompts)), "lengths": lengths, "reward": sum(rewards) / len(rewards)})
    return rewards


def exactrl_reward(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """exactrl calls rewards in a process of its own: what each call saw goes back through a file."""
    rewards = scored(prompts, answers, completions)
    with open(os.environ["EXACTRL_BENCH_CALLS"], "a") as f:
        f.write(json.dumps(CALLS.pop()) + "\n")
    return rewards


def trl_reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]], answer: list[str],
               **_) -> list[float]:
    return scored(prompts, answer, completions, [len(ids) for ids in completion_ids])


def summary(step_ends: list[float], gen_tokens: list[int], responses: list[int], optimizer_steps: int,
            trainer_steps: int) -> dict:
    """Figures over the timed steps 2..N+1, from per-step end times, generated tokens and responses."""
    seconds = step_ends[-1] - step_ends[0]
    timed = len(step_ends) - 1
    tokens = sum(gen_tokens[1:])
    return {"optimizer_steps": optimizer_steps, "trainer_steps": trainer_steps, "timed_steps": timed,
            "seconds": seconds,
            "steps_per_s": timed / seconds, "gen_tokens": tokens, "gen_tokens_per_s": tokens / seconds,
            "mean_completion_len": tokens / sum(responses[1:]), "reward_calls": len(CALLS),
            "completions_per_step": sorted({c["completions"] for c in CALLS}), "prompts_per_step": sorted({c[
                "prompts"] for c in CALLS}),
            "responses_per_prompt": sorted({n for c in CALLS for n in c["per_prompt"]}),
            "reward_mean": sum(c["reward"] for c in CALLS) / len(CALLS)}


def run_exactrl(model_dir: str, data: str, prompts: int, group: int, max_new: int, steps: int, out: str,
                opt: dict) -> dict:
    from exactrl.algorithms.rl import train_rl
    from exactrl.config import RLConfig, load_config

    batch = prompts * group
    # The reward is this file's wrapper of the verifier, imported by module name in exactrl's reward process
    # (which inherits this environment).
    calls = Path(out) / "reward_calls.jsonl"
    os.environ["EXACTRL_BENCH_CALLS"] = str(calls)
    cfg = load_config(RLConfig, None, [f"model.path={model_dir}", f"data.train={data}", "data.eval=null",
                                       f"data.max_length={opt['max_length']}", f"model.dtype={opt['dtype']}",
                                       f"distributed.device={opt['device']}",
                                       "algo.name=grpo",
                                       f"algo.group_size={group}", "algo.kl_coef=0.0", "algo.clip_eps=0.2",
                                       "algo.ppo_epochs=1",
                                       "algo.mini_batches=1", f"train.global_batch_size={batch}",
                                       f"train.micro_batch_size={batch}",
                                       f"train.max_steps={steps + 1}", "train.max_grad_norm=1.0",
                                       "train.loss_agg=token-mean",
                                       "train.log_every=1", "optim.name=adamw", f"optim.lr={opt.get('lr', 1e-6)}",
                                       "optim.weight_decay=0.0",
                                       "optim.scheduler=constant", "optim.warmup_steps=0",
                                       f"rollout.max_new_tokens={max_new}",
                                       "rollout.temperature=1.0", "rollout.top_p=1.0", f"rollout.batch_size={batch}",
                                       "reward.fn=grpo_workers:exactrl_reward", f"output_dir={out}",
                                       *opt["exactrl_set"]])
    counter = count_optimizer_steps(Device(opt["device"]))
    result = train_rl(cfg)
    CALLS.extend(json.loads(line) for line in calls.read_text().splitlines())
    lines = [json.loads(ln) for ln in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    per_step = [r for r in lines if "generated_tokens" in r]
    return summary(counter["times"], [r["generated_tokens"] for r in per_step],
                   [r["rollout_responses"] for r in per_step], counter["steps"], result.steps)


def run_trl(model_dir: str, data: str, prompts: int, group: int, max_new: int, steps: int, out: str,
            opt: dict) -> dict:
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    ds = load_dataset("json", data_files=data, split="train")
    args = GRPOConfig(output_dir=out, per_device_train_batch_size=prompts * group, gradient_accumulation_steps=1,
                      steps_per_generation=1, num_iterations=1, num_generations=group, max_completion_length=max_new,
                      temperature=1.0, top_p=1.0, top_k=0, beta=0.0, epsilon=0.2, loss_type="dapo",
                      scale_rewards="group",
                      use_vllm=False, max_steps=steps + 1, learning_rate=opt.get("lr", 1e-6),
                      lr_scheduler_type="constant", warmup_steps=0,
                      max_grad_norm=1.0, weight_decay=0.0, bf16=opt["dtype"] == "bf16", fp16=False,
                      gradient_checkpointing=False, use_cpu=opt["device"] == "cpu",
                      report_to=[], save_strategy="no", eval_strategy="no", logging_steps=1000000,
                      dataloader_num_workers=0,
                      seed=0, disable_tqdm=True)
    counter = count_optimizer_steps(Device(opt["device"]))
    trainer = GRPOTrainer(model=model, args=args, reward_funcs=trl_reward, train_dataset=ds, processing_class=tok)
    trainer.train()
    return summary(counter["times"], [sum(c["lengths"]) for c in CALLS], [c["completions"] for c in CALLS],
                   counter["steps"], trainer.state.global_step)


def main() -> None:
    system, model_dir, data, prompts, group, max_new, steps, threads, out = sys.argv[1:10]
    opt = options(sys.argv[10:])
    os.environ["EXACTRL_BENCH_REWARD"] = opt.get("reward", "arithmetic")
    run({"exactrl": run_exactrl, "trl": run_trl}, system, int(threads), model_dir, data, int(prompts), int(group),
        int(max_new), int(steps), out, opt, device=opt["device"])


if __name__ == "__main__":
    main()
