"""The HF generation engine against a plain greedy decode loop without KV cache, against
Hugging Face's own ``generate``, and its log-probs against a training forward."""

from __future__ import annotations

import pytest
import torch

from exactrl.rollout.hf import HFEngine, sample


def boost_eos(model, tokenizer, by: float):
    """Add ``by`` to the EOS logit, so rows of one batch end at different steps and the
    engine's finished rows leave the batch mid-generation."""
    eos = tokenizer.eos_token_id

    def hook(_module, _inputs, logits):
        logits = logits.clone()
        logits[..., eos] += by
        return logits

    model.lm_head.register_forward_hook(hook)
    return model


def eos_from_position(model, tokenizer, position: int):
    """Make EOS certain for every token predicted at ``position`` or later (the position ids
    the forward was given, else 0, 1, ...): greedy rows with longer prompts end sooner."""
    eos = tokenizer.eos_token_id

    def hook(_module, _args, kwargs, output):
        pos = kwargs.get("position_ids")
        if pos is None:
            pos = torch.arange(kwargs["input_ids"].shape[1])[None]
        output.logits[..., eos] += 100.0 * (pos[:, -output.logits.shape[1]:] >= position)
        return output

    model.register_forward_hook(hook, with_kwargs=True)
    return model


def left_padded(tokenizer, prompts):
    width = max(map(len, prompts))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, attn, width


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


@pytest.mark.parametrize("eos_at", [None, 12])
def test_batched_cached_greedy_matches_naive_loop(tokenizer, make_model, eos_at):
    model = make_model(3).eval()
    if eos_at:
        eos_from_position(model, tokenizer, eos_at)
    # Prompts of different lengths, so the batch is left-padded.
    prompts = [tokenizer(t)["input_ids"] for t in ("1+2=", "345+678=", "9=", "12+34+56=", "7+7=", "81+9=", "3=", "60+5=")]
    gens = HFEngine(model, tokenizer, batch_size=5).generate(prompts, greedy=True, max_new_tokens=10)
    if eos_at:  # rows ended at several different steps, so rows left the batch while others ran
        assert len({len(g.response_ids) for g in gens if g.finished}) >= 3
    assert [g.prompt_index for g in gens] == list(range(8))
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


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_decode_loop_samples_what_generate_samples(tokenizer, make_model, top_p):
    """The engine's decode loop (its own sampler, KV cache written in place) against Hugging
    Face's generate (its warpers, the cache concatenated each step), finished rows kept in the
    batch as generate keeps them: the same seed draws the same tokens."""
    model = boost_eos(make_model(4).eval(), tokenizer, 2.0)
    prompts = [tokenizer(t)["input_ids"] for t in ("1+2=", "345+678=", "9=") for _ in range(2)]
    ids, attn, width = left_padded(tokenizer, prompts)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    torch.manual_seed(0)
    tokens, _ = sample(model, ids, attn, max_new_tokens=12, eos=eos, pad=pad, temperature=0.9, top_p=top_p, compact_at=float("inf"))
    torch.manual_seed(0)
    seqs = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=12, do_sample=True, temperature=0.9, top_p=top_p, top_k=0,
                          pad_token_id=pad, eos_token_id=eos)
    ref = seqs[:, width:]
    assert torch.equal(tokens[:, : ref.shape[1]], ref) and (tokens[:, ref.shape[1]:] == pad).all()
    assert len({row.index(eos) for row in ref.tolist() if eos in row}) >= 2  # rows ended at different steps


def test_sampled_logprobs_match_a_training_forward_as_rows_leave_the_batch(tokenizer, make_model):
    """Rows ending at different steps leave the batch and its cache; every token drawn after
    that must still come from its own row's context: its recorded log-prob against a full
    forward of prompt + response, with no cache and no padding."""
    model = boost_eos(make_model(5).eval(), tokenizer, 2.0)
    prompts = [tokenizer(t)["input_ids"] for t in ("1+2=", "345+678=", "9=", "12+34=")]
    torch.manual_seed(1)
    gens = HFEngine(model, tokenizer, batch_size=16).generate(prompts, n=4, temperature=0.7, max_new_tokens=14)
    assert len({len(g.response_ids) for g in gens}) >= 4
    with torch.no_grad():
        for g in gens:
            logits = model(input_ids=torch.tensor([g.prompt_ids + g.response_ids])).logits[0, len(g.prompt_ids) - 1 : -1]
            ref = torch.log_softmax(logits / 0.7, -1).gather(1, torch.tensor(g.response_ids)[:, None])[:, 0]
            assert (torch.tensor(g.logprobs) - ref).abs().max() < 1e-5
