"""The memory knobs change memory, not numbers: log-probs and entropies computed in chunks of
positions are bit-identical to one pass (values and gradients), and gradient checkpointing
gives the gradients of a stored-activation backward, on padded and packed batches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from exactrl.config import SFTConfig, load_config
from exactrl.data.encode import encode_sft
from exactrl.data.jsonl import Row
from exactrl.distributed.engine import build_engine
from exactrl.distributed.step_plan import plan_step
from exactrl.losses.token_losses import token_entropy, token_logprobs
from rl_helpers import sft_micro_batch_loss


def one_pass_logprobs(logits, ids, temperature):
    """The unchunked computation, written out: fp32, temperature, cross-entropy over [N, V]."""
    x = logits[:, :-1].float() / temperature
    return -F.cross_entropy(x.reshape(-1, x.size(-1)), ids[:, 1:].reshape(-1), reduction="none").view(ids[:, 1:].shape)


def one_pass_entropy(logits, temperature):
    logp = (logits[:, :-1].float() / temperature).log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 5, 7, 64])
def test_chunked_logprobs_and_entropy_are_bit_identical_with_gradients(dtype, chunk):
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(3, 12, 50, generator=g) * 3).to(dtype)
    ids = torch.randint(0, 50, (3, 12), generator=g)
    weights = torch.randn(3, 11, generator=g)
    results = []
    for fn in (lambda x: one_pass_logprobs(x, ids, 0.7) + one_pass_entropy(x, 0.7),
               lambda x: token_logprobs(x, ids, 0.7, chunk=chunk) + token_entropy(x, 0.7, chunk=chunk)):
        logits = base.clone().requires_grad_(True)
        out = fn(logits)
        (out * weights).sum().backward()
        results.append((out.detach(), logits.grad))
    (v0, g0), (v1, g1) = results
    assert torch.equal(v0, v1) and torch.equal(g0, g1)


def test_gradient_checkpointing_recomputes_and_gives_the_same_gradients(tokenizer, make_model):
    rows = [Row(f"t:{i}", {"prompt": f"{i}+{i}=", "completion": c}) for i, c in enumerate([
        "1", "#### 15", "ab cd", "x" * 9])]
    exs = encode_sft(rows, tokenizer, 64)
    plan = plan_step([e.loss_tokens for e in exs], 2, "token-mean")
    grads, forwards = {}, {}
    for packed in (True, False):
        for ckpt in (False, True):
            model = make_model(1)
            count, mlp = [], model.model.layers[0].mlp
            forward = mlp.forward  # counted by wrapping: torch does not re-run module hooks when it recomputes
            mlp.forward = lambda *a, forward=forward, count=count, **k: count.append(1) or forward(*a, **k)
            cfg = load_config(SFTConfig, None, [f"train.gradient_checkpointing={str(ckpt).lower()}",
                                                "audit.canary=off"])
            engine = build_engine(model, cfg, total_steps=1)
            for mb in plan.micro_batches:
                loss, _ = sft_micro_batch_loss(model, engine, [exs[i] for i in mb], tokenizer.pad_token_id,
                                               plan.normalizer, packed)
                loss.backward()
            grads[packed, ckpt] = [p.grad.clone() for p in model.parameters()]
            forwards[packed, ckpt] = len(count)
    for packed in (True, False):
        assert forwards[packed, True] == 2 * forwards[packed, False]  # each layer's MLP ran again in backward
        for a, b in zip(grads[packed, True], grads[packed, False]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def test_gradient_checkpointing_on_a_model_without_it_is_one_line():
    """JetMoe's transformers class does not support it: a 145-line traceback from inside
    transformers before; now the config error names the class."""
    from transformers import AutoModelForCausalLM, JetMoeConfig

    from exactrl.config import ConfigError
    from exactrl.distributed.engine import enable_gradient_checkpointing

    model = AutoModelForCausalLM.from_config(JetMoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                          kv_channels=8,
                                                          num_key_value_heads=2, intermediate_size=32,
                                                          num_local_experts=2,
                                                          num_experts_per_tok=1))
    with pytest.raises(ConfigError,
                       match=r"^train.gradient_checkpointing=true: JetMoeForCausalLM does not support it .*"
                                          r"set train.gradient_checkpointing=false$"):
        enable_gradient_checkpointing(model)
