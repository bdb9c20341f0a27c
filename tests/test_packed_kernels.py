"""PyTorch's own packed kernels (exactrl/models/varlen_kernels.py), without a GPU.

* flex_attention with the document mask runs on the CPU (uncompiled, torch's CPU guard on its
  backward lifted) and equals the gather path in values and gradients, fp32: Llama, sliding
  windows, Gemma2's softcap, Llama 4's chunks, MLA's narrower values, multi-query attention;
  every packable architecture of the matrix under ``-m slow``.
* torch's ``varlen_attn`` is replaced by a CPU stand-in implementing its documented contract
  (tests/test_flash.py's reference): the dispatcher calls it with the row's int32 cumulative
  lengths, its inclusive window, the layer's scale and GQA as each torch signature takes them;
  the packing self-check names it and, when it is wrong, turns it off for the next rung.
"""

from __future__ import annotations

import inspect
import random
import types

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex

from archs import ARCHS, VOCAB, WINDOW, build
from exactrl.checks.packing import BF16_TOL, PackingCheckError, check_packing
from exactrl.models import packing, varlen_kernels
from test_arch_matrix import NO_PACKING, RANDOM
from test_flash import bf16_autocast, grads, loaded, reference_varlen, weighted_logprobs

LENGTHS = (23, 5, 17, 12, 2)  # several past the window (8) and the chunk (6)
CU = [0, 23, 28, 45, 57, 59]


@pytest.fixture(scope="module")
def seqs():
    rng = random.Random(1)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in LENGTHS]


@pytest.fixture
def cpu_flex(monkeypatch):
    """The flex path on the CPU. torch refuses flex's backward there in its input check only;
    its uncompiled implementation (the one it also runs uncompiled on CUDA) has a backward."""
    monkeypatch.setattr(varlen_kernels, "FLEX_ON_CPU", True)
    monkeypatch.setattr(torch_flex, "_validate_device", lambda *args: None)


def twins(name, setting):
    """The same model twice: through the gather path, and allowed only ``setting``'s kernel."""
    models = []
    for kernel in ("gather", setting):
        model = packing.enable(build(name))
        packing.disable_dropout(model)
        packing.use_kernels(model, setting=kernel)
        models.append(model.eval() if name in RANDOM else model)
    return models


def assert_equal_paths(name, seqs, setting):
    """Log-probs and gradients of the gather path and of ``setting``'s kernel; returns the kernels
    the fast model's forward ran."""
    slow, fast = twins(name, setting)
    loss, slow_rows = weighted_logprobs(slow, seqs, packed=True)
    loss.backward()
    before = packing.packed_kernels.copy()
    loss, fast_rows = weighted_logprobs(fast, seqs, packed=True)
    ran = packing.packed_kernels - before
    loss.backward()
    diff = max((a - b).abs().max().item() for a, b in zip(fast_rows, slow_rows))
    g_fast, g_slow = grads(fast), grads(slow)
    assert diff < 1e-5 and (g_fast - g_slow).norm() <= 1e-5 * g_slow.norm(), (name, diff)
    return ran


FLEX_FAST = ["llama", "mistral", "gemma2", "gemma3", "llama4", "deepseek_v3", "gpt_bigcode"]


@pytest.mark.parametrize("name", FLEX_FAST)
def test_flex_equals_the_gather_path(name, seqs, cpu_flex):
    ran = assert_equal_paths(name, seqs, "flex")
    assert ran[varlen_kernels.FLEX] >= 1 and set(ran) <= {varlen_kernels.FLEX, "sdpa varlen", "eager varlen"}


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in ARCHS if n not in NO_PACKING and n not in FLEX_FAST])
def test_flex_equals_the_gather_path_on_the_matrix(name, seqs, cpu_flex):
    ran = assert_equal_paths(name, seqs, "flex")
    assert ran[varlen_kernels.FLEX] >= 1 or name == "gpt_oss"  # attention sinks on every layer: gather


def test_flex_stays_off_the_cpu_by_default(seqs):
    model = packing.enable(build("llama"))
    packing.use_kernels(model, setting="flex")
    before = packing.packed_kernels.copy()
    with torch.no_grad():
        model(**packing.model_batch(model, seqs, 0, packed=True).inputs)
    assert packing.packed_kernels - before == {"sdpa varlen": 2}


def test_document_mask_keeps_each_sequence_to_itself():
    """The mask_mod on every pair of a row: sequence, causality, window, chunk (positions within
    the sequence), against a plain loop."""
    cu = torch.tensor(CU)
    n = CU[-1]
    seq_of = [s for s in range(len(CU) - 1) for _ in range(CU[s + 1] - CU[s])]
    for window, chunk in [(None, None), (WINDOW, None), (None, 6)]:
        mod = varlen_kernels.document_mask_mod(cu, n, window, chunk)
        q, k = torch.arange(n)[:, None].expand(n, n), torch.arange(n)[None, :].expand(n, n)
        got = mod(None, None, q, k)
        for i in range(n):
            for j in range(n):
                pi, pj = i - CU[seq_of[i]], j - CU[seq_of[j]]
                want = (seq_of[i] == seq_of[j] and j <= i and (window is None or i - j < window)
                        and (chunk is None or pi // chunk == pj // chunk))
                assert got[i, j].item() == want, (window, chunk, i, j)


def varlen_attn_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                     window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """torch 2.13's varlen_attn contract: causal exactly when window_size == (-1, 0), windows
    inclusive (left, right) as flash-attention's, fewer key/value heads only with enable_gqa."""
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError("Expect query and key/value to have the same number of heads")
    return reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, softmax_scale=scale,
                            causal=window_size == (-1, 0), window_size=window_size)


def varlen_attn_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.10's: causal or not, the default scale, as many key/value heads as query heads."""
    assert query.shape[1] == key.shape[1] == value.shape[1]
    return reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal=is_causal)


@pytest.fixture
def fake_varlen(monkeypatch):
    """torch's varlen_attn replaced by ``state.impl`` (2.13's contract unless a test swaps it),
    every tensor taken as runnable in its own dtype (fp32 here); records each call."""
    state = types.SimpleNamespace(calls=[], impl=varlen_attn_2_13)

    def install(impl):
        def varlen_attn(*args, **kwargs):
            state.calls.append((args, kwargs))
            return state.impl(*args, **kwargs)
        varlen_attn.__signature__ = inspect.signature(impl)
        monkeypatch.setattr(varlen_kernels, "_torch_varlen",
                            lambda: (varlen_attn, frozenset(inspect.signature(impl).parameters)))
        state.impl = impl

    state.install = install
    install(varlen_attn_2_13)
    monkeypatch.setattr(varlen_kernels, "_varlen_dtype", lambda query, key, value: query.dtype)
    return state


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma3"])
def test_torch_varlen_equals_the_gather_path(name, seqs, fake_varlen):
    ran = assert_equal_paths(name, seqs, "torch_varlen")
    assert ran == {varlen_kernels.TORCH: 2} and len(fake_varlen.calls) == 2


def test_arguments_reach_torch_varlen_as_it_takes_them(seqs, fake_varlen):
    """Gemma3: a sliding layer then a full one, 4 query heads for 2 key/value heads, scale
    query_pre_attn_scalar ** -0.5 (changed to 32 so that it is not the default 8 ** -0.5)."""
    model = packing.enable(build("gemma3")).eval()
    for layer in model.model.layers:
        layer.self_attn.scaling = 32 ** -0.5
    model(**packing.model_batch(model, seqs, 0, packed=True).inputs)
    (sliding, s_kw), (full, f_kw) = fake_varlen.calls
    for args, kwargs in ((sliding, s_kw), (full, f_kw)):
        q, k, v, cu_q, cu_k, max_q, max_k = args
        assert q.shape == (CU[-1], 4, 8) and k.shape == v.shape == (CU[-1], 2, 8)
        assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.tolist() == cu_k.tolist() == CU
        assert max_q == max_k == 23 and kwargs["enable_gqa"] is True and kwargs["scale"] == 32 ** -0.5
    # key j visible from query i when i - WINDOW < j <= i: WINDOW - 1 keys back, inclusive
    assert s_kw["window_size"] == (WINDOW - 1, 0) and f_kw["window_size"] == (-1, 0)


def test_an_older_torch_varlen_takes_what_its_signature_has(seqs, fake_varlen):
    """torch 2.10's varlen_attn (is_causal, no scale, window or GQA): Llama's GQA layers run
    it with keys and values repeated to the query heads; Mistral's windows stay on the gather path."""
    fake_varlen.install(varlen_attn_2_10)
    ran = assert_equal_paths("llama", seqs, "torch_varlen")
    assert ran == {varlen_kernels.TORCH: 2}
    assert all(kw == {"is_causal": True} and a[1].shape[1] == 4 for a, kw in fake_varlen.calls)
    calls = len(fake_varlen.calls)
    assert assert_equal_paths("mistral", seqs, "torch_varlen") == {"sdpa varlen": 2}
    assert len(fake_varlen.calls) == calls


def on_cuda(monkeypatch):
    """The real dtype rule (half precision only), the CPU taken for CUDA: flex engages too."""
    monkeypatch.setattr(varlen_kernels, "_varlen_dtype", lambda q, k, v: varlen_kernels.flash.half_dtype(q, k, v))
    monkeypatch.setattr(varlen_kernels, "_on_cuda", lambda query: True)


def test_self_check_names_torch_varlen_under_bf16_autocast(tmp_path, monkeypatch, fake_varlen):
    on_cuda(monkeypatch)
    report = check_packing(loaded("mistral", tmp_path), VOCAB, 64, padding_free=True, policy="error", tol=1e-4,
                           autocast=bf16_autocast)
    assert report.kernel == "torch varlen" and report.fast_error <= BF16_TOL and not report.turned_off
    assert report.packed_error < 1e-5  # fp32: flex (uncompiled, forward only) against each sequence alone
    assert fake_varlen.calls


def test_wrong_torch_varlen_is_caught_and_flex_runs_instead(tmp_path, monkeypatch, fake_varlen):
    """A varlen_attn whose window sees one key too many: the bf16 comparison turns it off, the
    next rung (flex) engages and agrees; under train.packing_check=error the run stops."""
    on_cuda(monkeypatch)
    fake_varlen.impl = lambda *a, window_size=(-1, -1), **kw: varlen_attn_2_13(
        *a, window_size=(window_size[0] + 1 if window_size[0] >= 0 else -1, window_size[1]), **kw)
    with pytest.raises(PackingCheckError, match="torch varlen: its packed rows differ from the packed sdpa varlen"):
        check_packing(loaded("mistral", tmp_path), VOCAB, 64, padding_free=True, policy="error", tol=1e-4,
                      autocast=bf16_autocast)
    model = loaded("mistral", tmp_path / "again")
    report = check_packing(model, VOCAB, 64, padding_free=True, policy="fallback", tol=1e-4, autocast=bf16_autocast)
    assert list(report.turned_off) == ["torch varlen"] and report.kernel == "flex varlen" and report.packed
    assert report.fast_error <= BF16_TOL and "flex varlen instead" in report.notice
    calls = len(fake_varlen.calls)
    with bf16_autocast(), torch.no_grad():
        model(**packing.model_batch(model, [[5] * 12, [7] * 3], 0, packed=True).inputs)
    assert len(fake_varlen.calls) == calls  # it stays off for this model


@pytest.mark.parametrize("setting", ["gather", "flex"])
def test_model_packed_kernel_reaches_every_attention_layer(setting, seqs, tmp_path, cpu_flex):
    """model.packed_kernel as a run loads its model (workers/load.py): the packed forward runs the
    kernel the setting names (here on the CPU, where flex runs only because the test lifts its check)."""
    from archs import save
    from exactrl.config import SFTConfig, load_config
    from exactrl.workers.load import load_model

    cfg = load_config(SFTConfig, None, [f"model.packed_kernel={setting}", "train.packing_check=off"])
    model = load_model(cfg, save("llama", tmp_path / "m"), tmp_path, "sft", "policy", 64)
    before = packing.packed_kernels.copy()
    model(**packing.model_batch(model, seqs, 0, packed=True).inputs)
    ran = set(packing.packed_kernels - before)
    assert ran == {"sdpa varlen" if setting == "gather" else "flex varlen"}
