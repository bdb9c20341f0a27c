"""The chunked output head (exactrl/models/head.py) computes the per-token fields of the model's own
logits, values and gradients, on every architecture of the matrix, without the [tokens x vocab]
logits; its self-check keeps the plain head for a model that does something it does not know."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from archs import ARCHS, VOCAB, build
from exactrl.algorithms.sft import sft_objective
from exactrl.checks.head import check_head
from exactrl.config import SFTConfig, load_config
from exactrl.data.batch import Sample
from exactrl.distributed.engine import build_engine
from exactrl.distributed.step_plan import plan_step
from exactrl.losses.objective import Metrics
from exactrl.losses.token_losses import kept_logprobs, token_entropy, token_logprobs
from exactrl.models import head, packing
from exactrl.workers.worker import Worker
from test_arch_matrix import NO_PACKING, RANDOM

SAMPLING = head.Sampling(temperature=0.8, top_p=0.9, top_k=20)
NAMES = ("logprobs", "kept_logprobs", "entropy")
LENGTHS = (13, 4, 9, 2)


def prepared(model):
    packing.enable(model)
    packing.disable_dropout(model)
    return model.train()


def seqs(vocab=VOCAB):
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in LENGTHS]


def plain_fields(model, mb):
    """The fields from the model's full logits, as a run with train.logprob_chunk_size=0 computes them."""
    logits, ids = model(**mb.inputs).logits, mb.inputs["input_ids"]
    s = SAMPLING
    return [token_logprobs(logits, ids, s.temperature), kept_logprobs(logits, ids, s.temperature, s.top_p, s.top_k),
            token_entropy(logits, s.temperature)]


def chunked_fields(model, mb, chunk):
    with head.per_token_head(model, mb.inputs["input_ids"], NAMES, (), SAMPLING, chunk):
        out = model(**mb.inputs).logits
    return [out[..., i] for i in range(len(NAMES))]


def values_and_grads(model, mb, fields_fn):
    model.zero_grad()
    fields = [mb.repad(f) for f in fields_fn()]
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(f.shape, generator=g) for f in fields]
    sum((f * w).sum() for f, w in zip(fields, weights)).backward()
    return [f.detach() for f in fields], {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(model, packed, chunk):
    mb = packing.model_batch(model, seqs(), 0, packed=packed)
    plain = values_and_grads(model, mb, lambda: plain_fields(model, mb))
    chunked = values_and_grads(model, mb, lambda: chunked_fields(model, mb, chunk))
    return plain, chunked


@pytest.mark.parametrize("name", ARCHS)
def test_chunked_head_equals_the_model_logits_on_every_architecture(name):
    """Split into chunks of 5 tokens (rows cut mid-sequence), packed where the model packs (bounds as
    tests/test_arch_matrix.py; seen here on AVX2: values 1.2e-6, gradients 5% of theirs):
    log-probs, kept-set log-probs and entropies, and every parameter's gradient."""
    model = prepared(build(name))
    if name in RANDOM:
        model.eval()
    assert check_head(model, VOCAB, 1e-4).chunked
    (v0, g0), (v1, g1) = compare(model, packed=name not in NO_PACKING, chunk=5)
    for a, b in zip(v0, v1):
        assert (a - b).abs().max().item() < 1e-5
    assert g0.keys() == g1.keys()
    total = torch.cat([g.flatten() for g in g0.values()]).norm().item()
    for n in g0:
        assert (g1[n] - g0[n]).norm().item() <= 1e-5 * g0[n].norm().item() + 1e-7 * total, n


@pytest.mark.parametrize("name", ["llama", "gemma2", "cohere", "gpt2"])
@pytest.mark.parametrize("packed", [True, False])
def test_one_chunk_is_the_plain_path_bit_for_bit(name, packed):
    """A micro-batch within one chunk runs the plain path's operations: identical bits."""
    model = prepared(build(name))
    (v0, g0), (v1, g1) = compare(model, packed, chunk=0)
    assert all(torch.equal(a, b) for a, b in zip(v0, v1))
    assert all(torch.equal(g0[n], g1[n]) for n in g0)


def test_post_head_ops_are_folded_in_and_restored():
    """Gemma 2's softcap, Cohere's logit scale and Granite's logits scaling (set away from 1)
    change the log-probs; the chunked head applies each and leaves the model as it was."""
    for name, setting in (("gemma2", None), ("cohere", None), ("granite", ("logits_scaling", 4.0))):
        model = build(name)
        if setting:
            setattr(model.config, *setting)
        prepared(model)
        assert head.post_ops(model), name
        before = {k: getattr(model.config, k, None) for k in ("final_logit_softcapping", "logits_scaling")}
        before["logit_scale"] = getattr(model, "logit_scale", None)
        (v0, _), (v1, _) = compare(model, packed=True, chunk=3)
        assert max((a - b).abs().max().item() for a, b in zip(v0, v1)) < 1e-5, name
        after = {k: getattr(model.config, k, None) for k in ("final_logit_softcapping", "logits_scaling")}
        assert after | {"logit_scale": getattr(model, "logit_scale", None)} == before


def test_a_model_doing_something_else_after_its_head_keeps_the_plain_head():
    """A multiplier the chunked head does not know (a forward hook doubling the logits, as a
    model with its own post-head op would) is caught by the self-check, which turns the
    chunked head off with a notice; the Worker then computes from the full logits."""
    model = prepared(build("llama"))
    model.register_forward_hook(lambda mod, args, out: out.__setitem__("logits", out.logits * 2) or out)
    report = check_head(model, VOCAB, 1e-4)
    assert not report.chunked and "differs from its logits" in report.notice and report.error > 1e-2
    assert not head.can_chunk(model)


def test_a_model_without_a_linear_head_is_not_chunked():
    model = prepared(build("llama"))
    model.lm_head = torch.nn.Sequential(model.lm_head)
    report = check_head(model, VOCAB, 1e-4)
    assert not report.chunked and "not a Linear" in report.notice


class Largest(TorchDispatchMode):
    """The largest tensor any op returns."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("chunk", [0, 64])
def test_no_tensor_of_the_whole_micro_batch_logits_exists(chunk):
    """Forward and backward of an SFT micro-batch through the Worker: with chunks of 64 tokens
    the largest tensor is a chunk's logits, not the micro-batch's [tokens x vocab]."""
    vocab, n_rows, length = 4096, 6, 100
    model = prepared(build("llama"))
    model.resize_token_embeddings(vocab)
    cfg = load_config(SFTConfig, None, [f"train.logprob_chunk_size={chunk}", "audit.canary=off"])
    engine = build_engine(model, cfg, total_steps=1)
    g = torch.Generator().manual_seed(0)
    samples = [Sample(torch.randint(3, vocab, (4,), generator=g).tolist(),
                      torch.randint(3, vocab, (length - 4,), generator=g).tolist()) for _ in range(n_rows)]
    plan = plan_step([s.num_targets for s in samples], 1, "token-mean")
    objective = sft_objective(plan.normalizer.mode, plan.normalizer.norm_len)
    worker = Worker("policy", model, engine, pad_id=0)
    with Largest() as seen:
        loss, _, _ = worker.micro_batch(samples, objective, dict.fromkeys(objective.groups(), plan.normalizer),
                                        Metrics())
        loss.backward()
    tokens = n_rows * length
    if chunk:
        assert seen.numel <= 64 * vocab
    else:
        assert seen.numel >= (tokens - 1) * vocab  # the plain path: the whole logits


def test_lora_adapters_get_the_plain_heads_gradients():
    """With LoRA the head is frozen and the adapters train: their gradients through the chunked head."""
    from exactrl.models.lora import apply_lora

    cfg = load_config(SFTConfig, None, ["model.lora.rank=4"])
    model = apply_lora(prepared(build("llama")), cfg.model.lora, None)
    assert check_head(model, VOCAB, 1e-4).chunked
    (v0, g0), (v1, g1) = compare(model, packed=True, chunk=5)
    assert g0 and all("lora_" in n for n in g0)
    assert max((a - b).abs().max().item() for a, b in zip(v0, v1)) < 1e-5
    for n in g0:
        assert (g1[n] - g0[n]).norm().item() <= 1e-5 * g0[n].norm().item(), n


def test_under_bf16_autocast_one_chunk_is_bit_identical_and_chunks_agree_to_bf16_rounding():
    model = prepared(build("gemma2"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (v0, g0), (v1, g1) = compare(model, packed=True, chunk=0)
        (_, _), (v2, g2) = compare(model, packed=True, chunk=5)
    assert all(torch.equal(a, b) for a, b in zip(v0, v1)) and all(torch.equal(g0[n], g1[n]) for n in g0)
    assert max((a - b).abs().max().item() for a, b in zip(v0, v2)) < 5e-2
    for n in g0:
        assert (g2[n] - g0[n]).norm().item() <= 2e-2 * g0[n].norm().item() + 1e-6, n
