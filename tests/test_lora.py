"""LoRA (model.lora.*, exactrl/models/lora.py): the same exactness promises as full training.

* the accumulated adapter gradient equals one full-batch backward through the same adapters
  (SFT and the GRPO policy loss; adapters initialised non-zero so gradients reach A and B),
  with the independent references of tests/test_grad_equivalence.py;
* only adapter weights move; the base stays bit-identical;
* the reference (adapters disabled) is the base model, bit for bit, also inside train_rl;
* generation sees the adapters; SFT and RL runs stop and resume to the same adapter, bitwise;
* final/ holds the adapter in peft's format and, with merge_on_save, a merged model whose
  logits match the adapted model's; the canary catches a lost micro-batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from exactrl.algorithms.rl import train_rl
from exactrl.algorithms.sft import train_sft
from exactrl.checks.canary import CanaryError
from exactrl.config import DemoConfig, RLConfig, SFTConfig, load_config
from exactrl.config.loader import ConfigError
from exactrl.config.schema import LoraConfig
from exactrl.distributed.checkpoint import save_pretrained
from exactrl.losses import AGG_MODES
from exactrl.models.loading import load_causal_lm
from exactrl.models.lora import LoraError, apply_lora, reference_mode
from exactrl.rollout.hf import HFEngine
from exactrl.tasks.builtin import BuiltinSpec, ensure_builtin
from rl_helpers import attach_logprobs
from test_grad_equivalence import (
    SPLITS,
    accumulate_policy_loss,
    grads,
    grpo_reference,
    rel_err,
    rl_cfg,
    rl_samples,
    sft_cfg,
    sft_exactrl,
    sft_examples,
    sft_reference,
)

pytest.importorskip("peft")

__all__ = ["rl_samples", "sft_examples"]  # fixtures of test_grad_equivalence, here computed on the LoRA model below

TOL = 1e-5
SPEC = BuiltinSpec(n_sft=200, n_rl=40, n_eval=10)


def with_adapters(model, seed: int = 5, **lora):
    """``model`` with rank-4 adapters whose A and B are both random (peft starts B at 0, where
    A's gradient would be 0 too and a test could not see it)."""
    model = apply_lora(model, LoraConfig(rank=4, alpha=8.0, **lora))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def base_model(make_model):
    """Overrides test_grad_equivalence's: its fixtures and references run on this LoRA model."""
    return with_adapters(make_model(seed=0))


def adapter_names(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


# ---------------------------------------------------------------- (a) gradient equivalence


@pytest.mark.parametrize("n,k", SPLITS, ids=[f"B{n}-K{k}" for n, k in SPLITS])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_sft_adapter_gradient_equals_full_batch_gradient(mode, n, k, base_model, sft_examples, tokenizer):
    ref = sft_reference(base_model, sft_examples[:n], mode, tokenizer.pad_token_id)
    # A and B both learn
    assert ref.keys() == adapter_names(base_model) and all(g.abs().max() > 0 for g in ref.values())
    model = copy.deepcopy(base_model)
    engine, plan = sft_exactrl(model, sft_examples[:n], sft_cfg(n, k, mode), tokenizer.pad_token_id)
    assert rel_err(grads(model), ref) <= TOL
    assert engine.step(plan)["canary"] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("kl_coef", [0.0, 0.1], ids=["no-kl", "kl"])
@pytest.mark.parametrize("n,k", [(8, 1), (8, 4), (6, 3)], ids=["B8-K1", "B8-K4", "B6-K3"])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_grpo_adapter_gradient_equals_full_batch_gradient(mode, n, k, kl_coef, base_model, rl_samples, tokenizer):
    ref, clip_frac = grpo_reference(base_model, rl_samples[:n], mode, kl_coef, tokenizer.pad_token_id)
    assert 0.05 < clip_frac < 0.95 and ref.keys() == adapter_names(base_model)
    model, engine, plan = accumulate_policy_loss(base_model, rl_samples[:n], rl_cfg(n, k, mode, kl_coef),
                                                 tokenizer.pad_token_id)
    assert rel_err(grads(model), ref) <= TOL
    assert engine.step(plan)["micro_batches"] == k


# ---------------------------------------------------------------- (c) only adapters move; (f) the canary


def test_a_step_moves_only_the_adapters(base_model, sft_examples, tokenizer):
    model = copy.deepcopy(base_model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = sft_cfg(8, 2, "token-mean")
    cfg.optim.name, cfg.optim.weight_decay = "adamw", 0.1  # weight decay would touch any frozen weight in the optimizer
    engine, plan = sft_exactrl(model, sft_examples, cfg, tokenizer.pad_token_id)
    engine.step(plan)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) != (n in adapter_names(model)), n
    assert len(engine.optimizer.param_groups[0]["params"]) == len(adapter_names(model)) > 0


def test_canary_stops_a_lora_step_that_lost_a_micro_batch(base_model, sft_examples, tokenizer):
    from test_canary import DropsGradient

    model = copy.deepcopy(base_model)
    cfg = sft_cfg(8, 4, "token-mean")
    engine = DropsGradient(model, cfg.model, cfg.train, cfg.optim, cfg.audit, 1)
    from exactrl.distributed.step_plan import plan_step
    from rl_helpers import sft_micro_batch_loss

    plan = plan_step([e.loss_tokens for e in sft_examples], 2, "token-mean")
    engine.begin_step(len(plan.micro_batches))
    for mb in plan.micro_batches:
        loss, share = sft_micro_batch_loss(model, engine, [sft_examples[i] for i in mb], tokenizer.pad_token_id,
                                           plan.normalizer)
        engine.backward(loss, share, len(mb))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(CanaryError, match="canary failed at optimizer step 0"):
        engine.step(plan)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


# ---------------------------------------------------------------- (b) the reference; generation


def test_reference_mode_is_the_base_model_bit_for_bit(make_model, rl_samples, tokenizer):
    base = make_model(seed=0)
    lora = with_adapters(make_model(seed=0))
    out = {}
    for name, model, ctx in (("base", base, None), ("off", lora, reference_mode), ("on", lora, None)):
        samples = copy.deepcopy(rl_samples)
        with ctx(model) if ctx else torch.no_grad():
            attach_logprobs(model, samples, "ref_logprobs", [[0, 1, 2], [3, 4, 5, 6, 7]], tokenizer.pad_token_id, 0.8,
                            torch.no_grad)
        out[name] = torch.cat([s.ref_logprobs for s in samples])
    assert torch.equal(out["off"], out["base"])
    assert (out["on"] - out["base"]).abs().max() > 1e-2  # the adapters matter, so the equality above says something
    assert lora.training and all(not m.disable_adapters for n, m in lora.named_modules() if n.endswith("q_proj"))


def test_kv_cached_sampling_sees_the_adapters(base_model, tokenizer):
    """The decode loop's log-probs on the LoRA model equal the training forward's (with the
    adapters); the base model's are far off."""
    model = copy.deepcopy(base_model)
    prompts = [tokenizer(p)["input_ids"] for p in ("12+3=", "347+285=", "1+1=")]
    torch.manual_seed(0)
    gens = HFEngine(model, tokenizer, batch_size=8).generate(prompts, n=2, temperature=1.0, max_new_tokens=12)
    from exactrl.data.batch import Sample

    samples = [Sample(g.prompt_ids, g.response_ids, 0.0) for g in gens]
    for m, attr in ((model, "old_logprobs"), (model.get_base_model(), "ref_logprobs")):
        with reference_mode(model) if attr == "ref_logprobs" else torch.no_grad():
            attach_logprobs(m, samples, attr, [list(range(len(samples)))], tokenizer.pad_token_id, 1.0, torch.no_grad)
    for s, g in zip(samples, gens):
        gen = torch.tensor(g.logprobs)
        assert torch.allclose(s.old_logprobs[len(s.prompt_ids) - 1 :], gen, atol=TOL, rtol=TOL)
    assert max((s.ref_logprobs - s.old_logprobs).abs().max() for s in samples) > 1e-2


# ---------------------------------------------------------------- config mistakes


def test_config_mistakes_are_refused_naming_the_key(make_model):
    with pytest.raises(ConfigError, match="model.lora.target_modules: lm_head"):
        load_config(SFTConfig, None, ["model.lora.rank=4", "model.lora.target_modules=[q_proj,lm_head]"])
    with pytest.raises(ConfigError, match="model.lora.dropout=0.1: RL needs a deterministic forward"):
        load_config(RLConfig, None, ["model.lora.rank=4", "model.lora.dropout=0.1"])
    with pytest.raises(ConfigError, match="sft.model.lora.rank / rl.model.lora.rank: the pipeline hands full models"):
        load_config(DemoConfig, None, ["rl.model.lora.rank=4"])
    assert load_config(SFTConfig, None, ["model.lora.rank=4", "model.lora.dropout=0.1"]).model.lora.dropout == 0.1
    with pytest.raises(LoraError,
                       match="'qkv' matches no linear layer of the model; it has down_proj, gate_proj, k_proj"):
        apply_lora(make_model(0), LoraConfig(rank=4, target_modules=["q_proj", "qkv"]))


def test_named_targets_get_adapters_and_all_linear_spares_the_head(make_model):
    some = apply_lora(make_model(0), LoraConfig(rank=2, target_modules=["q_proj", "v_proj"]))
    assert {n.split(".")[-4] for n in adapter_names(some)} == {"q_proj", "v_proj"}
    every = apply_lora(make_model(0), LoraConfig(rank=2))
    assert {n.split(".")[-4] for n in adapter_names(every)} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                "up_proj", "down_proj"}


def test_one_target_name_on_the_command_line_is_a_suffix_not_a_regex(make_model):
    """peft reads a string as a regex over full module names: model.lora.target_modules=q_proj
    crashed in peft ('Target modules q_proj not found in the base model')."""
    lora = load_config(SFTConfig, None, ["model.lora.rank=2", "model.lora.target_modules=q_proj"]).model.lora
    assert lora.target_modules == ["q_proj"]
    assert {n.split(".")[-4] for n in adapter_names(apply_lora(make_model(0), lora))} == {"q_proj"}
    with pytest.raises(LoraError, match="'qproj' matches no linear layer of the model; it has down_proj, gate_proj"):
        apply_lora(make_model(0), LoraConfig(rank=2, target_modules="qproj"))


# ---------------------------------------------------------------- (e) what final/ holds


def test_merged_model_matches_the_adapted_model_and_leaves_it_alone(base_model, make_model, tokenizer, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = copy.deepcopy(base_model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    save_pretrained(tmp_path / "final", model, tokenizer, merge=True)
    assert {p.name for p in (tmp_path / "final").iterdir()} >= {"adapter_config.json", "adapter_model.safetensors",
                                                                "merged"}
    assert all("lora_" in k for k in load_file(tmp_path / "final" / "adapter_model.safetensors"))
    after = model.state_dict()
    # still adapted, unchanged
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)

    ids = torch.tensor([tokenizer("347+285=#### 632")["input_ids"]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final" / "merged")
        assert not any("lora" in k for k in merged.state_dict())
        got = merged(input_ids=ids).logits
        # as peft loads final/
        reloaded = PeftModel.from_pretrained(make_model(0), tmp_path / "final")(input_ids=ids).logits
        with reference_mode(model):
            base = model(input_ids=ids).logits
    assert (got - want).abs().max() <= TOL * want.abs().max()
    assert (want - base).abs().max() > 1e-2  # the adapters were merged in
    assert torch.equal(reloaded, want)


# ---------------------------------------------------------------- (d) runs resume exactly; the reference in train_rl


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EXACTRL_CACHE", str(tmp_path / "cache"))


def same_adapter(a, b) -> bool:
    wa, wb = load_file(a / "adapter_model.safetensors"), load_file(b / "adapter_model.safetensors")
    return wa.keys() == wb.keys() and all(wa[k].equal(wb[k]) for k in wa)


def test_lora_sft_resumes_to_the_same_adapter(tmp_path, cache):
    common = ["data.eval=null", "train.global_batch_size=8", "train.micro_batch_size=4", "train.max_steps=6",
              "optim.warmup_steps=2", "optim.weight_decay=0.01", "model.lora.rank=4", "model.lora.dropout=0.1"]
    full = train_sft(load_config(SFTConfig, None, [*common, "train.save_every=3", f"output_dir={tmp_path / 'full'}"]),
                     spec=SPEC)
    ckpt = full.run_dir / "checkpoint-3"
    assert not (ckpt / "model.safetensors").exists() and all("lora_" in k
                                                             for k in load_file(ckpt / "adapter_model.safetensors"))
    resumed = train_sft(load_config(SFTConfig, None, [*common, f"train.resume_from={ckpt}",
                                                      "model.lora.merge_on_save=true",
                                                      f"output_dir={tmp_path / 'resumed'}"]), spec=SPEC)
    assert same_adapter(full.final_model, resumed.final_model)
    assert not same_adapter(full.final_model, ckpt)
    assert ((resumed.final_model / "merged" / "model.safetensors").is_file()
            and not (full.final_model / "merged").exists())


def test_lora_rl_resumes_to_the_same_adapter_and_its_reference_is_the_base(tmp_path, cache, monkeypatch):
    from exactrl.workers.worker import Worker

    calls = []
    forward_fields = Worker.forward_fields  # the RL loop's no-gradient pass (Worker.forward goes through it too)

    def recording(self, samples, names, micro_batches):
        out = forward_fields(self, samples, names, micro_batches)
        if self.role == "reference" and "logprobs" in names:
            calls.append((copy.deepcopy(samples), micro_batches, out["logprobs"], self))
        return out

    monkeypatch.setattr(Worker, "forward_fields", recording)
    common = ["data.eval=null", "train.global_batch_size=8", "train.micro_batch_size=4", "algo.group_size=4",
              "train.max_steps=4", "algo.mini_batches=2", "algo.kl_coef=0.1", "rollout.max_new_tokens=8",
              "algo.kl_target=0.05", "algo.kl_horizon=20", "optim.lr=1e-2", "reward.fn=reward_fixtures:varied",
              "model.lora.rank=4"]
    full = train_rl(load_config(RLConfig, None, [*common, "train.save_every=2", f"output_dir={tmp_path / 'full'}"]),
                    spec=SPEC)
    resumed = train_rl(load_config(RLConfig, None, [*common, f"train.resume_from={full.run_dir / 'checkpoint-2'}",
                                                    f"output_dir={tmp_path / 'resumed'}"]), spec=SPEC)
    assert same_adapter(full.final_model, resumed.final_model)
    assert not same_adapter(full.final_model, full.run_dir / "checkpoint-2")

    # The reference log-probs of the last rollout (after the adapters moved) are the base model's.
    samples, micro_batches, got, worker = calls[-1]
    base = load_causal_lm(ensure_builtin(SPEC).model, trainable=False)
    expect = Worker("reference", base, pad_id=worker.pad_id, packed=worker.packed, temperature=worker.temperature,
                    autocast=worker.autocast).forward(samples, "logprobs", micro_batches)
    assert all(torch.equal(g, e) for g, e in zip(got, expect))
    assert max((g - s.old_logprobs).abs().max() for g, s in zip(got, samples)) > 1e-4  # the policy has moved from it


def test_an_adapter_directory_given_as_a_model_says_what_to_load(base_model, tokenizer, tmp_path):
    from exactrl.models.loading import ModelLoadError

    save_pretrained(tmp_path / "final", copy.deepcopy(base_model), tokenizer)
    with pytest.raises(ModelLoadError, match="holds a LoRA adapter, not a model: load its merged/ directory"):
        load_causal_lm(tmp_path / "final")
