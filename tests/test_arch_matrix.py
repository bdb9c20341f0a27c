"""Every architecture family exactrl accepts, through the path a run takes: the model as
exactrl loads it (its kernel, dropout off) after the packing self-check, against Hugging
Face's own eager forward of each sequence alone.

* the training forward (packed, or padded where the self-check turned packing off) gives the
  reference's log-probs and gradients;
* exactrl's decode loop picks the same greedy tokens as ``generate``;
* ``exactrl sft`` and ``exactrl rl`` run two steps through the CLI with the packing self-check
  and the on-policy check (against the generator, at 1e-4) passing: a subset here, every
  architecture under ``-m slow``.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch
from archs import ARCHS, VOCAB, WINDOW, build, save

from exactrl.checks.packing import PackingCheckError, check_packing
from exactrl.losses.token_losses import token_logprobs
from exactrl.models import packing
from exactrl.models.loading import load_causal_lm
from exactrl.rollout.hf import sample
from exactrl.tasks.tokenizer import build_tokenizer

NO_PACKING = {"falcon", "bloom"}  # ALiBi computed inside the model: packing must be refused
LENGTHS = (23, 5, 17, 12, 2)  # several longer than the sliding window (8)


@pytest.fixture(scope="module")
def seqs():
    rng = random.Random(0)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in LENGTHS]


def loaded(name, tmp_path, attn="sdpa"):
    """The model as a run gets it: saved, loaded by exactrl, self-checked."""
    save(name, tmp_path / name)
    model = load_causal_lm(tmp_path / name, attn=attn)
    report = check_packing(model, VOCAB, 64, padding_free=True, policy="fallback", tol=1e-4)
    return model, report


def reference(name):
    """The same weights through Hugging Face's eager attention, eval mode (no dropout)."""
    ref = build(name)
    ref.set_attn_implementation("eager")
    return ref.eval()


@pytest.mark.parametrize("name,attn", [(n, "sdpa") for n in ARCHS] + [("llama", "eager"), ("gemma2", "eager"), ("mistral", "eager")])
def test_training_forward_matches_each_sequence_alone(name, attn, seqs, tmp_path):
    model, report = loaded(name, tmp_path, attn)
    assert report.packed == (name not in NO_PACKING), report
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
    total = torch.cat([g.flatten() for g in grads.values()]).norm().item()
    for n, p in model.named_parameters():
        # Parameters whose true gradient is zero (OPT's key bias: softmax ignores a shift shared
        # by every key) carry rounding noise of the whole model's scale, hence the second term.
        assert (p.grad - grads[n]).norm().item() <= 1e-5 * grads[n].norm().item() + 1e-7 * total, n


@pytest.mark.parametrize("name", ARCHS)
def test_decode_loop_matches_generate(name, seqs, tmp_path):
    model, _ = loaded(name, tmp_path)
    model.eval()
    prompts = [[1] + seqs[0][:7], [1] + seqs[2][:3], [1] + seqs[3][:5]]  # left-padded to 8; 16 new tokens pass the window
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attention = (ids != 0).long()
    tokens, _ = sample(model, ids, attention, max_new_tokens=16, eos=2, pad=0, greedy=True)
    expected = reference(name).generate(input_ids=ids, attention_mask=attention, max_new_tokens=16, do_sample=False,
                                        pad_token_id=0, eos_token_id=2)[:, width:]
    for got, want in zip(tokens.tolist(), expected.tolist()):
        assert got[: len(want)] == want


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
    save(name, tmp_path / name)
    with pytest.raises(PackingCheckError, match="never called exactrl's packed attention"):
        check_packing(load_causal_lm(tmp_path / name), VOCAB, 64, padding_free=True, policy="error", tol=1e-4)


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

CLI_IN_CI = ("mistral", "gemma2", "gpt2", "bloom")  # window, softcap, dropout, packing refused


def write_data(path):
    rng = random.Random(0)
    rows = []
    for _ in range(16):
        a, b = rng.randrange(10, 99), rng.randrange(10, 99)
        rows.append({"prompt": f"{a}+{b}=", "completion": f"{a + b}", "answer": str(a + b)})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_cli(args, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EXACTRL_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "exactrl.cli", *args], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exactrl {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def cli_two_steps(name, tmp_path):
    model_dir = save(name, tmp_path / name, tokenizer=build_tokenizer())
    data = write_data(tmp_path / "data.jsonl")
    common = [f"model.path={model_dir}", f"data.train={data}", "data.eval=null", "train.max_steps=2", "train.log_every=1",
              "train.micro_batch_size=4"]
    run_cli(["sft", *common, "train.global_batch_size=8", f"output_dir={tmp_path / 'sft'}"], tmp_path)
    run_cli(["rl", *common, "train.global_batch_size=8", "algo.group_size=4", "rollout.max_new_tokens=12",
             "algo.gen_ratio_tol=1e-4", "reward.fn=exactrl.tasks.arithmetic:reward", f"output_dir={tmp_path / 'rl'}"], tmp_path)
    for phase in ("sft", "rl"):
        check = json.loads((tmp_path / phase / "manifest.json").read_text())["checks"][f"packing/{phase}/policy"]
        assert check["packed"] == (name not in NO_PACKING) and check["padded_error"] < 1e-5, check
        assert check["packed_error"] < 1e-5 or name in NO_PACKING, check
    steps = [json.loads(line) for line in open(tmp_path / "rl" / "metrics.jsonl") if '"ratio_dev_first"' in line]
    assert len(steps) == 2 and all(s["ratio_dev_first"] < 1e-4 for s in steps), steps
    assert (tmp_path / "rl" / "final" / "model.safetensors").is_file()


@pytest.mark.parametrize("name", CLI_IN_CI)
def test_cli_sft_and_rl_two_steps(name, tmp_path):
    cli_two_steps(name, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in ARCHS if n not in CLI_IN_CI])
def test_cli_sft_and_rl_two_steps_every_architecture(name, tmp_path):
    cli_two_steps(name, tmp_path)
