"""The packing self-check: before the first step, the loaded model runs a few sequences of
different lengths packed into one row (the padding-free path, exactrl/models/packing.py), as a
right-padded batch, and each alone through Hugging Face's own eager attention; the path the
run will use must agree with the sequences alone.

It is what catches the architecture nobody tested: a sliding window or logit softcap the
packed attention does not apply, a model whose attention never calls the registered function
(Falcon and Bloom compute ALiBi attention themselves, so a packed row would attend across its
sequences), dropout left on. Sequences run past the model's narrowest sliding window when the
run's sequences can. Costs a few forwards of at most a few dozen tokens.

These run in fp32. flash-attention's kernel (exactrl/models/flash.py) only runs in half
precision, so for a bf16 run the packed row runs once more under the run's autocast: when that
engages flash, it is compared with the packed SDPA path (just verified in fp32) under the same
autocast. The report names the kernel the packed forwards of training run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass

import torch

from exactrl.device import device_of
from exactrl.models import packing


class PackingCheckError(RuntimeError):
    """Neither the requested path nor (under train.packing_check=fallback) the padded one
    computes what the model computes on each sequence alone."""


@dataclass
class PackingReport:
    lengths: list[int]
    packed_error: float | None  # max |packed - alone| / max(1, max |alone|) over real positions; None: not run
    padded_error: float
    packed_attention_calls: int  # varlen_attention calls in the packed forward (0: the model bypassed it)
    seconds: float
    packed: bool  # whether the run trains on packed rows
    notice: str | None = None  # why packing (or flash-attention) was turned off
    kernel: str | None = None  # the packed path's attention: "flash_attn varlen", "sdpa varlen", "eager varlen"; None: not run
    flash_error: float | None = None  # flash vs packed SDPA under the run's autocast, same scale; None: flash not used

    def as_dict(self) -> dict:
        return asdict(self)


def narrowest_window(config) -> int | None:
    """The smallest sliding window any layer of ``config`` uses, if any."""
    config = config.get_text_config(decoder=True)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None and not any("sliding" in t for t in types):
        return None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return window if isinstance(window, int) and window > 0 else None


def probe_lengths(config, longest: int) -> list[int]:
    """Three lengths, the longest past the narrowest sliding window when ``longest`` (the run's
    longest sequence) is; a long one follows a short one, so leakage between them shows."""
    window = narrowest_window(config)
    top = max(2, min(longest, 24 if window is None else max(24, window + 4)))
    return [max(2, top // 2 + 1), top, min(3, top)]


def _outputs(model, **inputs) -> torch.Tensor:
    return model(**inputs).logits.float()


def _alone(model, seqs) -> list[torch.Tensor]:
    """Each sequence alone (no padding, no mask) through the model's own eager attention."""
    hf = packing._hf_model(model)
    current = hf.config._attn_implementation
    try:
        hf.set_attn_implementation("eager")
    except (ValueError, ImportError):
        current = None  # no eager path: compare against the model's current kernel
    try:
        device = device_of(model)
        return [_outputs(model, input_ids=torch.tensor([s], device=device), use_cache=False)[0] for s in seqs]
    finally:
        if current is not None:
            hf.set_attn_implementation(current)


def _packed(model, seqs, lengths) -> tuple[list[torch.Tensor], int, str]:
    """The packed forward's outputs per sequence, its calls of the packed attention and the
    kernels those ran."""
    calls, kernels = packing.packed_calls, packing.packed_kernels.copy()
    flat = _outputs(model, **packing.model_batch(model, seqs, 0, packed=True).inputs)[0]
    return list(flat.split(lengths)), packing.packed_calls - calls, ", ".join(sorted(packing.packed_kernels - kernels))


def _error(rows: list[torch.Tensor], refs: list[torch.Tensor]) -> float:
    scale = max(1.0, max(r.abs().max().item() for r in refs))
    return max((a - b).abs().max().item() for a, b in zip(rows, refs)) / scale


# flash against SDPA, both under bf16 autocast (8-bit mantissa, ~4e-3 per rounding): the two
# kernels round differently, compounded over the layers and rounded again in the bf16 logits
# (the tiny test models reach 2e-2); a window or softcap flash-attention misses changes whole
# attention rows (5e-1 and more there).
BF16_TOL = 5e-2


@torch.no_grad()
def check_packing(model, vocab_size: int, longest: int, padding_free: bool, policy: str, tol: float,
                  what: str = "the model", autocast: Callable[[], AbstractContextManager] | None = None) -> PackingReport:
    """Run the check on ``model`` (a Hugging Face model loaded by exactrl.models.loading, not yet
    wrapped by an engine). ``policy``: 'fallback' turns packing off for the model (padded
    batches) when only the packed path disagrees, or flash-attention off when only it does;
    'error' stops. ``autocast``: the run's (bf16), under which flash-attention may engage.
    Raises PackingCheckError."""
    t0 = time.perf_counter()
    hf = packing._hf_model(model)
    lengths = probe_lengths(hf.config, longest)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]
    was_training = model.training
    model.eval()  # dropout is the run's choice; the check is about which tokens attend to which
    try:
        refs = _alone(model, seqs)
        padded = _outputs(model, **packing.model_batch(model, seqs, 0, packed=False).inputs)
        padded_error = _error([padded[i, :n] for i, n in enumerate(lengths)], refs)
        packed_error, calls, kernel, flash_error, without_flash = None, 0, None, None, None
        if padding_free and packing.can_pack(model):
            rows, calls, kernel = _packed(model, seqs, lengths)
            packed_error = _error(rows, refs)
            if autocast is not None and "flash" not in kernel:
                kernel, flash_error, without_flash = _check_flash(model, seqs, lengths, autocast) or (kernel, None, kernel)
    finally:
        model.train(was_training)
    report = PackingReport(lengths, packed_error, padded_error, calls, time.perf_counter() - t0, packed_error is not None,
                           kernel=kernel, flash_error=flash_error)
    where = f"{what} ({type(hf).__name__}; sequences of {', '.join(map(str, lengths))} tokens)"
    if padding_free and packed_error is not None and (packed_error > tol or calls == 0):
        why = (f"its attention never called exactrl's packed attention (the model computes attention itself, "
               f"e.g. ALiBi in Falcon and Bloom), so each sequence of a row would attend to the ones before it"
               if calls == 0 else f"packed rows differ from each sequence alone by {packed_error:.3g} (train.packing_check_tol={tol:g})")
        if policy == "error" or padded_error > tol:
            raise PackingCheckError(f"packing self-check failed for {where}: {why}; set train.padding_free=false"
                                    + ("" if padded_error <= tol else f" -- but padded batches differ too ({padded_error:.3g})"))
        packing.disable(model)
        report.packed = False
        report.notice = f"packing self-check: {where}: {why}; training on right-padded batches instead (train.padding_free ignored)"
    elif padded_error > tol and not report.packed:
        raise PackingCheckError(f"packing self-check failed for {where}: right-padded batches differ from each sequence "
                                f"alone by {padded_error:.3g} (train.packing_check_tol={tol:g})")
    elif flash_error is not None and flash_error > BF16_TOL:
        why = f"flash-attention's packed rows differ from the packed SDPA path in bf16 by {flash_error:.3g} (allowed {BF16_TOL:g})"
        if policy == "error":
            raise PackingCheckError(f"packing self-check failed for {where}: {why}; uninstall flash-attn or set train.padding_free=false")
        packing.use_flash(model, False)
        report.kernel = without_flash
        report.notice = f"packing self-check: {where}: {why}; packed rows run {without_flash} instead"
    return report


def _check_flash(model, seqs, lengths, autocast) -> tuple[str, float, str] | None:
    """Under the run's autocast: the kernels the packed row runs and, when flash-attention is
    among them, its largest difference from the same row with flash turned off, and the kernels
    that row ran."""
    with autocast():
        rows, _, kernel = _packed(model, seqs, lengths)
    if "flash" not in kernel:
        return None
    packing.use_flash(model, False)
    try:
        with autocast():
            refs, _, without_flash = _packed(model, seqs, lengths)
    finally:
        packing.use_flash(model, True)
    return kernel, _error(rows, refs), without_flash
