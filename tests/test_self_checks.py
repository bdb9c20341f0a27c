"""The start-up self-checks catch what they exist for, made to fail by putting the bug back:

* generation (exactrl/rollout/generation_check.py): a decode loop that mixes up rows after they leave
  the batch, or feeds Mamba-2 the wrong cache argument (the bug before this check), is caught and
  the model decodes through ``generate``; a training forward that even ``generate`` cannot match
  stops the run;
* determinism (exactrl/checks/determinism.py): dropout left on, or PhiMoE's sampled routing, is
  found and named; ``rl`` refuses it in one line;
* packing (exactrl/checks/packing.py): each length mechanism is exercised by the probes (a
  kernel without Llama 4's chunk mask or NoPE temperature correction fails it), a setting the
  check does not know turns packing off, a kernel that misses a mechanism on padded batches too
  (gpt-oss's sinks dropped) hands the model to its own attention, and a rotary embedding that
  depends on the batch is refused past its original length;
* the CLI turns a self-check's stop into one line and exit code 3.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from archs import VOCAB, build, save
from exactrl.checks.determinism import check_determinism
from exactrl.checks.packing import PackingCheckError, check_packing
from exactrl.losses.token_losses import token_logprobs
from exactrl.models import packing
from exactrl.models.loading import load_causal_lm
from exactrl.rollout import hf
from exactrl.rollout.generation_check import GenerationCheckError, check_generation
from test_cli_failures import TINY, exactrl, one_line_error

ROOT = Path(__file__).resolve().parents[1]


def loaded(name, tmp_path, **kw):
    save(name, tmp_path / name)
    return load_causal_lm(tmp_path / name, **kw)


def packing_checked(name, tmp_path):
    """Loaded and self-checked for packing, as a run has it before the generation check: these
    models train on padded rows."""
    model = loaded(name, tmp_path)
    assert not check_packing(model, VOCAB, 64, padding_free=True, policy="fallback", tol=1e-4).packed
    return model


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


# --- generation ------------------------------------------------------------------------------

def test_a_loop_that_mixes_up_rows_is_caught_and_generate_takes_over(tmp_path, monkeypatch):
    model = loaded("llama", tmp_path)
    assert check_generation(model, VOCAB, eos=2, pad=0, policy="error", tol=1e-3).decoder == "exactrl loop"
    keep = hf._keep_rows
    monkeypatch.setattr(hf, "_keep_rows", lambda cache, rows: keep(cache, rows.flip(0)))  # the wrong rows stay
    with pytest.raises(GenerationCheckError, match="greedy tokens differ from generate's"):
        check_generation(model, VOCAB, eos=2, pad=0, policy="error", tol=1e-3)
    report = check_generation(model, VOCAB, eos=2, pad=0, policy="fallback", tol=1e-3)
    assert report.decoder == "generate" and "decoding through generate instead" in report.notice
    assert report.logprob_error < 1e-5  # generate's sampled log-probs equal the training forward's
    assert hf.decodes_with_generate(model)


def test_mamba2_given_the_wrong_cache_argument_is_caught(tmp_path, monkeypatch):
    """The bug this check was written after: Mamba2ForCausalLM swallows past_key_values, so each
    decode step saw only its new token."""
    model = packing_checked("mamba2", tmp_path)
    decode_cache = hf.decode_cache
    monkeypatch.setattr(hf, "decode_cache", lambda m, n: ("past_key_values", decode_cache(m, n)[1]))
    report = check_generation(model, VOCAB, eos=2, pad=0, policy="fallback", tol=1e-3)
    assert report.decoder == "generate" and "exactrl loop" in report.reasons, report


def test_a_training_forward_that_no_decoder_can_match_stops(tmp_path):
    model = loaded("llama", tmp_path)
    model.train()
    for m in model.modules():  # a policy whose training forward is not the generator's
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = 0.5
    with pytest.raises(GenerationCheckError, match="exactrl loop: .*; generate: .*; generate, unpadded: .*no decoder "
                                                   "samples with the training forward's log-probs, so rollouts would "
                                                   r"not be on-policy; set algo.rollout_correction \(tis"):
        check_generation(model, VOCAB, eos=2, pad=0, policy="fallback", tol=1e-3)


def test_nemotron_h_decodes_off_the_training_forward_and_trains_only_with_the_gap_corrected(tmp_path):
    """Every decoder of Nemotron-H samples off its training forward: Hugging Face's one-token Mamba-2
    step leaves out the lower limit the chunked scan puts on the step size (time_step_min). rl stops
    and names the way on; with algo.rollout_correction it goes on through the fastest decoder. With
    the limit lifted from the scan too, decoding agrees: that limit is the whole gap."""
    model = packing_checked("nemotron_h", tmp_path)
    with pytest.raises(GenerationCheckError, match="set algo.rollout_correction") as e:
        check_generation(model, VOCAB, eos=2, pad=0, policy="fallback", tol=1e-3)
    assert "\n" not in str(e.value)
    report = check_generation(packing_checked("nemotron_h", tmp_path / "again"), VOCAB, eos=2, pad=0, policy="fallback",
                              tol=1e-3, correction="tis")
    assert report.decoder == "exactrl loop" and report.gap_corrected == "tis" and 1e-3 < report.logprob_error < 1e-2
    assert "corrected by algo.rollout_correction=tis" in report.notice
    for m in model.modules():
        if hasattr(m, "time_step_limit"):
            m.time_step_limit = (0.0, float("inf"))
    hf.use_generate(model, None)
    hf.use_unpadded(model, None)
    assert check_generation(model, VOCAB, eos=2, pad=0, policy="error", tol=1e-5).logprob_error < 1e-5


def test_minimax_left_padded_decoding_is_caught_and_its_prompts_decode_unpadded(tmp_path):
    """MiniMax-01's cache takes its length from layer 0, a lightning-attention layer holding no keys,
    so generate's left-padded decode steps mask the wrong keys: caught by greedy decoding against
    the prompts without padding; the prompts of each length then decode apart, and agree."""
    model = packing_checked("minimax", tmp_path)
    with pytest.raises(GenerationCheckError, match="generate: greedy tokens differ from generate's on the prompts "
                                                   "without padding.*fallback decodes through generate on the "
                                                   r"prompts of each length apart \(no left padding\)"):
        check_generation(model, VOCAB, eos=2, pad=0, policy="error", tol=1e-3)
    report = check_generation(model, VOCAB, eos=2, pad=0, policy="fallback", tol=1e-3)
    # log-prob gap 2.4e-6 on an AVX2 EPYC: 1e-4 keeps more than 10x for other CPUs' rounding, 1000x under a wrong mask
    assert report.decoder == "generate, unpadded" and report.logprob_error < 1e-4, report
    assert hf.decodes_unpadded(model) and "no left padding" in report.notice


def test_the_check_leaves_the_runs_random_stream_alone(tmp_path):
    model = loaded("llama", tmp_path)
    torch.manual_seed(5)
    before = torch.random.get_rng_state()
    check_generation(model, VOCAB, eos=2, pad=0, policy="error", tol=1e-3)
    assert torch.equal(before, torch.random.get_rng_state())


@pytest.mark.parametrize("top_k", [0, 4])
def test_generate_returns_the_log_probs_the_loop_samples_with(tmp_path, top_k):
    """sample_with_generate against the loop: the same draws, the same log-probs (the same
    keys, no row leaving the batch), and against the training forward; a model's own
    generation_config.json (top-k, a repetition penalty) shapes neither."""
    model = loaded("qwen3", tmp_path).eval()
    model.generation_config.top_k, model.generation_config.repetition_penalty = 5, 1.5
    ids = torch.tensor([[0, 0, 1, 5, 9], [1, 7, 3, 8, 4]])
    kw = {"max_new_tokens": 8, "eos": 2, "pad": 0, "temperature": 0.7, "top_p": 0.9, "top_k": top_k, "seeds": [0, 1]}
    a, la = hf.sample(model, ids, (ids != 0).long(), compact_at=2.0, **kw)
    b, lb = hf.sample_with_generate(model, ids, (ids != 0).long(), **kw)
    assert torch.equal(a, b) and (la - lb).abs().max() < 1e-5
    got = [row[: row.index(2) + 1] if 2 in row else row for row in b.tolist()]  # up to EOS: padding follows
    seqs = [[t for t in row if t] + g for row, g in zip(ids.tolist(), got)]
    mb = packing.model_batch(model, seqs, 0, packed=True)
    lp = mb.repad(token_logprobs(model(**mb.inputs).logits, mb.inputs["input_ids"], 0.7))
    for i, row in enumerate(ids.tolist()):
        start, n = sum(t != 0 for t in row) - 1, len(got[i])
        assert (lp[i, start : start + n] - lb[i, :n]).abs().max() < 1e-5


def test_unpadded_decoding_draws_each_rows_tokens_as_alone(tmp_path, monkeypatch):
    """Prompts decoded by length (the self-check's third rung): each row draws the tokens and
    log-probs it draws alone, in its own place; a length only another rank has (sharded
    parameters: every rank steps through it) decodes a stand-in row that changes nothing."""
    from exactrl.rollout import unpadded

    model = loaded("llama", tmp_path).eval()
    prompts = [[5, 9, 14], [7, 3, 22, 40, 17], [11, 12], [8, 6, 4]]
    ids = torch.tensor([[0] * (5 - len(p)) + p for p in prompts])
    kw = {"max_new_tokens": 6, "eos": 2, "pad": 0, "temperature": 0.8, "seeds": [3, 4, 5, 6]}
    hf.use_unpadded(model, "test")
    monkeypatch.setattr(unpadded, "_lengths_of_every_rank", lambda lengths, synced: [1, *sorted(set(lengths))])
    tokens, logprobs = hf.sample(model, ids, (ids != 0).long(), **kw)
    for i, p in enumerate(prompts):
        alone, lp = hf.sample(model, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long),
                              **(kw | {"seeds": kw["seeds"][i : i + 1]}))
        assert torch.equal(tokens[i], alone[0]) and (logprobs[i] - lp[0]).abs().max() < 1e-5  # fp32, batched


# --- determinism -----------------------------------------------------------------------------

def test_dropout_left_on_is_found_and_named(tmp_path):
    report = check_determinism(loaded("gpt2", tmp_path, dropout=True), VOCAB, [13, 24, 3])
    assert not report.deterministic and "Dropout" in report.source
    assert check_determinism(load_causal_lm(tmp_path / "gpt2"), VOCAB, [13, 24, 3]).deterministic


def test_phimoe_sampled_routing_is_found_whatever_the_draw(tmp_path):
    """sparsemixer draws from torch's stream in train mode; a draw that happens to pick the same
    experts must not pass."""
    model = loaded("phimoe", tmp_path)
    for seed in range(3):
        torch.manual_seed(seed)
        report = check_determinism(model, VOCAB, [13, 24, 3])
        assert not report.deterministic and report.source == "model.layers.0.mlp.router (PhimoeTopKRouter)"
    assert all(p.grad is None for p in model.parameters())


def test_a_random_backward_is_found(tmp_path):
    """Randomness only in the backward (a sampled gradient estimator) draws from torch's stream too."""
    model = loaded("llama", tmp_path)
    mlp = model.model.layers[0].mlp
    mlp.register_full_backward_hook(lambda m, gin, gout: tuple(g * (1 + torch.rand_like(g)) for g in gin))
    report = check_determinism(model, VOCAB, [13, 24, 3])
    assert not report.deterministic and report.source.startswith("the backward pass"), report


def test_rl_refuses_a_random_training_step_in_one_line_and_sft_trains(tmp_path, cache):
    from exactrl.tasks.tokenizer import build_tokenizer

    model_dir = save("phimoe", tmp_path / "phimoe", tokenizer=build_tokenizer())
    data = tmp_path / "data.jsonl"
    rng = random.Random(0)
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "completion": str(2 * a), "answer": str(2 * a)}) + "\n"
                            for a in (rng.randrange(10, 99) for _ in range(16))))
    common = [*TINY, f"model.path={model_dir}", f"data.train={data}", "train.max_steps=1"]
    out = tmp_path / "rl"
    proc = exactrl(["rl", *common, "algo.group_size=4", "rollout.max_new_tokens=4",
                    "reward.fn=exactrl.tasks.arithmetic:reward",
                    f"output_dir={out}"], tmp_path, cache)
    line = one_line_error(proc, 3)
    assert "training step is random" in line and "PhimoeTopKRouter" in line and "exactrl sft only" in line, line
    assert json.loads((out / "status.json").read_text())["state"] == "check"
    with pytest.warns(UserWarning, match="training with it, and comparing packed and padded forwards in eval mode"):
        proc = exactrl(["sft", *common, f"output_dir={tmp_path / 'sft'}"], tmp_path, cache)
    assert proc.returncode == 0, proc.stderr[-2000:]
    checks = json.loads((tmp_path / "sft" / "manifest.json").read_text())["checks"]
    assert not checks["determinism/sft/policy"]["deterministic"] and checks["packing/sft/policy"]["mode"] == "eval"


# --- packing ---------------------------------------------------------------------------------

@pytest.mark.parametrize("mechanism", ["chunk", "temperature"])
def test_the_probes_reach_llama4s_chunks_and_nope_temperature(tmp_path, monkeypatch, mechanism):
    """Each of the two mechanisms alone breaks packed rows when exactrl's kernel misses it, and
    the probes (past attention_chunk_size and floor_scale) show it."""
    model = loaded("llama4", tmp_path)
    assert check_packing(model, VOCAB, 64, padding_free=True, policy="error", tol=1e-4).packed
    if mechanism == "chunk":
        monkeypatch.setattr(packing, "_chunk", lambda module: None)
    else:
        monkeypatch.setattr(packing, "_nope_temperature", lambda module, query, mask, cu: query)
    with pytest.raises(PackingCheckError, match="packed rows differ from each sequence alone"):
        check_packing(model, VOCAB, 64, padding_free=True, policy="error", tol=1e-4)


def test_a_length_setting_the_check_does_not_know_turns_packing_off(tmp_path):
    model = loaded("llama", tmp_path)
    model.config.memory_window = 16  # a mechanism the probes would not know to exercise
    report = check_packing(model, VOCAB, 64, padding_free=True, policy="fallback", tol=1e-4)
    assert not report.packed and "memory_window=16" in report.notice and not packing.can_pack(model)


def test_a_kernel_missing_a_mechanism_hands_the_model_to_its_own_attention(tmp_path, monkeypatch):
    """gpt-oss's attention sinks dropped from exactrl's kernel (as before this issue): padded
    batches are wrong too, so the model trains through Hugging Face's own (eager) attention,
    which the training forward then matches."""
    model = loaded("gpt_oss", tmp_path)
    eager = packing.eager_attention
    monkeypatch.setattr(packing, "eager_attention", lambda *a, s_aux=None, **k: eager(*a, **k))
    report = check_packing(model, VOCAB, 64, padding_free=True, policy="fallback", tol=1e-4)
    assert report.attention == "hf eager" and not report.packed and report.padded_error < 1e-5
    assert "right-padded batches through exactrl's attention differ" in report.notice
    with pytest.raises(PackingCheckError, match="hands the model to its own attention"):
        check_packing(loaded("gpt_oss", tmp_path / "again"), VOCAB, 64, padding_free=True, policy="error", tol=1e-4)
    ref = build("gpt_oss").eval()
    seqs = [[5, 9, 14, 3, 22, 40, 7, 8, 9, 10, 11], [6, 7, 8]]
    mb = packing.model_batch(model, seqs, 0, packed=True)
    got = mb.repad(token_logprobs(model(**mb.inputs).logits, mb.inputs["input_ids"]))
    for i, s in enumerate(seqs):
        ids = torch.tensor([s])
        want = token_logprobs(ref(input_ids=ids).logits, ids)[0]
        assert (got[i, : len(s) - 1] - want).abs().max() < 1e-5


def test_a_rotary_embedding_that_follows_the_batch_is_refused_past_its_length(tmp_path):
    """LongRoPE switches factors by the longest position in a batch: no batching of sequences
    beyond its original length computes what each does alone."""
    from archs import ARCHS

    rope = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [4.0] * 4,
            "original_max_position_embeddings": 32,
            "rope_theta": 10000.0}
    ARCHS["phi3_longrope"] = ("Phi3Config", dict(ARCHS["phi3"][1], rope_parameters=rope, max_position_embeddings=128,
                                                       original_max_position_embeddings=32))
    try:
        model = loaded("phi3_longrope", tmp_path)
    finally:
        del ARCHS["phi3_longrope"]
    assert check_packing(model, VOCAB, 32, padding_free=True, policy="error", tol=1e-4).packed
    with pytest.raises(PackingCheckError, match="past 32 positions LongRoPE switches to its long factors"):
        check_packing(model, VOCAB, 48, padding_free=True, policy="fallback", tol=1e-4)
    # the reason is true: Hugging Face's own model gives a short sequence other logits beside a long one
    model.set_attn_implementation("eager")
    short, long = [5, 9, 14, 3, 22], list(range(3, 43))
    alone = model(input_ids=torch.tensor([short])).logits[0]
    batch = torch.tensor([short + [0] * 35, long])
    beside = model(input_ids=batch, attention_mask=(torch.arange(40) < torch.tensor([[5], [40]])).long()).logits[0, :5]
    assert (alone - beside).abs().max() > 1e-2


# --- the CLI ---------------------------------------------------------------------------------

def test_an_on_policy_stop_is_one_line_and_exit_3(tmp_path, cache):
    out = tmp_path / "run"
    proc = exactrl(["rl", "--config", "examples/grpo_tiny.yaml", *TINY, "train.max_steps=1", "algo.group_size=4",
                    "rollout.max_new_tokens=8", "algo.gen_ratio_tol=1e-12", "model.path=builtin", f"output_dir={out}"],
                   ROOT, cache)
    line = one_line_error(proc, 3)
    assert line.startswith("stopped by a self-check: on-policy check failed at rollout 0"), line
    assert json.loads((out / "status.json").read_text())["state"] == "check"


def test_a_packing_stop_is_one_line_and_exit_3(tmp_path, cache):
    """Bloom computes ALiBi attention itself: under train.packing_check=error the run stops."""
    from exactrl.tasks.tokenizer import build_tokenizer

    model_dir = save("bloom", tmp_path / "bloom", tokenizer=build_tokenizer())
    out = tmp_path / "run"
    proc = exactrl(["sft", *TINY, f"model.path={model_dir}", "train.max_steps=1", "train.packing_check=error",
                    f"output_dir={out}"], ROOT, cache)
    line = one_line_error(proc, 3)
    assert line.startswith("stopped by a self-check: packing self-check failed for the policy model "
                           "(BloomForCausalLM"), line
    assert "never called exactrl's packed attention" in line and "set train.padding_free=false" in line
    assert json.loads((out / "status.json").read_text())["state"] == "check"
