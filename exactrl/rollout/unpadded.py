"""Decoding without left padding: the prompts of a batch grouped by length, each group decoded
as a batch of its own, so no row carries a pad.

For models whose batched decoding goes wrong behind left padding while each prompt alone is
right. MiniMax-01 is one: its cache reports the sequence length of layer 0, a lightning-attention
layer that holds no keys, so from the first decode step on the softmax layers' mask is built as
if nothing came before, and a left-padded row's pad columns decide what it attends to (Hugging
Face's ``generate`` diverges at the first new token; prompts without padding need no mask). The
generation self-check (exactrl/rollout/generation_check.py) hands a model here when its left-padded
decoding disagrees with each prompt decoded alone. Sampling stays keyed by each row's seed, so a
row draws the same tokens in any group.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _lengths_of_every_rank(lengths: list[int], synced: bool) -> list[int]:
    """The prompt lengths to decode, in order: this rank's, or (parameters sharded over ranks,
    where every rank must take part in every forward) those of all ranks."""
    if not synced:
        return sorted(set(lengths))
    every: list[list[int]] = [None] * torch.distributed.get_world_size()  # type: ignore[list-item]
    torch.distributed.all_gather_object(every, sorted(set(lengths)))
    return sorted({n for rank in every for n in rank})


def by_prompt_length(decode: Callable, model, input_ids: torch.Tensor, attention: torch.Tensor, *,
                     max_new_tokens: int, pad: int, seeds: list[int] | None = None, synced: bool = False,
                     **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``decode`` (exactrl/rollout/hf.py's ``sample`` contract) on left-padded ``input_ids``, one
    call per prompt length, each without padding; tokens [rows, max_new_tokens] and log-probs
    (None when greedy) back in the rows' order. ``synced``: every rank makes one call per length
    found on any rank, a rank without such prompts decoding a stand-in row it discards."""
    lengths = attention.sum(-1)
    tokens = torch.full((len(input_ids), max_new_tokens), pad, dtype=torch.long, device=input_ids.device)
    logprobs = None
    for n in _lengths_of_every_rank(lengths.tolist(), synced):
        rows = (lengths == n).nonzero()[:, 0]
        if len(rows):
            ids, mask = input_ids[rows, input_ids.shape[1] - n:], attention[rows, input_ids.shape[1] - n:]
            keys = None if seeds is None else [seeds[r] for r in rows.tolist()]
        else:  # this rank steps alongside the ranks that have prompts of n tokens
            ids = torch.full((1, n), pad, dtype=torch.long, device=input_ids.device)
            mask, keys = torch.ones_like(ids), None if seeds is None else [0]
        got, lp = decode(model, ids, mask, max_new_tokens=max_new_tokens, pad=pad, seeds=keys, synced=synced,
                         **kwargs)
        if not len(rows):
            continue
        tokens[rows] = got
        if lp is not None:
            logprobs = torch.zeros(tokens.shape, device=lp.device) if logprobs is None else logprobs
            logprobs[rows] = lp
    return tokens, logprobs
