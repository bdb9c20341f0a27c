"""Every architecture family exactrl accepts, through the path a run takes: the model as
exactrl loads it (its kernel, dropout off) after the packing self-check, against Hugging
Face's own eager forward of each sequence alone.

* the training forward (packed, or padded where the self-check turned packing off, through the
  model's own attention where it handed the model to it) gives the reference's log-probs and
  gradients;
* exactrl's decoding of a left-padded batch (its loop, or ``generate``, on the prompts of each
  length apart where the generation self-check chose it) picks the greedy tokens Hugging Face's
  ``generate`` picks for each prompt alone;
* ``exactrl sft`` and ``exactrl rl`` run two steps through the CLI with the self-checks and the
  on-policy check (against the generator, at 1e-4) passing: one architecture of each family
  here, every architecture under ``-m slow``;
* the cases a probe from outside found: DeepSeek-V3.2's padded length mixes (which the old probe
  lengths passed), Qwen3.5-MoE's padded gradients (rounding, shown in float64).
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from torch.overrides import TorchFunctionMode

from archs import ARCHS, VOCAB, WINDOW, build, save
from exactrl.checks import packing as packing_check
from exactrl.checks.packing import PackingCheckError, check_packing
from exactrl.losses.token_losses import token_logprobs
from exactrl.models import dsa, packing
from exactrl.models.loading import load_causal_lm
from exactrl.rollout.generation_check import check_generation
from exactrl.rollout.hf import sample
from exactrl.tasks.tokenizer import build_tokenizer
from test_cli_failures import exactrl

# Packing must be refused: ALiBi computed inside the model (Falcon, Bloom); state carried along the
# row by linear-attention, SSM and short-convolution layers; DSA's indexer picking keys over a row.
NO_PACKING = {"falcon", "bloom", "qwen3_5", "qwen3_5_moe", "qwen3_next", "kimi_linear", "falcon_h1", "granitemoehybrid",
              "nemotron_h", "jamba", "bamba", "lfm2", "lfm2_moe", "minimax", "mamba2", "deepseek_v32"}
# Nemotron-H's one-token Mamba-2 step (Hugging Face's) leaves out the lower limit its chunked scan
# puts on the step size (time_step_min), so every decoder samples off the training forward (~3e-3
# in log-prob; float64 does not shrink it): rl trains with that gap measured and corrected, the way
# the generation check names, and its on-policy bound against the generator allows the gap.
CORRECTED = {"nemotron_h": "tis"}
GEN_RATIO_TOL = {"nemotron_h": 1e-2}
# PhiMoE's sparsemixer samples its experts in train mode: compared in eval mode, refused for rl.
RANDOM = {"phimoe"}
# MiniMax-01 brings its own cache class (decoded through generate), which builds a wrong mask for
# left-padded decode steps: its prompts are decoded without padding, those of each length together.
DECODER = {"minimax": "generate, unpadded"}
# 23 and 33 padded beside 40 (DSA's top-k of 8 kept other keys there), several past the sliding window
# (8), the chunk (6), the NoPE step (4)
LENGTHS = (23, 5, 40, 17, 33, 12, 2)


@pytest.fixture(scope="module")
def seqs():
    rng = random.Random(0)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in LENGTHS]


def loaded(name, tmp_path, attn="sdpa"):
    """The model as a run gets it: saved, loaded by exactrl, self-checked (in eval mode where
    its training forward is random, as a run does)."""
    save(name, tmp_path / name)
    model = load_causal_lm(tmp_path / name, attn=attn)
    report = check_packing(model, VOCAB, 64, padding_free=True, policy="fallback", tol=1e-4,
                           train_mode=False if name in RANDOM else None)
    return model, report


def reference(name):
    """The same weights through Hugging Face's eager attention, eval mode (no dropout). Where
    DeepSeek sparse attention's indexer scores keys exactly alike, the model does not say which
    it keeps, and torch.topk's choice depends on the row's width: the reference keeps the
    earliest, as exactrl does in every layout (exactrl/models/dsa.py)."""
    ref = build(name)
    ref.set_attn_implementation("eager")
    dsa.break_ties_by_position(ref)
    return ref.eval()


@pytest.mark.parametrize("name,attn", [(n, "sdpa") for n in ARCHS] + [("llama", "eager"), ("gemma2", "eager"),
                                                                      ("mistral", "eager")])
def test_training_forward_matches_each_sequence_alone(name, attn, seqs, tmp_path):
    model, report = loaded(name, tmp_path, attn)
    assert report.packed == (name not in NO_PACKING), report
    if name in RANDOM:
        model.eval()
    ref = reference(name)
    weights = [torch.randn(len(s) - 1, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(seqs)]
    ref_rows = []
    for s in seqs:  # log_softmax + gather, not exactrl's cross-entropy path
        ids = torch.tensor([s])
        ref_rows.append(ref(input_ids=ids).logits.float().log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0])
    sum((r * w).sum() for r, w in zip(ref_rows, weights)).backward()

    mb = packing.model_batch(model, seqs, 0, packed=True)  # what a run with train.padding_free=true computes
    assert ("cu_seq_lens_q" in mb.inputs) == report.packed
    lp = mb.repad(token_logprobs(model(**mb.inputs).logits, mb.inputs["input_ids"]))
    rows = [lp[i, : len(s) - 1] for i, s in enumerate(seqs)]
    sum((r * w).sum() for r, w in zip(rows, weights)).backward()

    assert max((a - b).abs().max().item() for a, b in zip(rows, ref_rows)) < 1e-5
    grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert grads.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    total = torch.cat([g.flatten() for g in grads.values()]).norm().item()
    for n, p in model.named_parameters():
        if n not in grads:  # frozen by the model itself (ERNIE-4.5's expert-bias statistics)
            continue
        # Parameters whose true gradient is zero (OPT's key bias: softmax ignores a shift shared
        # by every key) carry rounding noise of the whole model's scale, hence the second term.
        assert (p.grad - grads[n]).norm().item() <= 1e-5 * grads[n].norm().item() + 1e-7 * total, n


@pytest.mark.parametrize("name", ARCHS)
def test_decoding_matches_generate_on_each_prompt_alone(name, seqs, tmp_path):
    """exactrl's decoding after the generation self-check, on a left-padded batch whose rows stop
    at different steps, against Hugging Face's generate on each prompt alone (no padding: what
    the model computes for that prompt)."""
    model, _ = loaded(name, tmp_path)
    # sampled log-probs against the training forward only where rl can run (sft checks greedy decoding)
    report = check_generation(model, VOCAB, eos=2, pad=0, policy="fallback", tol=1e-3, sampled=name not in RANDOM,
                              correction=CORRECTED.get(name, "none"))
    assert report.decoder == DECODER.get(name, "exactrl loop"), report
    assert (report.gap_corrected is not None) == (name in CORRECTED), report
    model.eval()
    # left-padded to 8; 16 new tokens pass the window
    prompts = [[1] + seqs[0][:7], [1] + seqs[2][:3], [1] + seqs[3][:5]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    stop = seqs[1][0]  # a stop token (besides EOS) some rows may reach
    tokens, _ = sample(model, ids, (ids != 0).long(), max_new_tokens=16, eos=stop, pad=0, greedy=True)
    ref = reference(name)
    for prompt, got in zip(prompts, tokens.tolist()):
        want = ref.generate(input_ids=torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0,
                            eos_token_id=stop)[0, len(prompt):].tolist()
        assert got[: len(want)] == want


def test_dsa_length_mixes_fail_the_old_probe_and_pass_the_new(tmp_path, monkeypatch):
    """DeepSeek-V3.2's right-padded forward with torch.topk's order among tied keys (exactrl before
    exactrl/models/dsa.py) is wrong for sequences of 23 and 33 tokens padded beside one of 40,
    which the old probe (13, 24 and 3 tokens) passed; the probe shaped like a run's batch catches
    it, and with ties broken by position the path is right for that mix and passes."""
    save("deepseek_v32", tmp_path / "m")
    rng = random.Random(1)
    mix = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (23, 33, 40)]

    def mix_error(model, ref):
        out = model(**packing.model_batch(model, mix, 0, packed=False).inputs).logits
        return max((out[i, : len(s)] - ref(input_ids=torch.tensor([s])).logits[0]).abs().max().item()
                   for i, s in enumerate(mix))

    check = {"vocab_size": VOCAB, "longest": 64, "padding_free": False, "policy": "error", "tol": 1e-4}
    with torch.no_grad(), monkeypatch.context() as m:
        m.setattr(dsa, "break_ties_by_position", lambda model: 0)  # the fix reverted
        broken = load_causal_lm(tmp_path / "m")
        unfixed = build("deepseek_v32").eval()  # Hugging Face's own model, torch.topk's ties
        unfixed.set_attn_implementation("eager")
        assert mix_error(broken, unfixed) > 0.1
        m.setattr(packing_check, "probe_lengths", lambda config, longest: [13, 24, 3])
        assert check_packing(broken, **check).padded_error < 1e-5
    with pytest.raises(PackingCheckError, match="right-padded batches through exactrl's attention differ"):
        check_packing(broken, **check)
    fixed = load_causal_lm(tmp_path / "m")
    assert check_packing(fixed, **check).padded_error < 1e-5
    with torch.no_grad():  # fp32 logits of the padded batch against each alone: 6e-6 on an AVX2 EPYC, whose kernels
        # round otherwise than AVX-512's; the bound keeps 10x of that and stays 1000x under the wrong path's 0.1
        assert mix_error(fixed, reference("deepseek_v32")) < 1e-4


class Float64(TorchFunctionMode):
    """Inside a forward: every cast to float32 (Hugging Face's kernels compute norms, routers and
    the gated delta rule in fp32) stays in float64, so a float64 model rounds at ~1e-16 throughout."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.float:
            return args[0].double()
        swap = {torch.float32: torch.float64}
        args = tuple(swap.get(a, a) if isinstance(a, torch.dtype) else a for a in args)
        kwargs = {k: swap.get(v, v) if isinstance(v, torch.dtype) else v for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


def test_qwen3_5_moe_padded_gradients_differ_by_rounding_alone():
    """Qwen3.5-MoE's right-padded forward (gated delta-net's chunked recurrence, padding beside
    the longest row) against each sequence alone, in float64 throughout: pads after a sequence
    cannot reach its outputs, and the gradients agree to float64 rounding. In fp32 they differ by
    rounding that depth amplifies: ~5e-6 relative for linear_attn.dt_bias and A_log here (whose
    gradients sum many terms that cancel), up to 4e-4 in models of other sizes; a pad leaking into
    the recurrence would not shrink with the precision."""
    lengths = (40, 23, 33, 2, 17, 9, 31, 5)
    rng = random.Random(0)
    seqs = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]
    with Float64():
        model, ref = (build("qwen3_5_moe").double().eval() for _ in range(2))
        packing.enable(model)
        ref.set_attn_implementation("eager")
        for m in (model, ref):
            m.set_experts_implementation("eager")  # grouped_mm takes no float64
        weights = [torch.randn(n - 1, generator=torch.Generator().manual_seed(n), dtype=torch.float64) for n in lengths]
        want = [token_logprobs(ref(input_ids=torch.tensor([s])).logits, torch.tensor([s]))[0] for s in seqs]
        sum((r * w).sum() for r, w in zip(want, weights)).backward()
        mb = packing.model_batch(model, seqs, 0, packed=False)
        got = token_logprobs(model(**mb.inputs).logits, mb.inputs["input_ids"])
        sum((got[i, : n - 1] * w).sum() for i, (n, w) in enumerate(zip(lengths, weights))).backward()
    assert max((got[i, : n - 1] - r).abs().max().item() for i, (n, r) in enumerate(zip(lengths, want))) < 1e-12
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert (p.grad - grads[name].grad).norm() <= 1e-10 * grads[name].grad.norm(), name


def test_window_and_softcap_reach_the_packed_attention(seqs, tmp_path):
    """The mechanism the matrix relies on, made to fail: with the window dropped (as before
    this check existed) Mistral's packed forward is wrong and the self-check catches it."""
    model, report = loaded("mistral", tmp_path)
    assert report.packed and max(LENGTHS) > WINDOW
    original = packing.window_mask
    packing.window_mask = lambda width, window, device=None, chunk=None: None
    try:
        with pytest.raises(PackingCheckError):
            check_packing(model, VOCAB, 64, padding_free=True, policy="error", tol=1e-4)
    finally:
        packing.window_mask = original


@pytest.mark.parametrize("name", sorted(NO_PACKING))
def test_packing_refused_stops_the_run_under_the_error_policy(name, tmp_path):
    """Each refusal says why in one line: the attention bypassed, a packed row that mixes its
    sequences, or a packed forward the model itself refuses (gated delta-net without
    flash-linear-attention)."""
    save(name, tmp_path / name)
    why = {"falcon": "never called exactrl's packed attention", "bloom": "never called exactrl's packed attention",
           "mamba2": "never called exactrl's packed attention",
           "deepseek_v32": "a packed forward fails .*sparse-attention",
           **dict.fromkeys(("qwen3_5", "qwen3_5_moe", "qwen3_next"), "a packed forward fails .*flash-linear-attention")}
    with pytest.raises(PackingCheckError, match=why.get(name, "packed rows differ from each sequence alone")) as e:
        check_packing(load_causal_lm(tmp_path / name), VOCAB, 64, padding_free=True, policy="error", tol=1e-4)
    assert "\n" not in str(e.value)


def test_rl_refuses_dropout():
    from exactrl.config import ConfigError, RLConfig, load_config

    with pytest.raises(ConfigError, match="model.disable_dropout=false"):
        load_config(RLConfig, None, ["model.disable_dropout=false"])


def test_dropout_is_off_in_training_mode(tmp_path):
    """GPT-2 ships dropout 0.1: loaded by exactrl, two train-mode forwards are identical and
    equal the eval-mode one; with model.disable_dropout=false (sft only) dropout stays."""
    save("gpt2", tmp_path / "gpt2")
    ids = torch.tensor([[5, 9, 14, 3, 22, 40, 7]])
    model = load_causal_lm(tmp_path / "gpt2")
    a, b = model(input_ids=ids).logits, model(input_ids=ids).logits
    assert torch.equal(a, b) and torch.equal(a, model.eval()(input_ids=ids).logits)
    kept = load_causal_lm(tmp_path / "gpt2", dropout=True)
    assert not torch.equal(kept(input_ids=ids).logits, kept(input_ids=ids).logits)


# --- the CLI, as a user runs it -------------------------------------------------------------

# One architecture of each family: window, softcap, dropout, ALiBi (packing refused); gated
# delta-net hybrid, Mamba-2 (cache_params), MLA latents, attention sinks, sparse top-k, chunks and
# NoPE temperature, a cache class of its own (decoded through generate, unpadded), a decoding gap
# trained with its correction (Nemotron-H).
CLI_IN_CI = ("mistral", "gemma2", "gpt2", "bloom", "qwen3_5", "mamba2", "deepseek_v3", "gpt_oss", "deepseek_v32",
             "llama4", "minimax", "nemotron_h")


def write_data(path):
    rng = random.Random(0)
    rows = []
    for _ in range(16):
        a, b = rng.randrange(10, 99), rng.randrange(10, 99)
        rows.append({"prompt": f"{a}+{b}=", "completion": f"{a + b}", "answer": str(a + b)})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_cli(args, tmp_path):
    """The CLI in this process (test_cli_failures.exactrl): its code path and exit code, without
    a fresh interpreter's ~10 s of imports per run."""
    proc = exactrl(args, tmp_path, tmp_path / "cache")
    assert proc.returncode == 0, f"exactrl {' '.join(args)} failed:\n{proc.stderr[-3000:]}"
    return proc


def cli_two_steps(name, tmp_path):
    model_dir = save(name, tmp_path / name, tokenizer=build_tokenizer())
    data = write_data(tmp_path / "data.jsonl")
    common = [f"model.path={model_dir}", f"data.train={data}", "data.eval=null", "train.max_steps=2",
              "train.log_every=1",
              "train.micro_batch_size=4"]
    run_cli(["sft", *common, "train.global_batch_size=8", f"output_dir={tmp_path / 'sft'}"], tmp_path)
    phases = ["sft"]
    if name not in RANDOM:  # rl refuses a random training step (tests/test_self_checks.py)
        corrected = [f"algo.rollout_correction={CORRECTED[name]}"] if name in CORRECTED else []
        run_cli(["rl", *common, "train.global_batch_size=8", "algo.group_size=4", "rollout.max_new_tokens=12",
                 f"algo.gen_ratio_tol={GEN_RATIO_TOL.get(name, 1e-4)}", "reward.fn=exactrl.tasks.arithmetic:reward",
                 *corrected, f"output_dir={tmp_path / 'rl'}"], tmp_path)
        phases.append("rl")
    for phase in phases:
        checks = json.loads((tmp_path / phase / "manifest.json").read_text())["checks"]
        check = checks[f"packing/{phase}/policy"]
        assert check["packed"] == (name not in NO_PACKING) and check["padded_error"] < 1e-5, check
        assert name in NO_PACKING or check["packed_error"] < 1e-5, check
    if "rl" in phases:
        gen = checks["generation/rl/policy"]
        assert gen["decoder"] == DECODER.get(name, "exactrl loop"), gen
        assert gen["logprob_error"] < (GEN_RATIO_TOL[name] if name in CORRECTED else 1e-3), gen
        assert gen["gap_corrected"] == CORRECTED.get(name), gen
        lines = (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()
        steps = [json.loads(line) for line in lines if '"ratio_dev_first"' in line]
        assert len(steps) == 2 and all(s["ratio_dev_first"] < GEN_RATIO_TOL.get(name, 1e-4) for s in steps), steps
        assert (tmp_path / "rl" / "final" / "model.safetensors").is_file()


@pytest.mark.parametrize("name", CLI_IN_CI)
def test_cli_sft_and_rl_two_steps(name, tmp_path):
    cli_two_steps(name, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in ARCHS if n not in CLI_IN_CI])
def test_cli_sft_and_rl_two_steps_every_architecture(name, tmp_path):
    cli_two_steps(name, tmp_path)
