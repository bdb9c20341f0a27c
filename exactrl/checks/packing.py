"""The packing self-check: before the first step, the loaded model runs a batch of sequences
shaped like the run's (``probe_lengths``: rows of many lengths, some a few tokens short of the
longest) packed into one row (the padding-free path, exactrl/models/packing.py), as a
right-padded batch, and each alone through Hugging Face's own eager attention; the path the
run will use must agree with the sequences alone. A few fixed lengths can pass a path that is
wrong for other mixes (a top-k that breaks ties by the width of the row it searches).

It is what catches the architecture nobody tested: a sliding window, attention chunk, logit
softcap, attention sink or sparse-attention index the packed attention does not apply, a model
whose attention never calls the registered function (Falcon and Bloom compute ALiBi attention
themselves; linear-attention and SSM layers carry state along the row), dropout left on. The
probe sequences run past every length-shaped setting of the model's config (sliding windows,
attention chunks, NoPE temperature steps, sparse-attention top-k, convolution widths) when the
run's sequences can; a config with a length-shaped setting the check does not know gets no
packing (it cannot vouch for a mechanism it does not exercise). The forwards run in the mode
training uses (train mode with dropout off; eval mode for a frozen model, or where the training
forward is random, exactrl/checks/determinism.py). Anything that goes wrong inside a forward is
a "no" for that path, with the exception's one-line reason.

Where a path disagrees it falls back, one rung at a time: packed rows, right-padded batches
through exactrl's kernel, right-padded batches through the model's own Hugging Face attention
(sdpa, else eager). Costs a few forwards of at most a few dozen tokens (more where a setting
asks for longer probes).

These run in fp32. The fast packed kernels (exactrl/models/varlen_kernels.py: flash-attention's,
torch's varlen, flex) mostly run in half precision on CUDA, so for a bf16 run the packed row runs
once more under the run's autocast: when that engages a fast kernel, it is compared with the
gather path (packed SDPA/eager, just verified in fp32) under the same autocast. A fast kernel
that disagrees, or fails, is turned off for the model, one rung at a time (flash, torch varlen,
flex, the gather path), in either stage. The report names the kernel the packed forwards of
training run and the kernels turned off, with why.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field

import torch

from exactrl.checks import one_line
from exactrl.device import device_of
from exactrl.models import packing, varlen_kernels


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
    notice: str | None = None  # why packing (or a fast kernel) was turned off
    # the packed attention: "flash_attn varlen", "torch varlen", "flex varlen", "sdpa varlen", "eager varlen" (several
    # where layers differ); None: not run
    kernel: str | None = None
    # the fast kernel vs the gather path under the run's autocast, same scale; None: no fast kernel under autocast
    fast_error: float | None = None
    # padded forwards' attention: exactrl's kernel or the model's own ("hf sdpa", "hf eager")
    attention: str = "exactrl"
    mode: str = "train"  # the mode the forwards ran in: train (as training runs them) or eval
    settings: dict = field(default_factory=dict)  # the config's length-shaped settings the probes were made to pass
    reasons: dict = field(default_factory=dict)  # why a path was refused: {"packed": ..., "padded": ...}
    turned_off: dict = field(default_factory=dict)  # fast packed kernels turned off for the model: {kernel: why}

    def as_dict(self) -> dict:
        return asdict(self)


# Config settings that shape attention by length or position. The probes pass each (by a few
# tokens, when the run's sequences can reach it), so whatever the setting does shows in the check.
PROBED = {
    "sliding_window": "sliding-window attention (on the layers whose type says so)",
    "attention_chunk_size": "chunked attention (Llama 4)",
    "floor_scale": "NoPE attention temperature, a step every floor_scale positions (Llama 4)",
    "index_topk": "sparse attention: keys per query (DeepSeek-V3.2 DSA)",
    "conv_kernel": "short convolution width", "conv_L_cache": "short convolution width (LFM2)",
    "linear_conv_kernel_dim": "linear-attention convolution width", "mamba_d_conv": "Mamba convolution width",
    "short_conv_kernel_size": "short convolution width (Kimi)", "block_size": "lightning attention block (MiniMax-01)",
}
# Length-like names that shape no attention: limits, tilings of an exact algorithm, layer counts.
NOT_MECHANISMS = {
    "max_position_embeddings", "original_max_position_embeddings", "max_window_layers", "chunk_size",
    "mamba_chunk_size",
    "sliding_window_pattern", "no_rope_layer_interval", "interleave_moe_layer_step", "attn_layer_period",
    "attn_layer_offset", "expert_layer_period", "expert_layer_offset", "num_kv_shared_layers", "first_k_dense_replace",
    "moe_layer_freq", "moe_layer_start_index", "moe_layer_end_index", "decoder_sparse_step", "full_attn_interval",
    "max_window_size", "n_positions", "max_seq_len", "max_length", "model_max_length", "num_logits_to_keep",
    "time_step_limit",
}
# Rotary embeddings whose frequencies follow the longest position in the *batch* (Hugging Face's
# dynamic_rope_update): past their original length a short sequence batched with a long one gets
# other frequencies than alone, packed or padded alike.
BATCH_ROPE = {"longrope": "LongRoPE switches to its long factors",
              "dynamic": "dynamic NTK scaling rescales its frequencies"}
LENGTH_WORDS = ("window", "chunk", "block_size", "floor", "topk", "top_k_tokens", "span", "conv", "seq_len", "length")


def _layer_windows(config) -> list[int]:
    """The sliding windows any layer of ``config`` applies."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not isinstance(window, int) or window <= 0 or getattr(config, "use_sliding_window", True) is False:
        return []
    if types is not None and not any("sliding" in str(t) for t in types):
        return []
    return [window]


def length_settings(config) -> tuple[dict[str, int], list[str]]:
    """The length-shaped settings of ``config`` the probes must pass (name -> value), and the
    names of length-like integer settings the check does not know."""
    config = config.get_text_config(decoder=True)
    known, unknown = {}, []
    for name, value in config.to_dict().items():
        name = name.lstrip("_")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 1:
            continue
        if name == "sliding_window":
            if _layer_windows(config):
                known[name] = value
        elif name == "attention_chunk_size":
            if any(t == "chunked_attention" for t in getattr(config, "layer_types", None) or []):
                known[name] = value
        elif name == "floor_scale":
            if getattr(config, "attn_temperature_tuning", False):
                known[name] = value
        elif name in PROBED:
            known[name] = value
        elif name not in NOT_MECHANISMS and any(w in name for w in LENGTH_WORDS):
            unknown.append(f"{name}={value}")
    return known, unknown


def batch_rope_limit(config) -> tuple[int, str] | None:
    """(length, what) when the model's rotary embedding depends on the batch's longest position
    past ``length`` (BATCH_ROPE); None otherwise."""
    config = config.get_text_config(decoder=True)
    params = getattr(config, "rope_parameters", None) or {}
    for p in [params, *(v for v in params.values() if isinstance(v, dict))]:
        kind = p.get("rope_type", p.get("type"))
        if kind in BATCH_ROPE:
            limit = p.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", 0)
            return int(limit or config.max_position_embeddings), BATCH_ROPE[kind]
    return None


# How far the probes reach at least (when the run's sequences do): the widths at which a kernel's
# or top-k's behaviour may change are not all in the config (torch.topk breaks ties by an order that
# depends on the row's width), so the probe's rows are as varied as a run's.
PROBE_REACH = 40


def probe_lengths(config, longest: int) -> list[int]:
    """The probe batch's lengths, shaped like a run's batch of sequences up to ``longest`` (the
    run's longest): the longest row, rows a few tokens short of it padded beside it, rows on
    each side of every length-shaped setting, and short ones. The longest is past every setting
    by a few tokens when ``longest`` is; a long row follows a short one, so leakage between
    neighbours of a packed row shows. The first two are the longer pair."""
    settings = sorted(length_settings(config)[0].values())
    top = max(2, min(longest, max([PROBE_REACH] + [v + 8 for v in settings])))
    mix = [top // 2 + 1, top, 3, top - 7, 2, top - 17, *(n for v in settings for n in (v - 1, v + 1))]
    return list(dict.fromkeys(n for n in mix if 2 <= n <= top))


def probe_sequences(config, vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Random token sequences of ``lengths`` without the config's special tokens: a pad token
    has a zero embedding in many models, which real sequences never carry inside them (and on
    which DeepSeek-V3.2's indexer scores every key alike, so its top-k would be a tie)."""
    config = config.get_text_config(decoder=True)
    special = {getattr(config, k, None) for k in ("pad_token_id", "bos_token_id", "eos_token_id")}
    special = {t for s in special for t in (s if isinstance(s, list) else [s]) if isinstance(t, int)}
    allowed = torch.tensor([t for t in range(vocab_size) if t not in special])
    g = torch.Generator().manual_seed(seed)
    return [allowed[torch.randint(0, len(allowed), (n,), generator=g)].tolist() for n in lengths]


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


def _packed(model, seqs, lengths) -> tuple[list[torch.Tensor] | None, int, str, str | None]:
    """The packed forward's outputs per sequence (None if it raised), its calls of the packed
    attention, the kernels those ran (before any exception) and the exception's one-line reason."""
    calls, kernels = packing.packed_calls, packing.packed_kernels.copy()
    flat, why = _attempt(lambda: _outputs(model, **packing.model_batch(model, seqs, 0, packed=True).inputs)[0])
    ran = ", ".join(sorted(packing.packed_kernels - kernels))
    return None if flat is None else list(flat.split(lengths)), packing.packed_calls - calls, ran, why


def _fast(kernel: str) -> list[str]:
    return [k for k in varlen_kernels.FAST if k in kernel]


def _error(rows: list[torch.Tensor], refs: list[torch.Tensor]) -> float:
    scale = max(1.0, max(r.abs().max().item() for r in refs))
    return max((a - b).abs().max().item() for a, b in zip(rows, refs)) / scale


# A fast kernel against the gather path, both under bf16 autocast (8-bit mantissa, ~4e-3 per
# rounding): the kernels round differently, compounded over the layers and rounded again in the
# bf16 logits (the tiny test models reach 2e-2); a window or softcap a kernel misses changes whole
# attention rows (5e-1 and more there).
BF16_TOL = 5e-2


def _attempt(fn):
    """(fn(), None), or (None, the exception's one-line reason): a path that raises is a "no"."""
    try:
        return fn(), None
    except Exception as e:
        return None, one_line(e)


def _padded(model, seqs, lengths, refs) -> float:
    padded = _outputs(model, **packing.model_batch(model, seqs, 0, packed=False).inputs)
    return _error([padded[i, :n] for i, n in enumerate(lengths)], refs)


def _own_attention(model) -> str | None:
    """Hand ``model`` to its own Hugging Face attention (sdpa where it has it, else eager);
    returns the name, or None when it has neither."""
    hf = packing._hf_model(model)
    for name in ("sdpa", "eager"):
        try:
            hf.set_attn_implementation(name)
            return name
        except (ValueError, ImportError):
            continue
    return None


@torch.no_grad()
def check_packing(model, vocab_size: int, longest: int, padding_free: bool, policy: str, tol: float,
                  what: str = "the model", autocast: Callable[[], AbstractContextManager] | None = None,
                  train_mode: bool | None = None) -> PackingReport:
    """Run the check on ``model`` (a Hugging Face model loaded by exactrl.models.loading, not yet
    wrapped by an engine), in ``train_mode`` (default: the mode it was loaded in, the one its
    training or reference forwards run in). ``policy``: 'fallback' moves the model down the
    rungs (packed rows, padded through exactrl's kernel, padded through the model's own
    attention) until one agrees with the sequences alone, or turns a fast packed kernel off when
    only it disagrees; 'error' stops where the requested path disagrees. ``autocast``: the
    run's (bf16), under which the half-precision kernels may engage. Raises PackingCheckError."""
    t0 = time.perf_counter()
    hf = packing._hf_model(model)
    settings, unknown = length_settings(hf.config)
    lengths = probe_lengths(hf.config, longest)
    seqs = probe_sequences(hf.config, vocab_size, lengths)
    where = f"{what} ({type(hf).__name__}; sequences of {', '.join(map(str, lengths))} tokens)"
    limit = batch_rope_limit(hf.config)
    if limit is not None and longest > limit[0]:
        raise PackingCheckError(f"{what} ({type(hf).__name__}): past {limit[0]} positions {limit[1]} by the longest "
                                f"sequence of a batch, so no batch of sequences up to this run's {longest} tokens "
                                f"computes what each sequence computes alone; keep prompt + response within {limit[0]} "
                                "tokens (data.max_length, rollout.max_new_tokens)")
    was_training = model.training
    model.train(was_training if train_mode is None else train_mode)
    report = PackingReport(lengths, None, None, 0, 0.0, False, mode="train" if model.training else "eval",
                           settings=settings)
    try:
        refs, why = _attempt(lambda: _alone(model, seqs))
        if refs is None:
            raise PackingCheckError(f"packing self-check failed for {where}: each sequence alone through the model's "
                                    f"own eager attention fails: {why}")
        report.padded_error, why = _attempt(lambda: _padded(model, seqs, lengths, refs))
        if report.padded_error is None or report.padded_error > tol:
            report.reasons["padded"] = (f"a right-padded forward through exactrl's attention fails ({why})" if why else
                                        f"right-padded batches through exactrl's attention differ from each sequence "
                                        f"alone by {report.padded_error:.3g}")
            _hand_to_own_attention(model, seqs, lengths, refs, report, policy, tol, where)
        elif padding_free and packing.can_pack(model):
            _try_packed(model, seqs, lengths, refs, report, unknown, tol, autocast)
    finally:
        model.train(was_training)
    report.seconds = time.perf_counter() - t0
    if not report.packed:
        packing.disable(model)
    _decide(model, report, padding_free, policy, where)
    return report


def _try_packed(model, seqs, lengths, refs, report: PackingReport, unknown: list[str], tol: float, autocast) -> None:
    """The packed rung: sets report.packed, or says in report.reasons why not."""
    if unknown:
        report.reasons["packed"] = (f"the config has length-shaped settings the check does not know how to exercise "
                                    f"({', '.join(unknown)})")
        return
    while True:  # a fast kernel that fails or disagrees is turned off, and the row runs again
        rows, report.packed_attention_calls, report.kernel, why = _packed(model, seqs, lengths)
        report.packed_error = None if rows is None else _error(rows, refs)
        if (why is None and report.packed_error <= tol) or not _fast(report.kernel):
            break
        _turn_off(model, report, _fast(report.kernel), f"fail ({why})" if why else
                  f"differ from each sequence alone by {report.packed_error:.3g} (train.packing_check_tol={tol:g})")
    if why is not None:
        report.reasons["packed"] = f"a packed forward fails ({why})"
    elif report.packed_attention_calls == 0:
        report.reasons["packed"] = ("its attention never called exactrl's packed attention (the model computes "
                                    "attention or carries state itself, e.g. ALiBi in Falcon and Bloom, linear "
                                    "attention and SSM layers), so each sequence of a row would see the ones before it")
    elif report.packed_error > tol:
        report.reasons["packed"] = (f"packed rows differ from each sequence alone by {report.packed_error:.3g} "
                                    f"(train.packing_check_tol={tol:g})")
    else:
        report.packed = True
        if autocast is not None:
            _check_fast(model, seqs, lengths, autocast, report)


def _turn_off(model, report: PackingReport, kernels: list[str], why: str) -> None:
    """Turn ``kernels`` off for ``model``: its packed rows step down to the next rung."""
    for kernel in kernels:
        report.turned_off[kernel] = f"its packed rows {why}"
    packing.use_kernels(model, off=packing.kernels_off(model) | set(kernels))


def _hand_to_own_attention(model, seqs, lengths, refs, report: PackingReport, policy: str, tol: float,
                           where: str) -> None:
    """The last rung, where exactrl's attention is wrong on padded batches too: the model's own
    Hugging Face attention, which must then agree (else PackingCheckError)."""
    if policy == "error":
        raise PackingCheckError(f"packing self-check failed for {where}: {report.reasons['padded']} "
                                f"(train.packing_check_tol={tol:g}); train.packing_check=fallback hands the model to "
                                "its own attention on padded batches")
    own = _own_attention(model)
    error, why = (None, "it has neither") if own is None else _attempt(lambda: _padded(model, seqs, lengths, refs))
    if error is None or error > tol:
        result = f"too: {why}" if why else f"they differ by {error:.3g}"
        raise PackingCheckError(f"packing self-check failed for {where}: {report.reasons['padded']}, and through the "
                                f"model's own {own or 'sdpa/eager'} attention {result} "
                                f"(train.packing_check_tol={tol:g})")
    report.padded_error, report.attention = error, f"hf {own}"


def _decide(model, report: PackingReport, padding_free: bool, policy: str, where: str) -> None:
    """The notice for the path the model steps down to, or (policy 'error') the stop."""
    why = report.reasons.get("padded") or (report.reasons.get("packed") if padding_free else None)
    if why is not None:
        if policy == "error":
            raise PackingCheckError(f"packing self-check failed for {where}: {why}; set train.padding_free=false")
        own = " through the model's own attention" if report.attention != "exactrl" else ""
        report.notice = (f"packing self-check: {where}: {why}; training on right-padded batches{own} instead "
                         "(train.padding_free ignored)")
    elif report.turned_off:
        why = "; ".join(f"{k}: {v}" for k, v in report.turned_off.items())
        if policy == "error":
            raise PackingCheckError(f"packing self-check failed for {where}: {why}; set model.packed_kernel=gather "
                                    "(or train.padding_free=false)")
        report.notice = f"packing self-check: {where}: {why}; packed rows run {report.kernel} instead"


def _check_fast(model, seqs, lengths, autocast, report: PackingReport) -> None:
    """Under the run's autocast: when the packed row engages a fast kernel, its largest
    difference from the same row through the gather path; one that fails or differs by more
    than BF16_TOL is turned off and the row runs again (the next rung may engage)."""
    with autocast():
        rows, _, kernel, why = _packed(model, seqs, lengths)
    if not _fast(kernel):
        return
    off = packing.kernels_off(model)
    packing.use_kernels(model, off=frozenset(varlen_kernels.FAST))
    try:
        with autocast():
            refs, _, gather, _ = _packed(model, seqs, lengths)
    finally:
        packing.use_kernels(model, off=off)
    if refs is None:  # the gather path fails under autocast too: nothing to compare with
        report.kernel = kernel
        return
    while _fast(kernel):
        error = None if rows is None else _error(rows, refs)
        if why is None and error <= BF16_TOL:
            report.kernel, report.fast_error = kernel, error
            return
        _turn_off(model, report, _fast(kernel), f"fail under the run's autocast ({why})" if why else
                  f"differ from the packed {gather} path under the run's autocast by {error:.3g} "
                  f"(allowed {BF16_TOL:g})")
        with autocast():
            rows, _, kernel, why = _packed(model, seqs, lengths)
    report.kernel = kernel
