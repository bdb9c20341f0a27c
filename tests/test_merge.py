"""`exactrl merge`: a LoRA run's adapter merged into its base is a plain Hugging Face model whose
logits are the adapted model's; a directory that is not an adapter, an output that exists and a
base the adapter does not fit are one line each, exit 2, nothing overwritten."""

from __future__ import annotations

import copy

import pytest
import torch

from exactrl.distributed.checkpoint import save_pretrained
from exactrl.models.loading import load_causal_lm
from test_cli_failures import exactrl, one_line_error
from test_lora import TOL, with_adapters

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, make_model, tokenizer):
    """An adapter saved as a LoRA run saves final/, on a base loaded from a directory (which
    adapter_config.json then records), and the adapted model it came from."""
    root = tmp_path_factory.mktemp("merge")
    make_model(0).save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    model = with_adapters(load_causal_lm(root / "base", trainable=False))
    save_pretrained(root / "final", model, tokenizer)
    return root, model


def test_merged_model_has_the_adapted_logits_and_loads_without_peft(adapter, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    root, model = adapter
    out = tmp_path / "merged"
    proc = exactrl(["merge", str(root / "final"), str(out)], tmp_path, tmp_path / "cache")
    assert proc.returncode == 0 and f"merged model: {out}" in proc.stderr, proc.stderr
    assert not (out / "adapter_config.json").exists() and (out / "tokenizer_config.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert type(merged).__module__.startswith("transformers.") and not any("lora" in k for k in merged.state_dict())
    ids = torch.tensor([tokenizer("347+285=#### 632")["input_ids"]])
    with torch.no_grad():
        want, got = model(input_ids=ids).logits, merged(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(root / "base")(input_ids=ids).logits
    assert (got - want).abs().max() <= TOL * want.abs().max()
    assert (want - base).abs().max() > 1e-2  # the adapters were merged in


def test_merge_refusals_are_one_line(adapter, tmp_path, make_model):
    root, _ = adapter
    cache = tmp_path / "cache"
    line = one_line_error(exactrl(["merge", str(root / "base"), str(tmp_path / "m")], tmp_path, cache), 2)
    assert "is not a LoRA adapter directory" in line and not (tmp_path / "m").exists()

    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    line = one_line_error(exactrl(["merge", str(root / "final"), str(tmp_path / "taken")], tmp_path, cache), 2)
    assert "already exists and is not empty" in line and (tmp_path / "taken" / "notes.txt").read_text() == "mine"

    other = copy.deepcopy(make_model(0))
    other.model.layers = other.model.layers[:1]
    other.config.num_hidden_layers = 1
    other.save_pretrained(tmp_path / "other")
    line = one_line_error(exactrl(["merge", str(root / "final"), str(tmp_path / "m"), "--base",
                                   str(tmp_path / "other")],
                                  tmp_path, cache), 2)
    assert "does not fit the base model" in line and "have no place in it" in line, line
    assert not (tmp_path / "m").exists()
