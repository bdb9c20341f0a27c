"""Loading a worker's model: as cfg.model says, then the start-up self-checks on that very model:
is its training forward deterministic (exactrl/checks/determinism.py), which path computes what
the model computes on each sequence alone (exactrl/checks/packing.py), and, once the generator
exists, does it decode what the model computes (exactrl/rollout/generation_check.py)."""

from __future__ import annotations

import warnings
from functools import partial
from pathlib import Path

from exactrl.audit.manifest import record_check
from exactrl.checks.determinism import DeterminismError, check_determinism, random_forward_message
from exactrl.checks.head import check_head
from exactrl.checks.packing import check_packing, probe_lengths
from exactrl.device import place, process_device
from exactrl.distributed.launch import is_main
from exactrl.dtypes import PRECISIONS, autocast_for
from exactrl.models import packing
from exactrl.models.loading import load_causal_lm
from exactrl.models.lora import apply_lora
from exactrl.rollout.generation_check import check_generation
from exactrl.rollout.static_decode import use_static, wants_static


def load_model(cfg, path, run_dir: Path, phase: str, role: str, longest: int, trainable: bool = True, loader=None,
               checkpoint: str | None = None):
    """A model for ``role`` (policy, reference, critic) loaded as cfg.model says, after the
    packing self-check (exactrl/checks/packing.py) has confirmed the path the run will train on
    and recorded its figures in the manifest. ``longest``: the run's longest sequence.
    ``checkpoint``: a checkpoint to resume from: its full weights, or (the policy with
    model.lora.rank > 0) the base model at ``path`` with the checkpoint's adapters. LoRA goes on the trained
    model: the policy, or exactrl rm's reward model (its head trained whole, exactrl/models/lora.py)."""
    m = cfg.model
    lora = m.lora.rank > 0 and role in ("policy", "reward_model")
    path = checkpoint if checkpoint and not lora else path
    model = (loader or load_causal_lm)(path, trainable=trainable, attn=m.attn_implementation,
                                       dropout=not m.disable_dropout, trust_remote_code=m.trust_remote_code)
    if lora:  # before the self-check: it checks the model that trains
        model = apply_lora(model, m.lora, checkpoint)
    device = process_device()
    place(model, device)  # the self-checks run the kernels training will use
    packing.use_kernels(model, setting=m.packed_kernel)
    t = cfg.train
    vocab = model.config.get_text_config(decoder=True).vocab_size
    train_mode = None
    if trainable:
        det = check_determinism(model, vocab, probe_lengths(model.config, longest)[:2])
        if is_main():
            record_check(run_dir, f"determinism/{phase}/{role}", det.as_dict())
        if not det.deterministic:
            message = random_forward_message(det, f"the {role} model ({type(model).__name__})")
            if hasattr(cfg, "algo") and role == "policy":
                raise DeterminismError(f"{message}; rl needs the training forward to compute the log-probs the "
                                       "generator sampled with, so this model can be trained with exactrl sft only")
            train_mode = False  # sft trains with it, as with dropout; the packing check compares in eval mode
            if is_main():
                warnings.warn(f"{message}; training with it, and comparing packed and padded forwards in eval mode",
                              UserWarning, stacklevel=2)
    if t.packing_check != "off":
        # Under bf16 autocast, as the engine runs the forwards: where flash-attention can take them.
        autocast = partial(autocast_for, m.dtype, device) if PRECISIONS[m.dtype].autocast is not None else None
        report = check_packing(model, vocab, longest, t.padding_free, t.packing_check, t.packing_check_tol,
                               what=f"the {role} model", autocast=autocast, train_mode=train_mode)
        if is_main():
            record_check(run_dir, f"packing/{phase}/{role}", report.as_dict())
            if report.notice:
                warnings.warn(report.notice, UserWarning, stacklevel=2)
    if t.logprob_chunk_size > 0 and t.packing_check != "off":
        head_report = check_head(model, vocab, t.packing_check_tol, what=f"the {role} model")
        if is_main():
            record_check(run_dir, f"head/{phase}/{role}", head_report.as_dict())
            if head_report.notice:
                warnings.warn(head_report.notice, UserWarning, stacklevel=2)
    return model


def check_generator(cfg, model, tokenizer, run_dir: Path, phase: str, *, sampled: bool, synced: bool = False,
                    role: str = "policy") -> None:
    """The generation self-check on ``role``'s ``model`` (the policy's, or a Ray rollout engine's; every rank,
    together), recorded in the manifest; ``sampled``: also the sampled log-probs against the training forward (rl).
    First puts the model on the decode path rollout.decode asks for (exactrl/rollout/static_decode.py)."""
    t = cfg.train
    rollout = getattr(cfg, "rollout", None)
    use_static(model, wants_static(getattr(rollout, "decode", "eager"), model, synced, t.generation_check != "off"))
    if t.generation_check == "off":
        return
    sampling = ({"temperature": rollout.temperature, "top_p": rollout.top_p, "top_k": rollout.top_k,
                 "max_new_tokens": rollout.max_new_tokens} if rollout else {"max_new_tokens": cfg.eval.max_new_tokens})
    correction = cfg.algo.rollout_correction if rollout else "none"  # a gap the run corrects does not stop it
    report = check_generation(model, model.config.get_text_config(decoder=True).vocab_size, eos=tokenizer.eos_token_id,
                              pad=tokenizer.pad_token_id, policy=t.generation_check, tol=t.generation_check_tol,
                              sampled=sampled, synced=synced, correction=correction, what=f"the {role} model",
                              **sampling)
    if is_main():
        record_check(run_dir, f"generation/{phase}/{role}", report.as_dict())
        if report.notice:
            warnings.warn(report.notice, UserWarning, stacklevel=2)
