"""Padding-free forward passes: a micro-batch's sequences laid end to end in one row.

Every layer of a decoder except attention works token by token, so on a packed row the
projections, MLPs and norms run on exactly the real tokens (a padded batch spends the same
matmuls on its pad positions: a quarter of an SFT step on the built-in data). Two things
keep the packed forward equal to the padded one:

* position ids restart at 0 for each sequence (rotary embeddings see the same positions);
* attention stays within each sequence: ``varlen_attention`` gathers each sequence's
  queries, keys and values into a right-padded [sequences, heads, longest, dim] block and
  runs causal SDPA on it. Under a causal mask a real query never sees a pad key, pad queries
  are dropped, so no pad contributes to any output or gradient.

Per-target results (log-probs, entropies, values) come back to the padded [B, L-1] layout
the losses, masks and normalisers use (``ModelBatch.repad``), so everything after the
forward is the same code on both paths; tests/test_packing.py holds them equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from exactrl.data.batching import pad_right

ATTENTION = "exactrl_varlen"


def varlen_attention(module, query, key, value, attention_mask, *, cu_seq_lens_q=None, max_length_q=None, **kwargs):
    """SDPA, or per-sequence causal SDPA on a packed row when ``cu_seq_lens_q`` (the cumulative
    sequence lengths, as flash-attention's varlen kernels take them) is given."""
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    width = int(max_length_q)
    gather, keep = _gather_index(cu_seq_lens_q, width)
    # [1, H, N, D] -> [S, H, Lmax, D]: each sequence in its own row, right-padded. index_select
    # (its backward is index_add) rather than advanced indexing (index_put with accumulate):
    # that gather and its inverse were a third of the attention time of a GRPO micro-batch.
    q, k, v = (t[0].index_select(1, gather).unflatten(1, (-1, width)).transpose(0, 1) for t in (query, key, value))
    out, _ = sdpa_attention_forward(module, q, k, v, None, is_causal=True, **kwargs)  # [S, Lmax, H, D]
    return out.flatten(0, 1).index_select(0, keep).unsqueeze(0), None  # [1, N, H, D]


def _gather_index(cu: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices: which packed token fills each slot of the [S, width] block, and which
    block slots hold real tokens, in packed order."""
    lengths = cu[1:] - cu[:-1]
    pos = torch.arange(width, device=cu.device)
    valid = pos[None, :] < lengths[:, None]
    # Pad slots read the sequence's own first token; only pad queries ever look at them.
    gather = torch.where(valid, cu[:-1, None] + pos[None, :], cu[:-1, None]).flatten()
    return gather, valid.flatten().nonzero()[:, 0]


AttentionInterface.register(ATTENTION, varlen_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)


def enable(model: torch.nn.Module) -> torch.nn.Module:
    """Let ``model`` (a Hugging Face decoder) take packed rows; unpacked inputs still run SDPA."""
    model.set_attn_implementation(ATTENTION)
    return model


def _hf_model(model):
    """The Hugging Face model inside an engine's wrapper (DeepSpeed keeps it as ``.module``)."""
    return model if hasattr(model, "set_attn_implementation") else getattr(model, "module", model)


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
        flat = per_target[0]
        return torch.where(valid, flat[index], flat.new_zeros(()))


def model_batch(model, seqs: list[list[int]], pad_id: int, packed: bool) -> ModelBatch:
    """Inputs of ``model`` for ``seqs``: right-padded with an attention mask, or (``packed``) one
    row with per-sequence position ids and the cumulative lengths ``varlen_attention`` reads."""
    lengths = [len(s) for s in seqs]
    if not packed:
        attn = pad_right([[1] * n for n in lengths], 0)
        return ModelBatch({"input_ids": pad_right(seqs, pad_id), "attention_mask": attn, "use_cache": False})
    hf = _hf_model(model)
    if getattr(hf.config, "_attn_implementation", None) != ATTENTION:
        enable(hf)  # models not loaded through exactrl.models.loading
    n = sum(lengths)
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    inputs = {
        "input_ids": torch.tensor([[t for s in seqs for t in s]], dtype=torch.long),
        "position_ids": torch.cat([torch.arange(n_) for n_ in lengths]).unsqueeze(0),
        # All ones: SDPA's mask builder then skips the N x N mask that varlen_attention would ignore.
        "attention_mask": torch.ones(1, n, dtype=torch.long),
        "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lengths), "max_length_k": max(lengths),
        "use_cache": False,  # a training forward: no KV cache to fill
    }
    # Target t of sequence s (predicting its token t+1) sits at flat position cu[s] + t.
    width = max(lengths) - 1
    pos = torch.arange(width)
    valid = pos[None, :] < torch.tensor(lengths)[:, None] - 1
    index = torch.where(valid, cu[:-1, None].long() + pos[None, :], 0)
    return ModelBatch(inputs, (index, valid))
