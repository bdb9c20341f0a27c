"""Padding-free forward passes: a micro-batch's sequences laid end to end in one row.

Every layer of a decoder except attention works token by token, so on a packed row the
projections, MLPs and norms run on exactly the real tokens (a padded batch spends the same
matmuls on its pad positions: a quarter of an SFT step on the built-in data). Two things
keep the packed forward equal to the padded one:

* position ids restart at 0 for each sequence (rotary embeddings see the same positions);
* attention stays within each sequence: ``varlen_attention`` gathers each sequence's
  queries, keys and values into a right-padded [sequences, heads, longest, dim] block and
  runs causal attention on it -- with the layer's sliding window and logit softcapping when
  it has them. Under a causal mask a real query never sees a pad key, pad queries are
  dropped, so no pad contributes to any output or gradient. On CUDA a fast kernel takes the
  packed row as it is instead, where one can take the layer: flash-attention's varlen kernel
  (the ``flash-attn`` extra), torch's varlen_attn, flex_attention with a mask by sequence
  (exactrl/models/varlen_kernels.py).

Models whose attention never calls the registered function (Falcon, Bloom: ALiBi) cannot be
packed this way; the packing self-check (exactrl/checks/packing.py) finds them, and every other
disagreement, before the first step. Per-target results (log-probs, entropies, values) come
back to the padded [B, L-1] layout the losses, masks and normalisers use (``ModelBatch.repad``),
so everything after the forward is the same code on both paths; tests/test_packing.py and
tests/test_arch_matrix.py hold them equal.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from exactrl.data.batching import pad_right
from exactrl.device import device_of, to_device
from exactrl.models import dsa, varlen_kernels

# One registered name per attention kernel (model.attn_implementation); both take packed rows.
KERNELS = {"sdpa": "exactrl_varlen", "eager": "exactrl_varlen_eager"}


class PackingUnsupported(RuntimeError):
    """The model cannot run packed rows (its attention ignores the registered function)."""


def eager_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                    is_causal: bool | None = None, softcap: float | None = None, s_aux: torch.Tensor | None = None,
                    **kwargs):
    """Attention written out (Hugging Face's eager path, for any decoder): scores, softcap,
    mask, fp32 softmax (over the keys and, with ``s_aux``, one sink logit per head that takes
    probability mass and contributes no value: gpt-oss), dropout. ``attention_mask``: boolean
    (True = attend), additive float, or None (causal when there are several queries). Returns
    [B, Q, H, D] and the weights."""
    n_rep = query.shape[1] // key.shape[1]  # grouped- or multi-query attention
    if n_rep > 1:
        key, value = key.repeat_interleave(n_rep, 1), value.repeat_interleave(n_rep, 1)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    q_len, kv_len = scores.shape[-2:]
    if attention_mask is None and q_len > 1 and (is_causal if is_causal is not None else getattr(
        module, "is_causal", True)):
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=scores.device).tril(kv_len - q_len)
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask[..., :kv_len]
    at_least_fp32 = torch.promote_types(scores.dtype, torch.float32)  # a float64 model keeps float64
    if s_aux is not None:
        sinks = s_aux.reshape(1, -1, 1, 1).to(scores.dtype).expand(*scores.shape[:-1], 1)
        weights = torch.softmax(torch.cat([scores, sinks], -1), dim=-1, dtype=at_least_fp32)[..., :-1].to(query.dtype)
    else:
        weights = torch.softmax(scores, dim=-1, dtype=at_least_fp32).to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=dropout > 0)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def _kernel(module, kwargs):
    """SDPA unless the model asked for eager or the layer needs what SDPA cannot do: logit
    softcapping (Gemma2) or attention sinks (gpt-oss)."""
    eager = (kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None
             or module.config._attn_implementation == KERNELS["eager"])
    return eager_attention if eager else sdpa_attention_forward


def _layer_type(module) -> str | None:
    types = getattr(module.config, "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    return types[idx] if types is not None and idx is not None and idx < len(types) else None


def _chunk(module) -> int | None:
    """The attention chunk of a chunked-attention layer (Llama 4: a query sees only the keys of
    its own chunk of ``attention_chunk_size`` positions)."""
    size = getattr(module.config, "attention_chunk_size", None)
    return size if size and _layer_type(module) == "chunked_attention" else None


def _window(module, sliding_window) -> int | None:
    """The layer's sliding window: as the layer passes it, else from its layer type."""
    if sliding_window is None and _layer_type(module) == "sliding_attention":
        sliding_window = getattr(module.config, "sliding_window", None)
    return sliding_window


def _index_mask(attention_mask, indices: torch.Tensor, kv_len: int):
    """DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): each query attends only to the keys its
    indexer picked ([B, Q, topk]), within what ``attention_mask`` allows -- as Hugging Face's
    eager/SDPA path of the model builds it."""
    picked = torch.zeros(*indices.shape[:2], kv_len, dtype=torch.bool, device=indices.device)
    picked = picked.scatter(-1, indices.long(), True).unsqueeze(1)  # [B, 1, Q, K]
    if attention_mask is None:
        return picked
    if attention_mask.dtype == torch.bool:
        return attention_mask & picked
    return attention_mask.masked_fill(~picked, torch.finfo(attention_mask.dtype).min)


def _nope_temperature(module, query, attention_mask, cu_seq_lens):
    """Llama 4's NoPE layers scale queries by a temperature of the query's position (arXiv
    2501.19399), which Hugging Face computes from the position in the *row*: in a packed row or
    behind left padding that is not the position in the sequence. Rescale to the sequence's
    position: in a packed row it restarts at each sequence; behind a mask it is the number of
    keys the query sees, less one (these are full-attention layers)."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return query
    q_len, device = query.shape[2], query.device
    row = torch.arange(q_len, device=device)
    if cu_seq_lens is not None:
        starts = torch.zeros(q_len, dtype=torch.long, device=device)
        starts[cu_seq_lens[1:-1].long()] = cu_seq_lens[1:-1].long() - cu_seq_lens[:-2].long()
        true = (row - starts.cumsum(0))[None]  # [1, Q]
        applied = row[None]
    elif attention_mask is not None:
        seen = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        true = seen[:, 0].sum(-1).long() - 1  # [B, Q]
        applied = row[None] + (attention_mask.shape[-1] - q_len)  # the cache's past length, as HF adds it
    else:
        return query
    def scale(p):
        return torch.log1p(torch.floor((p.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0
    # Where the positions agree the factor is exactly 1 and the query keeps its bits; no host sync
    # to find out (this runs in every decode step of a NoPE layer).
    factor = scale(true) / scale(applied)
    return query * factor[:, None, :, None].to(query.dtype)


# Packed calls seen since the counter was last read: a packed forward that made none never
# reached varlen_attention, so its attention ran across the sequences of the row. The kernels
# those calls ran, by name, for the self-check's report.
packed_calls = 0
packed_kernels: Counter[str] = Counter()


# Eager under train.compile (exactrl/distributed/compile.py): a dispatcher with counters and
# per-row index gathers, around kernels that are fused already.
@torch.compiler.disable
def varlen_attention(module, query, key, value, attention_mask, *, cu_seq_lens_q=None, max_length_q=None,
                     sliding_window=None, softcap=None, indices=None, **kwargs):
    """Attention, or per-sequence causal attention on a packed row when ``cu_seq_lens_q`` (the
    cumulative sequence lengths, as flash-attention's varlen kernels take them) is given. Applies
    what the layer's own attention applies: its sliding window or attention chunk, logit softcap,
    attention sinks (``s_aux``), sparse-attention indices, and Llama 4's NoPE temperature."""
    if softcap is not None:
        kwargs["softcap"] = softcap
    kernel = _kernel(module, kwargs)
    query = _nope_temperature(module, query, attention_mask, cu_seq_lens_q)
    if cu_seq_lens_q is None:  # the mask Hugging Face built already holds any window or chunk
        if indices is not None:
            attention_mask = _index_mask(attention_mask, indices, key.shape[2])
        return kernel(module, query, key, value, attention_mask, **kwargs)
    if indices is not None:
        raise PackingUnsupported("sparse-attention indices picked over a packed row cross its sequences")
    global packed_calls
    packed_calls += 1
    window, chunk = _window(module, sliding_window), _chunk(module)
    if module.config._attn_implementation != KERNELS["eager"]:  # an explicit eager stays eager
        fast = varlen_kernels.attend(module, query, key, value, cu_seq_lens_q, int(max_length_q), window, chunk,
                                     softcap, kwargs.get("scaling"), kwargs.get("dropout", 0.0),
                                     kwargs.get("s_aux") is not None)
        if fast is not None:
            packed_kernels[fast[0]] += 1
            return fast[1], None
    packed_kernels["eager varlen" if kernel is eager_attention else "sdpa varlen"] += 1
    width = int(max_length_q)
    gather, keep = _gather_index(cu_seq_lens_q, width, query.shape[2])
    # [1, H, N, D] -> [S, H, Lmax, D]: each sequence in its own row, right-padded. index_select
    # (its backward is index_add) rather than advanced indexing (index_put with accumulate):
    # that gather and its inverse were a third of the attention time of a GRPO micro-batch.
    q, k, v = (t[0].index_select(1, gather).unflatten(1, (-1, width)).transpose(0, 1) for t in (query, key, value))
    mask = window_mask(width, window, query.device, chunk)
    out, _ = kernel(module, q, k, v, mask, is_causal=mask is None, **kwargs)  # [S, Lmax, H, D]
    return out.flatten(0, 1).index_select(0, keep).unsqueeze(0), None  # [1, N, H, D]


def use_kernels(model, setting: str | None = None, off: frozenset[str] | None = None) -> None:
    """Which fast packed kernels ``model``'s packed forwards may run (varlen_kernels.attend):
    ``setting`` (model.packed_kernel: auto, one kernel, or gather) and the kernels the self-check
    turned ``off``. Flags on every submodule, the attention layers among them, so the model's
    config (saved with it) stays as it was."""
    for module in _hf_model(model).modules():
        if setting is not None:
            module.exactrl_packed_kernel = setting
        if off is not None:
            module.exactrl_kernels_off = off


def kernels_off(model) -> frozenset[str]:
    """The fast packed kernels the self-check turned off for ``model``."""
    return getattr(_hf_model(model), "exactrl_kernels_off", frozenset())


def window_mask(width: int, window: int | None, device=None, chunk: int | None = None) -> torch.Tensor | None:
    """Causal mask [width, width] that also hides keys ``window`` or more positions back
    (Hugging Face's sliding_window_overlay: key j is seen from query i when i - window < j <= i)
    and keys of another ``chunk`` (chunked_overlay: i // chunk == j // chunk); None when neither
    is narrower than the block (plain causal attention)."""
    window = window if window is not None and window < width else None
    chunk = chunk if chunk is not None and chunk < width else None
    if window is None and chunk is None:
        return None
    i = torch.arange(width, device=device)
    back = i[:, None] - i[None, :]
    mask = back >= 0
    if window is not None:
        mask &= back < window
    if chunk is not None:
        mask &= (i[:, None] // chunk) == (i[None, :] // chunk)
    return mask


# One packed row's gather indices, per (width, tokens): every layer of a forward (and its
# recomputation under checkpointing) passes the same cumulative-lengths tensor.
_gathers: dict = {}


def _gather_index(cu: torch.Tensor, width: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices: which packed token fills each slot of the [S, width] block, and which
    block slot each of the row's ``n`` packed tokens fills (the real ones, in packed order).
    Computed on the device from the lengths alone, once per row: a ``nonzero`` of the valid
    slots would make the host wait for the device in every layer (exactrl/checks/syncs.py)."""
    if _gathers.get("cu") is not cu:
        _gathers.clear()
        _gathers["cu"] = cu
    if (width, n) not in _gathers:
        starts = cu.long()
        lengths = starts[1:] - starts[:-1]
        pos = torch.arange(width, device=cu.device)
        valid = pos[None, :] < lengths[:, None]
        # Pad slots read the sequence's own first token; only pad queries ever look at them.
        gather = torch.where(valid, starts[:-1, None] + pos[None, :], starts[:-1, None]).flatten()
        tokens = torch.arange(n, device=cu.device)
        seq = torch.searchsorted(starts[1:], tokens, right=True)  # each token's sequence
        _gathers[width, n] = gather, seq * width + tokens - starts[seq]
    return _gathers[width, n]


def known_mask(*args, attention_mask=None, **kwargs):
    """Hugging Face's SDPA mask, told what the host knows of ``model_batch``'s 2D mask (marked
    ``exactrl_padded``): the builder would read the mask to find out whether any row is padded
    (transformers' _ignore_causal_mask_sdpa), and the host would wait for the device in every
    forward. No padding: no mask, which builds what one of all ones builds (a packed row's,
    which ``varlen_attention`` ignores anyway); padding: the mask, without the look."""
    padded = getattr(attention_mask, "exactrl_padded", None)
    if padded is False:
        attention_mask = None
    elif padded:
        kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


for _name in KERNELS.values():
    AttentionInterface.register(_name, varlen_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(_name, known_mask)


def enable(model: torch.nn.Module, kernel: str = "sdpa") -> torch.nn.Module:
    """Route ``model``'s attention (a Hugging Face decoder) through ``varlen_attention`` with
    ``kernel`` (sdpa or eager); unpacked inputs run that kernel with Hugging Face's own mask.
    Sparse attention's indexers keep the earliest of tied keys, whatever the layout (dsa.py)."""
    model.set_attn_implementation(KERNELS[kernel])
    dsa.break_ties_by_position(model)
    return model


def can_pack(model) -> bool:
    """False once the self-check has turned packing off for this model."""
    return getattr(_hf_model(model), "exactrl_packing", True)


def disable(model) -> None:
    """Padded batches from now on for ``model`` (its packed forward is wrong or unsupported)."""
    _hf_model(model).exactrl_packing = False


# Train-mode noise that a setting switches off, as dropout's rate does: multiplicative jitter on
# MoE routers' inputs (Mixtral and MiniMax: jitter_noise; Phi-3.5-MoE: input_jitter_noise; Switch).
NOISE_RATES = ("jitter_noise", "input_jitter_noise")


def disable_dropout(model: torch.nn.Module) -> int:
    """Set every dropout probability in ``model`` to 0, as RL and preference trainers do (TRL's
    disable_dropout): a policy in train mode must compute the log-probs the generator (eval
    mode) sampled with, and a verified step needs a deterministic forward. Covers nn.Dropout
    modules, the float rates layers pass to their kernels (``attention_dropout``, ``layerdrop``)
    and the routers' train-mode input jitter (NOISE_RATES). Randomness no setting turns off
    (Phi-3.5-MoE's sampled routing) is what exactrl/checks/determinism.py finds.
    Returns how many rates were non-zero."""
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            changed += module.p > 0
            module.p = 0.0
        for name, value in vars(module).items():
            rate = "dropout" in name or "layerdrop" in name or name in NOISE_RATES
            if rate and isinstance(value, float) and not isinstance(value, bool):
                changed += value > 0
                setattr(module, name, 0.0)
    return changed


def _hf_model(model):
    """The Hugging Face model inside an engine's wrapper (DeepSpeed keeps it as ``.module``)."""
    return model if hasattr(model, "set_attn_implementation") else getattr(model, "module", model)


def base_model(model):
    """The Hugging Face model inside an engine's or peft's wrapper."""
    hf = _hf_model(model)
    get = getattr(hf, "get_base_model", None)
    return get() if callable(get) else hf


@dataclass
class ModelBatch:
    """The model inputs of one micro-batch, padded or packed, and how its per-target results
    ([rows, positions - 1], as token_logprobs returns them) map to the padded [B, L-1] layout."""

    inputs: dict[str, torch.Tensor]
    targets: tuple[torch.Tensor, torch.Tensor] | None = None  # packed: (flat index, valid) per [B, L-1] slot

    def repad(self, per_target: torch.Tensor) -> torch.Tensor:
        if self.targets is None:
            return per_target
        index, valid = self.targets
        flat = per_target[0]  # [targets] or [targets, k] (a field with a last dimension: logits, top-k)
        return torch.where(valid.view(*valid.shape, *(1,) * (flat.dim() - 1)), flat[index], flat.new_zeros(()))


def model_batch(model, seqs: list[list[int]], pad_id: int, packed: bool) -> ModelBatch:
    """Inputs of ``model`` for ``seqs``, on the model's device: right-padded with an attention
    mask, or (``packed``, and the model can pack) one row with per-sequence position ids and the
    cumulative lengths ``varlen_attention`` reads."""
    lengths = [len(s) for s in seqs]
    device = device_of(model)
    if not packed or not can_pack(model):
        # Boolean, as Hugging Face's mask builder takes it: the same tensor reaches known_mask, marked.
        attn = to_device(pad_right([[1] * n for n in lengths], 0).bool(), device)
        attn.exactrl_padded = len(set(lengths)) > 1
        return ModelBatch({"input_ids": to_device(pad_right(seqs, pad_id), device), "attention_mask": attn,
                           "use_cache": False})
    hf = _hf_model(model)
    if hf.config._attn_implementation not in KERNELS.values():
        enable(hf)  # models not loaded through exactrl.models.loading
    n = sum(lengths)
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    inputs = {
        "input_ids": torch.tensor([[t for s in seqs for t in s]], dtype=torch.long),
        "position_ids": torch.cat([torch.arange(n_) for n_ in lengths]).unsqueeze(0),
        # All ones: SDPA's mask builder then skips the N x N mask that varlen_attention would ignore
        # (boolean, as the builder takes it: the same tensor reaches known_mask, marked).
        "attention_mask": torch.ones(1, n, dtype=torch.bool),
        "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
    }
    inputs = {k: to_device(v, device) for k, v in inputs.items()}
    inputs["attention_mask"].exactrl_padded = False
    inputs |= {"max_length_q": max(lengths), "max_length_k": max(lengths),
               "use_cache": False}  # a training forward: no KV cache to fill
    # Target t of sequence s (predicting its token t+1) sits at flat position cu[s] + t.
    width = max(lengths) - 1
    pos = torch.arange(width)
    valid = pos[None, :] < torch.tensor(lengths)[:, None] - 1
    index = torch.where(valid, cu[:-1, None].long() + pos[None, :], 0)
    return ModelBatch(inputs, (to_device(index, device), to_device(valid, device)))
