"""Loading a worker's model: as cfg.model says, then the packing self-check on that very model."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from exactrl.audit.manifest import record_check
from exactrl.checks.packing import check_packing
from exactrl.device import place, process_device
from exactrl.distributed.launch import is_main
from exactrl.models.loading import load_causal_lm
from exactrl.models.lora import apply_lora


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
    if lora:  # before the self-check: it checks the model that trains
        model = apply_lora(model, m.lora, checkpoint)
    device = process_device()
    place(model, device)  # the self-check runs the kernels training will use
    t = cfg.train
    if t.packing_check != "off":
        # Under bf16 autocast, as the engine runs the forwards: where flash-attention can take them.
        autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if m.dtype == "bf16" else None
        report = check_packing(model, model.config.get_text_config(decoder=True).vocab_size, longest, t.padding_free,
                               t.packing_check, t.packing_check_tol, what=f"the {role} model", autocast=autocast)
        if is_main():
            record_check(run_dir, f"packing/{phase}/{role}", report.as_dict())
            if report.notice:
                warnings.warn(report.notice, UserWarning, stacklevel=2)
    return model
