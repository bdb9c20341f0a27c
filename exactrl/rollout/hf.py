"""Generation with Hugging Face ``generate`` (KV cache, batched sampling): the CPU default engine."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Generation:
    prompt_index: int  # which prompt of the request this answers
    prompt_ids: list[int]
    response_ids: list[int]  # up to and including EOS when the model stopped by itself
    text: str  # decoded response without special tokens
    finished: bool  # True when the model emitted EOS within max_new_tokens


class HFEngine:
    """Samples ``n`` responses per prompt with the trainer's own model object (so there are no
    weights to sync on one CPU process), left-padding prompts as ``generate`` expects.

    ``synced``: the model's parameters are sharded over ranks (FSDP2, ZeRO-3), so every rank
    must take part in every forward: generate's ``synced_gpus`` keeps a rank whose responses
    have all ended stepping until every rank's have. Every rank must then make as many calls
    with as many requests."""

    def __init__(self, model, tokenizer, batch_size: int, synced: bool = False):
        self.model, self.tok, self.batch_size, self.synced = model, tokenizer, batch_size, synced

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], n: int = 1, *, greedy: bool = False, temperature: float = 1.0,
                 top_p: float = 1.0, max_new_tokens: int = 48) -> list[Generation]:
        requests = [(i, ids) for i, ids in enumerate(prompt_ids) for _ in range(n)]
        was_training = self.model.training
        self.model.eval()
        out: list[Generation] = []
        try:
            for start in range(0, len(requests), self.batch_size):
                out += self._generate_batch(requests[start : start + self.batch_size], greedy, temperature, top_p, max_new_tokens)
        finally:
            self.model.train(was_training)
        return out

    def _generate_batch(self, requests, greedy, temperature, top_p, max_new_tokens) -> list[Generation]:
        pad, eos = self.tok.pad_token_id, self.tok.eos_token_id
        width = max(len(ids) for _, ids in requests)
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for _, ids in requests])
        attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in requests])
        sampling = {} if greedy else {"temperature": temperature, "top_p": top_p, "top_k": 0}
        seqs = self.model.generate(
            input_ids=input_ids, attention_mask=attention, max_new_tokens=max_new_tokens, do_sample=not greedy,
            pad_token_id=pad, eos_token_id=eos, use_cache=True, synced_gpus=self.synced, **sampling,
        )
        out = []
        for (idx, ids), row in zip(requests, seqs[:, width:].tolist()):
            finished = eos in row
            response = row[: row.index(eos) + 1] if finished else row
            out.append(Generation(idx, ids, response, self.tok.decode(response, skip_special_tokens=True), finished))
        return out
