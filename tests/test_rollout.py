"""The HF generation engine against a plain greedy decode loop without KV cache, against
Hugging Face's own ``generate``, and its log-probs against a training forward."""

from __future__ import annotations

import pytest
import torch

from exactrl.rollout.hf import HFEngine, sample, sample_with_generate, use_generate


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
    prompts = [tokenizer(t)["input_ids"] for t in ("1+2=", "345+678=", "9=", "12+34+56=", "7+7=", "81+9=", "3=",
                                                   "60+5=")]
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
        model.lm_head.weight.zero_()  # tied: this zeroes the embeddings too
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


@pytest.mark.parametrize("top_p,top_k", [(1.0, 0), (0.8, 0), (1.0, 5), (0.9, 5)])
def test_decode_loop_samples_what_generate_samples(tokenizer, make_model, top_p, top_k):
    """The engine's decode loop (its own sampler, KV cache written in place, finished rows
    leaving the batch) against Hugging Face's generate (its cache concatenated each step, rows
    kept) with the keyed draw as a logits processor: the same seeds draw the same tokens, and
    the log-probs agree."""
    model = boost_eos(make_model(4).eval(), tokenizer, 2.0)
    prompts = [tokenizer(t)["input_ids"] for t in ("1+2=", "345+678=", "9=") for _ in range(2)]
    ids, attn, _ = left_padded(tokenizer, prompts)
    eos = tokenizer.eos_token_id
    kw = {"max_new_tokens": 12, "eos": eos, "pad": tokenizer.pad_token_id, "temperature": 0.9, "top_p": top_p,
          "top_k": top_k, "seeds": [3, 1, 4, 1, 5, 9]}
    tokens, lp = sample(model, ids, attn, compact_at=0.0, **kw)
    ref, ref_lp = sample_with_generate(model, ids, attn, **kw)
    assert torch.equal(tokens, ref) and (lp - ref_lp).abs().max() < 1e-5
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
            logits = model(input_ids=torch.tensor([g.prompt_ids + g.response_ids])).logits[0, len(
                g.prompt_ids) - 1 : -1]
            ref = torch.log_softmax(logits / 0.7, -1).gather(1, torch.tensor(g.response_ids)[:, None])[:, 0]
            assert (torch.tensor(g.logprobs) - ref).abs().max() < 1e-5


def test_top_k_draws_only_among_the_k_most_likely_and_logs_the_uncut_log_prob(tokenizer, make_model):
    """Every token sampled with top_k=3 is among the 3 highest logits of an independent full
    forward (no cache, no padding), and its recorded log-prob is that forward's at the
    temperature over the whole vocabulary (the convention the loss and the on-policy check
    use). At temperature 3 the same draws without top-k leave the top 3 often."""
    model = make_model(7).eval()
    prompts = [tokenizer(t)["input_ids"] for t in ("1+2=", "345+678=", "9=", "12+34=")]
    outside = {}
    for top_k in (3, 0):
        torch.manual_seed(0)
        gens = HFEngine(model, tokenizer, batch_size=16).generate(prompts, n=4, temperature=3.0, top_k=top_k,
                                                                  max_new_tokens=12)
        outside[top_k] = 0
        with torch.no_grad():
            for g in gens:
                logits = model(input_ids=torch.tensor([g.prompt_ids + g.response_ids])).logits[0, len(
                    g.prompt_ids) - 1 : -1]
                picked = torch.tensor(g.response_ids)
                in_top = (torch.topk(logits, 3).indices == picked[:, None]).any(-1)
                outside[top_k] += int((~in_top).sum())
                ref = torch.log_softmax(logits / 3.0, -1).gather(1, picked[:, None])[:, 0]
                assert (torch.tensor(g.logprobs) - ref).abs().max() < 1e-5
    assert outside[3] == 0 and outside[0] > 10


def force_text(model, tokenizer, prompt_len: int, text: str) -> list:
    """Make the tokens of ``text`` (then EOS) certain, one per step after prompts of
    ``prompt_len`` tokens (positions 0, 1, ... as no row is padded). Returns the list the
    hook appends to at every forward."""
    forced = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    forwards = []

    def hook(_module, _args, kwargs, output):
        forwards.append(1)
        pos = kwargs.get("position_ids")
        if pos is None:
            pos = torch.arange(kwargs["input_ids"].shape[1])[None]
        step = pos[:, -output.logits.shape[1]:] - (prompt_len - 1)
        for i, token in enumerate(forced):
            output.logits[..., token] += 100.0 * (step == i)
        return output

    model.register_forward_hook(hook, with_kwargs=True)
    return forwards


@pytest.mark.parametrize("decoder", ["loop", "generate"])
def test_stop_strings_end_the_response_at_the_token_that_completes_them(tokenizer, make_model, decoder):
    """The response ends with the token completing the first stop string (kept, as vLLM's
    include_stop_str_in_output); nothing after it is in the tokens, text or log-probs. A stop
    string the prompt and response only form together does not count. Decoding stops there:
    one forward per response token. Both decoders agree."""
    model = make_model(8).eval()
    forwards = force_text(model, tokenizer, 4, "a>xy</a>z</b>w")
    if decoder == "generate":
        use_generate(model, "the test")
    prompts = [tokenizer(t)["input_ids"] for t in ("1+2=", "9+</")]
    engine = HFEngine(model, tokenizer, batch_size=4)
    for greedy in (True, False):
        forwards.clear()
        gens = engine.generate(prompts, greedy=greedy, stop=("</a>", "</b>"), max_new_tokens=20)
        assert len(forwards) == len("a>xy</a>")
        for g in gens:
            assert g.text == "a>xy</a>" and g.finished
            assert g.response_ids == tokenizer("a>xy</a>", add_special_tokens=False)["input_ids"]
            assert greedy or len(g.logprobs) == len(g.response_ids)
    g = engine.generate(prompts[:1], greedy=True, stop=("</b>",), max_new_tokens=20)[0]
    assert g.text == "a>xy</a>z</b>" and g.finished
    g = engine.generate(prompts[:1], greedy=True, stop=("</c>",), max_new_tokens=20)[0]
    assert g.text == "a>xy</a>z</b>w" and g.response_ids[-1] == tokenizer.eos_token_id
    g = engine.generate(prompts[:1], greedy=True, stop=("</c>",), max_new_tokens=6)[0]
    assert g.text == "a>xy</" and not g.finished


def test_stop_strings_in_the_config():
    from exactrl.config import ConfigError, RLConfig, load_config

    assert load_config(RLConfig, None, ["rollout.stop=</a>"]).rollout.stop == ["</a>"]  # the natural CLI form
    assert load_config(RLConfig, None, ["rollout.stop=[</a>, '###']"]).rollout.stop == ["</a>", "###"]
    with pytest.raises(ConfigError, match="rollout.stop: an empty stop string"):
        load_config(RLConfig, None, ["rollout.stop=['</a>', '']"])
