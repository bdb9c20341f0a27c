"""What `exactrl config check` plans with, shared by the plans of every command (plan.py: sft, rl, the
pipeline, the study; plan_pref.py: dpo, kto, rm, kd): the options that stand in for what is not here, a
phase's plan, and reading the model's size and tokenizer when they are local."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from exactrl.compute import count_parameters


@dataclass
class Options:
    params: float | None = None  # N; unset: counted from a local model
    tokens_per_sample: float | None = None  # D of a trained sequence; unset: measured from local data
    rollout_tokens: float | None = None  # D of a generated one (default: tokens_per_sample)
    data_rows: int | None = None  # the training data's size when its file is not here
    teacher_params: float | None = None  # kd's teacher's N; unset: counted from a local teacher


@dataclass
class PhasePlan:
    name: str
    steps: int | None = None
    samples_per_step: int = 0
    rollouts: int | None = None
    prompts_per_rollout: int = 0
    group_size: int = 0
    tokens_per_sample: float | None = None
    n_params: float | None = None
    teacher_params: float | None = None  # kd: the teacher's N (its no-grad forward is in the FLOPs)
    flops: float | None = None
    notes: list[str] = field(default_factory=list)


def _local(path: str | None, spec, kind: str, notes: list[str], what: str) -> str | None:
    from exactrl.tasks.builtin import resolve

    if path in (None, "auto"):
        return None
    if path == "builtin-sft":  # the built-in model after SFT has the built-in model's architecture
        path = "builtin"
    resolved = resolve(path, kind, spec)
    if not Path(resolved).exists():
        notes.append(f"{what} '{path}': not found here")
        return None
    return resolved


def _n_params(model_dir: str | None, opts: Options, notes: list[str], cfg) -> float | None:
    if opts.params is not None:
        return opts.params
    if model_dir is None:
        notes.append("N unknown: give --params")
        return None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=cfg.model.trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.model.trust_remote_code)
    return count_parameters(model)


def _tokenizer(model_dir: str | None, cfg, notes: list[str]):
    from exactrl.models.loading import load_tokenizer

    if model_dir is None:
        notes.append("tokens per sample unknown without the model's tokenizer: give --tokens-per-sample")
        return None
    return load_tokenizer(model_dir, cfg.model.trust_remote_code, cfg.data.chat_template)
