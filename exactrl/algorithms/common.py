"""What every training command does around its loop: seeding, run directory, logging, eval."""

from __future__ import annotations

import math
import random
import shutil
import warnings
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
from exactrl.data.encode import encode_prompts
from exactrl.data.jsonl import read_jsonl
from exactrl.metrics import MetricsLog
from exactrl.models.loading import load_causal_lm
from exactrl.progress import progress as progress_bar
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


def load_model(cfg, path, run_dir: Path, phase: str, role: str, longest: int, trainable: bool = True, loader=None):
    """A model for ``role`` (policy, reference, critic) loaded as cfg.model says, after the
    packing self-check (exactrl/checks/packing.py) has confirmed the path the run will train on
    and recorded its figures in the manifest. ``longest``: the run's longest sequence."""
    m = cfg.model
    model = (loader or load_causal_lm)(path, trainable=trainable, attn=m.attn_implementation, dropout=not m.disable_dropout)
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


def load_eval_prompts(cfg, tokenizer, eval_path: str | None):
    if not eval_path:
        return None
    return encode_prompts(read_jsonl(eval_path)[: cfg.data.eval_size], tokenizer, cfg.data.max_length)


def greedy_accuracy(cfg, model, tokenizer, prompts) -> Accuracy:
    return evaluate_accuracy(model, tokenizer, prompts, cfg.eval.reward_fn, batch_size=cfg.eval.batch_size,
                             max_new_tokens=cfg.eval.max_new_tokens)


def should(every: int, step: int, last: int) -> bool:
    """True on every ``every``-th completed step (1-based ``step``), never on the last (handled once after the loop)."""
    return every > 0 and step % every == 0 and step != last


def evaluate_and_log(cfg, phase: str, step: int, model, tok, prompts, log: MetricsLog, say=print) -> Accuracy:
    # Every rank generates for the same prompts (a sharded model needs all ranks in each
    # forward); greedy decoding keeps them in lockstep.
    acc = greedy_accuracy(cfg, model, tok, prompts)
    log.write({"phase": phase, "step": step, "eval_accuracy": acc.value, "eval_ci95": list(acc.ci95)})
    if is_main():
        say(f"[{phase}] step {step}: greedy accuracy on {acc.n} eval prompts {acc}")
    return acc


def after_step(cfg, phase: str, step: int, steps: int, model, tok, engine, eval_prompts, log: MetricsLog, run_dir: Path,
               bar, position: dict, others: dict | None = None) -> None:
    """Periodic evaluation and checkpoint after completed step ``step`` (1-based). ``others``:
    more trained models saved in the same checkpoint (name -> (model, engine), e.g. a critic)."""
    if eval_prompts and should(cfg.train.eval_every, step, steps):
        evaluate_and_log(cfg, phase, step, model, tok, eval_prompts, log, say=bar.write)
    if should(cfg.train.save_every, step, steps):
        save_checkpoint(run_dir / f"checkpoint-{step}", model, tok, engine, position, others)
        if cfg.train.save_total_limit and is_main():  # only now is the new one complete
            for old in complete_checkpoints(run_dir)[: -cfg.train.save_total_limit]:
                shutil.rmtree(old)


def finish(cfg, phase: str, steps: int, model, tok, engine, eval_prompts, log: MetricsLog, run_dir: Path, final_name: str) -> Path:
    """Final evaluation, then the final model in Hugging Face format."""
    if eval_prompts:
        evaluate_and_log(cfg, phase, steps, model, tok, eval_prompts, log)
    final = engine.save_pretrained(run_dir / final_name, tok)
    log.close()
    return final
