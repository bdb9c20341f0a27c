"""Weight export as a worker method, the same from every engine (tests/dist/export.py): full,
Hugging Face-named tensors one at a time, equal to the saved checkpoint's names and values, with
and without LoRA, on one process and on FSDP2 / DeepSpeed ZeRO-2 and ZeRO-3 at world size 2; a
generator with a model of its own loads them verified; the in-process generator, which shares
the trainer's model, is handed that model's own parameters and gathers nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from distributed_harness import run_cases
from exactrl.config import SFTConfig, load_config
from exactrl.distributed.engine import build_engine
from exactrl.rollout.generator import WeightSyncError
from exactrl.rollout.hf import HFEngine
from exactrl.tasks.tiny_model import build_tiny_model
from exactrl.tasks.tokenizer import build_tokenizer
from exactrl.workers.worker import Worker
from old_deepspeed import ds_env

pytest.importorskip("peft")
SCRIPT = Path(__file__).parent / "dist" / "export.py"
LAYOUTS = {("single", 1): ["single"], ("fsdp2", 2): ["fsdp2"],
           ("deepspeed", 2): ["deepspeed deepspeed.zero_stage=2", "deepspeed deepspeed.zero_stage=3"]}


@pytest.mark.parametrize("backend,world", list(LAYOUTS), ids=["single", "fsdp2-world2", "deepspeed-world2"])
def test_export_equals_the_saved_checkpoint_on_every_backend(backend, world, tmp_path):
    if backend == "deepspeed":
        pytest.importorskip("deepspeed")
    results = run_cases(backend, world, tmp_path / "results.json", ds_env() if backend == "deepspeed" else None,
                        script=SCRIPT)
    assert sorted({(r["config"], r["lora"], r["rank"]) for r in results}) == sorted(
        (c, lora, rank) for c in LAYOUTS[(backend, world)] for lora in (False, True) for rank in range(world))
    for r in results:
        assert r["is_generator"] and r["gathered_for_first"] == 1, r  # one tensor at a time, not a state dict
        assert r["names_equal"] and r["values_equal"], r
        assert r["tensors"] == 20, r  # the tiny model's 20 tensors: the tied head once, a LoRA model merged
        assert not r["lora"] or (r["adapters"]["names_equal"] and r["adapters"]["values_equal"]), r
        assert r["generator_version"] == 1 and r["generator_holds_saved"], r


@pytest.fixture
def tok():
    return build_tokenizer()


def worker(tok, seed: int = 3) -> Worker:
    model = build_tiny_model(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, seed=seed, hidden_size=32,
                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64)
    return Worker("policy", model, build_engine(model, load_config(SFTConfig, None, []), total_steps=1),
                  pad_id=tok.pad_token_id)


def test_the_in_process_generator_shares_the_model_and_gathers_nothing(tok, monkeypatch):
    policy = worker(tok)
    monkeypatch.setattr(policy.engine, "full_tensor", lambda t: pytest.fail("a shared model was gathered"))
    generator = HFEngine(policy.model, tok, batch_size=4)
    assert policy.push_weights(generator).version == 1 and generator.model is policy.model


def test_a_generator_with_its_own_model_loads_the_export_and_verifies_it(tok):
    policy, copy = worker(tok, 3), worker(tok, 11)
    generator = HFEngine(copy.model, tok, batch_size=4)
    assert policy.push_weights(generator).version == 1
    assert all(torch.equal(a, b) for a, b in zip(policy.model.state_dict().values(),
                                                 generator.model.state_dict().values()))
    partial = [(n, t) for n, t in policy.export_weights() if n != "model.norm.weight"]
    with pytest.raises(WeightSyncError,
                       match=r"the trainer sent no 'model.norm.weight' \(1 of the generator's parameters"):
        generator.load_weights(partial)
