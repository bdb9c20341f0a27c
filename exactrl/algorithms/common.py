"""What every training command does around its loop: seeding, run directory, logging, eval.

Evaluation (held-out greedy accuracy) scores with the run's own reward: eval.reward_fn if set,
else in `rl` the first reward.fn (or reward.url), in `sft` the built-in task's checker. Its data
is data.eval; at its default ('auto') that is the built-in problems only when data.train is
built-in too, and nothing (with a notice) when you train on your own file."""

from __future__ import annotations

import math
import random
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from exactrl.algorithms.evaluate import Accuracy, evaluate_accuracy
from exactrl.audit.manifest import record_check, write_manifest
from exactrl.checks.packing import check_packing
from exactrl.config.loader import ConfigError
from exactrl.config.schema import check_layout, check_rl_layout
from exactrl.distributed.checkpoint import complete_checkpoints, save_checkpoint
from exactrl.distributed.launch import broadcast_str, is_main, world_size
from exactrl.data.encode import Prompt, encode_prompts
from exactrl.data.jsonl import read_jsonl
from exactrl.metrics import MetricsLog
from exactrl.models.loading import load_causal_lm
from exactrl.models.lora import apply_lora
from exactrl.progress import progress as progress_bar
from exactrl.rewards import DEFAULT_TIMEOUT, Reward, Rewards, require_answers
from exactrl.run_dir import create_run_dir


def check_world(cfg) -> None:
    """The config against the real number of processes (torchrun may have started more)."""
    try:
        check_layout(cfg, world_size())
        if hasattr(cfg, "algo"):
            check_rl_layout(cfg, world_size())
    except ValueError as e:
        raise ConfigError(str(e)) from None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def open_run(cfg, command: str, run_dir: Path | None, data_files: dict) -> tuple[Path, MetricsLog]:
    """Create (or reuse, for a demo phase) the run directory; write config and manifest.
    Under several processes only the main one writes; the others share the path."""
    if not is_main():
        path = run_dir or Path(broadcast_str(""))
        return path, MetricsLog(None)
    if run_dir is None:
        run_dir = create_run_dir(cfg.output_dir, command, cfg)
        write_manifest(run_dir, cfg.train.seed, data_files)
    if world_size() > 1:
        broadcast_str(str(run_dir))
    return run_dir, MetricsLog(run_dir / "metrics.jsonl")


def load_model(cfg, path, run_dir: Path, phase: str, role: str, longest: int, trainable: bool = True, loader=None,
               checkpoint: str | None = None):
    """A model for ``role`` (policy, reference, critic) loaded as cfg.model says, after the
    packing self-check (exactrl/checks/packing.py) has confirmed the path the run will train on
    and recorded its figures in the manifest. ``longest``: the run's longest sequence.
    ``checkpoint``: a checkpoint to resume from: its full weights, or (the policy with
    model.lora.rank > 0) the base model at ``path`` with the checkpoint's adapters."""
    m = cfg.model
    lora = m.lora.rank > 0 and role == "policy"
    path = checkpoint if checkpoint and not lora else path
    model = (loader or load_causal_lm)(path, trainable=trainable, attn=m.attn_implementation, dropout=not m.disable_dropout)
    if lora:
        model = apply_lora(model, m.lora, checkpoint)
    t = cfg.train
    if t.packing_check != "off":
        report = check_packing(model, model.config.get_text_config(decoder=True).vocab_size, longest, t.padding_free,
                               t.packing_check, t.packing_check_tol, what=f"the {role} model")
        if is_main():
            record_check(run_dir, f"packing/{phase}/{role}", report.as_dict())
            if report.notice:
                warnings.warn(report.notice, UserWarning, stacklevel=2)
    return model


def steps_for(train_cfg, num_items: int, items_per_step: int) -> int:
    return train_cfg.max_steps or max(1, math.ceil(train_cfg.epochs * num_items / items_per_step))


def progress(total: int, desc: str, start: int = 0):
    return progress_bar(total, desc, start, enabled=is_main())


def check_data_size(num_items: int, per_step: int, what: str, path) -> None:
    """A step larger than the data would hold some of it twice: a mistake, not a schedule."""
    if per_step > num_items:
        key = ("train.global_batch_size" if what == "samples"
               else "train.global_batch_size x algo.mini_batches / algo.group_size")
        raise ConfigError(f"{key} asks for {per_step} {what} per step (or rollout), but '{path}' has only {num_items}: "
                          "a step would repeat some of them; lower the batch size or add data")


BUILTIN_CHECKER = "exactrl.tasks.arithmetic:reward"


class EvaluationError(RuntimeError):
    """The final evaluation failed after the trained model was saved."""


@dataclass
class EvalSet:
    """Held-out prompts and the reward that scores them (``owned``: a reward process of its own, closed with it)."""

    prompts: list[Prompt]
    reward: Reward
    owned: Rewards | None = None

    def __len__(self) -> int:
        return len(self.prompts)

    def close(self) -> None:
        if self.owned is not None:
            self.owned.close()


def eval_data(cfg) -> str | None:
    """data.eval with 'auto' decided: the built-in problems for built-in training data, else none."""
    if cfg.data.eval != "auto":
        return cfg.data.eval
    if cfg.data.train == "builtin":
        return "builtin"
    if is_main():
        print(f"note: no evaluation -- data.train={cfg.data.train} is your own data and data.eval is unset; set "
              "data.eval=FILE ({prompt, answer} rows) to measure accuracy, or data.eval=builtin for the built-in problems")
    return None


def eval_reward_spec(cfg) -> str:
    """The reward evaluation scores with: eval.reward_fn, else the run's first reward, else (sft) the built-in checker."""
    if cfg.eval.reward_fn:
        return cfg.eval.reward_fn
    return cfg.reward.specs()[0] if hasattr(cfg, "reward") else BUILTIN_CHECKER


def load_eval_set(cfg, tokenizer, eval_path: str | None, reward: Reward | None = None) -> EvalSet | None:
    """The first data.eval_size eval rows, each checked to carry the answer the reward needs.
    Without ``reward`` (sft), the eval reward gets a process of its own."""
    if not eval_path:
        return None
    prompts = encode_prompts(read_jsonl(eval_path)[: cfg.data.eval_size], tokenizer, cfg.data.max_length)
    owned = None if reward is not None else Rewards(eval_reward_spec(cfg))
    reward = reward or owned.eval
    try:
        require_answers(prompts, [reward], "the evaluation reward")
    except Exception:
        if owned is not None:
            owned.close()
        raise
    return EvalSet(prompts, reward, owned)


def greedy_accuracy(cfg, model, tokenizer, eval_set: EvalSet) -> Accuracy:
    r = getattr(cfg, "reward", None)
    return evaluate_accuracy(model, tokenizer, eval_set.prompts, eval_set.reward, batch_size=cfg.eval.batch_size,
                             max_new_tokens=cfg.eval.max_new_tokens, timeout=r.timeout if r else DEFAULT_TIMEOUT,
                             fallback=r.fallback if r else None)


def should(every: int, step: int, last: int) -> bool:
    """True on every ``every``-th completed step (1-based ``step``), never on the last (handled once after the loop)."""
    return every > 0 and step % every == 0 and step != last


def evaluate_and_log(cfg, phase: str, step: int, model, tok, eval_set: EvalSet, log: MetricsLog, say=print) -> Accuracy:
    # Every rank generates for the same prompts (a sharded model needs all ranks in each
    # forward); greedy decoding keeps them in lockstep.
    acc = greedy_accuracy(cfg, model, tok, eval_set)
    log.write({"phase": phase, "step": step, "eval_accuracy": acc.value, "eval_ci95": list(acc.ci95),
               "eval_reward_failures": acc.reward_failures})
    if is_main():
        failed = f" ({acc.reward_failures} scored reward.fallback: the reward failed on them)" if acc.reward_failures else ""
        say(f"[{phase}] step {step}: greedy accuracy on {acc.n} eval prompts {acc}{failed}")
    return acc


def after_step(cfg, phase: str, step: int, steps: int, model, tok, engine, eval_set, log: MetricsLog, run_dir: Path,
               bar, position: dict, others: dict | None = None) -> None:
    """Periodic evaluation and checkpoint after completed step ``step`` (1-based). ``others``:
    more trained models saved in the same checkpoint (name -> (model, engine), e.g. a critic)."""
    if eval_set and should(cfg.train.eval_every, step, steps):
        evaluate_and_log(cfg, phase, step, model, tok, eval_set, log, say=bar.write)
    if should(cfg.train.save_every, step, steps):
        save_checkpoint(run_dir / f"checkpoint-{step}", model, tok, engine, position, others)
        if cfg.train.save_total_limit and is_main():  # only now is the new one complete
            for old in complete_checkpoints(run_dir)[: -cfg.train.save_total_limit]:
                shutil.rmtree(old)


def finish(cfg, phase: str, steps: int, model, tok, engine, eval_set: EvalSet | None, log: MetricsLog, run_dir: Path,
           final_name: str, others: dict | None = None) -> Path:
    """The final model (and ``others``: directory name -> engine, e.g. the critic) in Hugging Face
    format, then the final evaluation: saved first, so a failing evaluation never costs the training."""
    final = engine.save_pretrained(run_dir / final_name, tok)
    for name, other in (others or {}).items():
        other.save_pretrained(run_dir / name, tok)
    try:
        if eval_set:
            evaluate_and_log(cfg, phase, steps, model, tok, eval_set, log)
    except Exception as e:
        raise EvaluationError(f"the final evaluation failed: {e} (the trained model is saved in {final})") from e
    finally:
        log.close()
        if eval_set:
            eval_set.close()
    return final
