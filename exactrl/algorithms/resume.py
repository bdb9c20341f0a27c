"""What a resume must agree with: the checkpoint's command, its step and its run's config;
where ``train.resume_from=latest`` continues from; and where a run stands after a step (SFTPosition,
RLPosition: what its checkpoint keeps so that the resumed run continues exactly).

Exact continuation needs the same data, model, batch layout, optimizer and algorithm, so a
resume that changes any of them is refused, naming the keys, unless they are listed in
``train.resume_allow_changes``. Keys in MAY_CHANGE change nothing a step computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from exactrl.config.loader import ConfigError
from exactrl.distributed.checkpoint import CheckpointError, check_resumable, complete_checkpoints
from exactrl.distributed.launch import is_main
from exactrl.run_dir import finished

# How long to run, how often to log/save/evaluate, where to write (output_dir, log.*) and what to evaluate on,
# how checks react, and how a step is split into micro-batches (the gradient is the same).
MAY_CHANGE = ("output_dir", "train.max_steps", "train.epochs", "train.save_every", "train.log_every",
              "train.eval_every", "train.resume_from", "train.resume_allow_changes", "train.save_total_limit",
              "train.nonfinite", "train.micro_batch_size", "train.packing_check", "train.packing_check_tol",
              "train.generation_check", "train.generation_check_tol", "data.eval", "data.eval_size", "eval.", "audit.",
              "log.", "reward.timeout", "reward.retries", "distributed.nproc_per_node", "model.lora.merge_on_save")

# Keys the checkpoint's tensors depend on: a model built with another value cannot load them
# (other adapter shapes, other layers, another architecture or base), so no resume may change
# them, even when listed in train.resume_allow_changes.
FIXED = {"model.path": "the checkpoint's weights were trained from that model (its architecture, and LoRA's base)",
         "model.lora.rank": "it sets the shapes of the adapters the checkpoint holds",
         "model.lora.target_modules": "it decides which layers hold the checkpoint's adapters",
         "critic.path": "the checkpoint's critic was built from that model's architecture"}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def changed_keys(saved: dict, now: dict, allowed: list[str]) -> list[str]:
    """Dotted keys whose value differs between two config dumps, outside MAY_CHANGE and ``allowed``."""
    a, b = _flat(saved), _flat(now)
    free = (*MAY_CHANGE, *allowed)
    return [k for k in sorted(a.keys() | b.keys())
            if a.get(k) != b.get(k) and not any(k == f or (f.endswith(".") and k.startswith(f)) for f in free)]


def prepare_resume(cfg, command: str, steps: int) -> bool:
    """Decide ``train.resume_from=latest`` and check any resume. Returns whether this launch
    continues the run already in output_dir (``latest``), which may then write into it.

    ``latest`` becomes the newest complete checkpoint-N of output_dir (a checkpoint appears only
    once fully written, exactrl/distributed/checkpoint.py), or, with none yet, nothing: the run
    starts at step 0 with a notice (as verl's resume_mode=auto), so the same command relaunched
    after a preemption always continues. The resolved path is what config.yaml records."""
    t = cfg.train
    latest = t.resume_from == "latest"
    if latest:
        run_dir = Path(cfg.output_dir.format(command=command))
        if run_dir.is_dir() and (why := finished(run_dir)):  # before 'continuing ...' is said
            raise ConfigError(why)
        done = complete_checkpoints(run_dir) if run_dir.is_dir() else []
        t.resume_from = str(done[-1]) if done else None
        if is_main():
            print(f"train.resume_from=latest: continuing '{run_dir}' from {done[-1].name}" if done else
                  f"train.resume_from=latest: no checkpoint in '{run_dir}' yet; starting from step 0")
    if t.resume_from:
        check_resume(cfg, command, steps)
    return latest


def check_resume(cfg, command: str, steps: int) -> None:
    """Refuse, before anything is written, a resume that could not continue the run exactly."""
    p = Path(cfg.train.resume_from)
    ray = getattr(cfg, "ray", None)
    state = check_resumable(p, ray.ranks if ray is not None and ray.enabled else None)
    extra = state.get("extra", {})
    # The command that wrote it; a checkpoint from before it was stored is an rl one when it holds a rollout position.
    was = state.get("command") or ("rl" if "rollout" in extra else "sft")
    if was != command:
        raise CheckpointError(f"train.resume_from: '{p}' is an {was} checkpoint and cannot be resumed by "
                              f"`exactrl {command}`; to start {command} from its weights, set model.path={p} instead")
    if extra.get("step", 0) >= steps:
        raise CheckpointError(f"train.resume_from: '{p}' is at step {extra.get('step')}, and this run ends at step "
                              f"{steps} (train.max_steps / train.epochs); raise train.max_steps to continue it")
    saved_path = p.parent / "config.yaml"
    try:
        saved = yaml.safe_load(saved_path.read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        raise CheckpointError(f"train.resume_from: '{saved_path}' (the checkpoint's run config) cannot be read; resume "
                              "needs it to check that data and layout are unchanged") from None
    now = cfg.model_dump(mode="json")
    saved = saved if isinstance(saved, dict) else {}
    flat_saved, flat_now = _flat(saved), _flat(now)
    for key in cfg.train.resume_allow_changes:
        if key in FIXED:
            raise CheckpointError(f"train.resume_allow_changes: {key} cannot change on resume: {FIXED[key]}; resume "
                                  f"with {key}={flat_saved.get(key)!r} (the checkpoint's run's), or start a new run")
    diff = changed_keys(saved, now, cfg.train.resume_allow_changes)
    fixed = [k for k in diff if k in FIXED]
    if fixed:
        shown = "; ".join(f"{k}: {flat_saved.get(k)!r} -> {flat_now.get(k)!r} ({FIXED[k]})" for k in fixed)
        raise CheckpointError(f"train.resume_from: this config differs from the checkpoint's run ({saved_path}) in "
                              f"{shown}. A resume cannot change that: restore the checkpoint's run's value, or start "
                              "a new run")
    if diff:
        shown = "; ".join(f"{k}: {flat_saved.get(k)!r} -> {flat_now.get(k)!r}" for k in diff)
        raise CheckpointError(f"train.resume_from: this config differs from the checkpoint's run ({saved_path}) in "
                              f"{shown}. Exact resume needs the same data and layout: restore them, or continue "
                              f"anyway with train.resume_allow_changes=[{','.join(diff)}]")


def since(default):
    """A position field that checkpoints written before it was kept lack: they resume with ``default``.
    Still required where a position is made, so that no save leaves it out."""
    return field(metadata={"since": default})


@dataclass
class SFTPosition:
    """Where an sft run stands after an optimizer step: its checkpoint's "extra" keys are the fields, by name."""

    step: int  # optimizer steps done
    flops_trained_tokens: int = since(0)  # exactrl/compute.py FlopsCounter's counts, so the resumed ones continue
    flops_generated_tokens: int = since(0)

    def state(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def load(cls, state: dict):
        """The position a checkpoint's ``state`` (``state()`` as it was saved) holds."""
        values = {}
        for f in fields(cls):
            if f.name in state:
                values[f.name] = state[f.name]
            elif "since" in f.metadata:
                values[f.name] = f.metadata["since"]
            else:
                raise CheckpointError(f"train.resume_from: the checkpoint's position lacks '{f.name}', which "
                                      f"{cls.__name__} needs; resume from a checkpoint this command wrote")
        return cls(**values)


@dataclass
class RLPosition(SFTPosition):
    """Where an rl run stands after an optimizer step (checkpoints are written between rollouts only)."""

    rollout: int  # the rollout that step belongs to (a checkpoint ends one); the resumed run starts at the next
    group_rng: tuple  # random.Random state that groups a rollout's samples into mini-batches
    kl_coef: float | None = since(None)  # the adaptive KL controller's; None (older checkpoints): algo.kl_coef
    sft_buffer: list[int] | None  # ReLIFT's pending prompts (None: the method keeps no buffer)
