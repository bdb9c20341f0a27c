"""flash-attention's varlen kernel on packed rows, without a GPU: a stand-in ``flash_attn``
module (installed in sys.modules) implements flash_attn_varlen_func's documented contract in
plain torch -- per-sequence causal attention, window_size inclusive (left, right), softcap,
fewer key/value heads -- and the CUDA/half-precision condition is patched. Then the packed
forward through flash equals the packed SDPA/eager path and each sequence alone (Llama,
Mistral with a window narrower than the sequences, Gemma2 with softcap and a window), the
arguments reach the kernel as flash-attention takes them, and the packing self-check names
the kernel and compares flash with SDPA under bf16 autocast."""

from __future__ import annotations

import random
import sys
import types

import pytest
import torch

from archs import VOCAB, WINDOW, build, save
from exactrl.checks.packing import BF16_TOL, PackingCheckError, check_packing
from exactrl.losses.token_losses import token_logprobs
from exactrl.models import flash, packing
from exactrl.models.loading import load_causal_lm

LENGTHS = (23, 5, 17, 12, 2)  # several longer than the window (8)


def reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                     causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                     return_attn_probs=False, block_table=None):
    """flash_attn_varlen_func's contract (flash-attn 2.6 docstring), one sequence at a time:
    query i of a sequence sees keys i - window_size[0] .. i + window_size[1] (-1: unbounded),
    and none after i when causal; scores softcapped as softcap * tanh(s / softcap) when softcap > 0."""
    assert dropout_p == 0.0 and alibi_slopes is None and not return_attn_probs
    with torch.autocast("cpu", enabled=False):  # flash-attention accumulates in fp32 whatever autocast says
        return _reference_varlen(q, k, v, cu_seqlens_q, softmax_scale, causal, window_size, softcap)


def _reference_varlen(q, k, v, cu_seqlens_q, softmax_scale, causal, window_size, softcap):
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    outs = []
    for a, b in zip(cu_seqlens_q.tolist(), cu_seqlens_q.tolist()[1:]):
        qs, ks, vs = (t[a:b].float() for t in (q, k, v))
        # query head h reads kv head h // rep
        ks, vs = (t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (ks, vs))
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        i, j = torch.arange(b - a)[:, None], torch.arange(b - a)[None, :]
        seen = torch.ones(b - a, b - a, dtype=torch.bool)
        if causal:
            seen &= j <= i
        if window_size[0] >= 0:
            seen &= j >= i - window_size[0]
        if window_size[1] >= 0:
            seen &= j <= i + window_size[1]
        weights = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", weights, vs).to(q.dtype))
    return torch.cat(outs)


@pytest.fixture
def fake_flash(monkeypatch):
    """A ``flash_attn`` module whose kernel is ``reference_varlen`` (replaceable through the
    returned namespace), and every tensor taken as runnable by flash, in its own dtype (fp32
    here). Records each call."""
    state = types.SimpleNamespace(calls=[], impl=reference_varlen)

    def flash_attn_varlen_func(*args, **kwargs):
        state.calls.append(kwargs)
        return state.impl(*args, **kwargs)

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func))
    monkeypatch.setattr(flash, "_flash_dtype", lambda query, key, value: query.dtype)
    flash._varlen_fn.cache_clear()
    yield state
    flash._varlen_fn.cache_clear()


@pytest.fixture(scope="module")
def seqs():
    rng = random.Random(1)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in LENGTHS]


def weighted_logprobs(model, seqs, packed):
    """sum of per-token log-probs times fixed weights, and the rows, through model_batch."""
    mb = packing.model_batch(model, seqs, 0, packed=packed)
    lp = mb.repad(token_logprobs(model(**mb.inputs).logits, mb.inputs["input_ids"]))
    rows = [lp[i, : len(s) - 1] for i, s in enumerate(seqs)]
    weights = [torch.randn(len(s) - 1, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(seqs)]
    return sum((r * w).sum() for r, w in zip(rows, weights)), rows


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2"])
def test_flash_packed_equals_sdpa_packed_and_each_sequence_alone(name, seqs, monkeypatch, fake_flash):
    sdpa = packing.enable(build(name))
    monkeypatch.setattr(flash, "_flash_dtype", lambda query, key, value: None)  # the SDPA (Gemma2: eager) packed path
    before = packing.packed_kernels.copy()
    loss, sdpa_rows = weighted_logprobs(sdpa, seqs, packed=True)
    loss.backward()
    assert not fake_flash.calls and "flash_attn varlen" not in packing.packed_kernels - before

    monkeypatch.setattr(flash, "_flash_dtype", lambda query, key, value: query.dtype)
    fast = packing.enable(build(name))
    before = packing.packed_kernels.copy()
    loss, flash_rows = weighted_logprobs(fast, seqs, packed=True)
    loss.backward()
    layers = fast.config.num_hidden_layers
    assert len(fake_flash.calls) == layers and packing.packed_kernels - before == {"flash_attn varlen": layers}

    alone = build(name)
    alone.set_attn_implementation("eager")
    ref_rows = []
    for s in seqs:  # Hugging Face's eager attention on each sequence by itself
        ids = torch.tensor([s])
        ref_rows.append(alone(input_ids=ids).logits.float().log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0])
    for rows in (sdpa_rows, ref_rows):
        assert max((a - b).abs().max().item() for a, b in zip(flash_rows, rows)) < 1e-5
    g_fast, g_sdpa = grads(fast), grads(sdpa)
    assert (g_fast - g_sdpa).norm() <= 1e-5 * g_sdpa.norm()


def test_arguments_reach_the_kernel_as_flash_attention_takes_them(seqs, fake_flash):
    """Gemma2: a sliding layer then a full one, softcap 5, scale query_pre_attn_scalar ** -0.5,
    2 key/value heads for 4 query heads, the packed row's int32 cumulative lengths."""
    model = packing.enable(build("gemma2")).eval()
    model(**packing.model_batch(model, seqs, 0, packed=True).inputs)
    sliding, full = fake_flash.calls
    cu = [0, 23, 28, 45, 57, 59]
    for call in (sliding, full):
        assert call["cu_seqlens_q"].dtype == call["cu_seqlens_k"].dtype == torch.int32
        assert call["cu_seqlens_q"].tolist() == call["cu_seqlens_k"].tolist() == cu
        assert call["max_seqlen_q"] == call["max_seqlen_k"] == 23 and isinstance(call["max_seqlen_q"], int)
        assert call["causal"] is True and call["softcap"] == 5.0 and call["dropout_p"] == 0.0
        assert call["softmax_scale"] == 8 ** -0.5 and call["deterministic"] is True
    # key j visible from query i when i - WINDOW < j <= i: WINDOW - 1 keys back, inclusive
    assert sliding["window_size"] == (WINDOW - 1, 0) and full["window_size"] == (-1, -1)


def test_flash_is_tried_only_where_it_runs(monkeypatch):
    x, half = torch.zeros(1, 4, 3, 8), torch.zeros(1, 4, 3, 8, dtype=torch.bfloat16)
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=reference_varlen))
    flash._varlen_fn.cache_clear()
    try:
        assert flash.flash_available(half, half, half) is None  # on the CPU, even installed
        monkeypatch.setattr(flash, "_on_cuda", lambda query: True)
        assert flash.flash_available(half, half, half) == (reference_varlen, torch.bfloat16)
        assert flash.flash_available(x, x, x) is None  # fp32: flash-attention refuses it
        assert flash.flash_available(x, x, half) is None  # mixed dtypes outside autocast
        with torch.autocast("cpu", dtype=torch.bfloat16):  # q/k fp32 from the rotary embedding, v bf16
            assert flash.flash_available(x, x, half) == (reference_varlen, torch.bfloat16)
        monkeypatch.setitem(sys.modules, "flash_attn", None)  # not installed: the import fails
        flash._varlen_fn.cache_clear()
        assert flash.flash_available(half, half, half) is None
    finally:
        flash._varlen_fn.cache_clear()


def loaded(name, tmp_path, attn="sdpa"):
    save(name, tmp_path / name)
    return load_causal_lm(tmp_path / name, attn=attn)


@pytest.mark.parametrize("name,attn,kernel", [("mistral", "sdpa", "sdpa varlen"), ("gemma2", "sdpa", "eager varlen"),
                                              ("llama", "eager", "eager varlen")])
def test_self_check_names_the_kernel(name, attn, kernel, tmp_path, monkeypatch):
    report = check_packing(loaded(name, tmp_path, attn), VOCAB, 64, padding_free=True, policy="error", tol=1e-4)
    assert report.kernel == kernel and report.fast_error is None and report.packed_error < 1e-5


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_self_check_names_flash_when_it_runs(name, tmp_path, fake_flash):
    report = check_packing(loaded(name, tmp_path), VOCAB, 64, padding_free=True, policy="error", tol=1e-4)
    assert report.kernel == "flash_attn varlen" and report.packed and report.packed_error < 1e-5


def test_explicit_eager_never_runs_flash(tmp_path, fake_flash):
    report = check_packing(loaded("mistral", tmp_path, "eager"), VOCAB, 64, padding_free=True, policy="error", tol=1e-4)
    assert report.kernel == "eager varlen" and not fake_flash.calls


FLASH_DTYPE = flash._flash_dtype


def on_cuda_flash(monkeypatch):
    monkeypatch.setattr(flash, "_flash_dtype", FLASH_DTYPE)
    monkeypatch.setattr(flash, "_on_cuda", lambda query: True)


def bf16_autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def test_self_check_compares_flash_with_sdpa_under_bf16_autocast(tmp_path, monkeypatch, fake_flash):
    """flash only for bf16 tensors, as on a GPU: the fp32 stage runs SDPA, the autocast stage
    engages flash and compares it with packed SDPA in bf16."""
    on_cuda_flash(monkeypatch)  # the real dtype rule, the CPU taken for CUDA
    model = loaded("mistral", tmp_path)
    report = check_packing(model, VOCAB, 64, padding_free=True, policy="error", tol=1e-4, autocast=bf16_autocast)
    assert report.kernel == "flash_attn varlen" and report.fast_error <= BF16_TOL and report.notice is None
    assert report.packed_error < 1e-5  # the fp32 stage: SDPA against each sequence alone
    assert check_packing(model, VOCAB, 64, padding_free=True, policy="error", tol=1e-4).kernel == "sdpa varlen"


def test_flash_with_its_window_off_by_one_is_caught_and_turned_off(tmp_path, monkeypatch, fake_flash):
    """A kernel that sees one key too many (window_size[0] = WINDOW, the off-by-one the
    (window - 1) mapping avoids): the bf16 comparison catches it; fallback runs SDPA instead."""
    on_cuda_flash(monkeypatch)  # the real dtype rule, the CPU taken for CUDA
    fake_flash.impl = lambda *a, window_size=(-1, -1), **kw: reference_varlen(
        *a, window_size=(window_size[0] + 1 if window_size[0] >= 0 else -1, window_size[1]), **kw)
    with pytest.raises(PackingCheckError, match="flash_attn varlen: its packed rows differ from the packed sdpa"):
        check_packing(loaded("mistral", tmp_path), VOCAB, 64, padding_free=True, policy="error", tol=1e-4,
                      autocast=bf16_autocast)
    model = loaded("mistral", tmp_path / "again")
    report = check_packing(model, VOCAB, 64, padding_free=True, policy="fallback", tol=1e-4, autocast=bf16_autocast)
    assert list(report.turned_off) == ["flash_attn varlen"] and report.fast_error is None
    assert report.kernel == "sdpa varlen" and "sdpa varlen instead" in report.notice
    assert report.packed  # packing itself stays on
    calls = len(fake_flash.calls)
    with bf16_autocast(), torch.no_grad():
        model(**packing.model_batch(model, [[5] * 12, [7] * 3], 0, packed=True).inputs)
    assert len(fake_flash.calls) == calls  # flash stays off for this model
