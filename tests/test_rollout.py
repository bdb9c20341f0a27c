"""The HF generation engine against a plain greedy decode loop without KV cache."""

from __future__ import annotations

import torch

from exactrl.rollout.hf import HFEngine


def naive_greedy(model, prompt: list[int], eos: int, max_new: int) -> list[int]:
    """Full forward pass per token, no cache, no padding: the independent reference."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new):
            nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            out.append(nxt)
            ids.append(nxt)
            if nxt == eos:
                break
    return out


def test_batched_cached_greedy_matches_naive_loop(tokenizer, make_model):
    model = make_model(3).eval()
    # Prompts of different lengths, so the batch is left-padded.
    prompts = [tokenizer(t)["input_ids"] for t in ("1+2=", "345+678=", "9=", "12+34+56=")]
    gens = HFEngine(model, tokenizer, batch_size=3).generate(prompts, greedy=True, max_new_tokens=10)
    assert [g.prompt_index for g in gens] == [0, 1, 2, 3]
    for g, p in zip(gens, prompts):
        ref = naive_greedy(model, p, tokenizer.eos_token_id, 10)
        assert g.response_ids == ref
        assert g.finished == (tokenizer.eos_token_id in ref)
        assert g.text == tokenizer.decode(ref, skip_special_tokens=True)


def test_responses_stop_at_eos_and_groups_are_ordered(tokenizer, make_model):
    model = make_model(4)
    # Make EOS overwhelmingly likely after 2 tokens by construction: bias the LM head.
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.model.embed_tokens.weight  # tied: zeroing lm_head zeroes embeddings too
    eos = tokenizer.eos_token_id
    prompts = [tokenizer("1+1=")["input_ids"], tokenizer("22+22=")["input_ids"]]
    torch.manual_seed(0)
    gens = HFEngine(model, tokenizer, batch_size=8).generate(prompts, n=3, temperature=1.0, max_new_tokens=6)
    assert [g.prompt_index for g in gens] == [0, 0, 0, 1, 1, 1]
    for g in gens:
        # Uniform next-token distribution: EOS may or may not come; if it does, nothing follows it.
        if eos in g.response_ids:
            assert g.response_ids.index(eos) == len(g.response_ids) - 1 and g.finished
        else:
            assert len(g.response_ids) == 6 and not g.finished
    assert model.training, "generate() must restore the model's training mode"


def test_preallocated_cache_samples_what_the_default_cache_samples(tokenizer, make_model):
    """The engine's KV cache (written in place) against generate's own (concatenated each step):
    the same seed draws the same tokens."""
    model = make_model(4).eval()
    prompts = [tokenizer(t)["input_ids"] for t in ("1+2=", "345+678=", "9=")]
    torch.manual_seed(0)
    gens = HFEngine(model, tokenizer, batch_size=6).generate(prompts, n=2, temperature=1.0, max_new_tokens=12)
    width = max(map(len, prompts))
    requests = [p for p in prompts for _ in range(2)]
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in requests])
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in requests])
    torch.manual_seed(0)
    seqs = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=12, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                          pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    eos = tokenizer.eos_token_id
    for g, row in zip(gens, seqs[:, width:].tolist()):
        assert g.response_ids == (row[: row.index(eos) + 1] if eos in row else row)
