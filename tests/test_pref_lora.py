"""dpo and kto with a LoRA policy (model.lora.*): the reference is the policy's own model with its adapters off
(Worker.build, no second copy), which equals the base model bit for bit after the adapters have trained; a few
steps move the adapters only. (exactrl rm with LoRA: tests/test_rm_lora.py.)"""

from __future__ import annotations

import pytest
import torch

from exactrl.algorithms.dpo import train_dpo
from exactrl.algorithms.kto import train_kto
from exactrl.algorithms.sft import resolve
from exactrl.config import load_config
from exactrl.config.schema_pref import DPOConfig, KTOConfig
from exactrl.data.preference import load_pairs
from exactrl.models.loading import load_causal_lm, load_tokenizer
from exactrl.tasks.builtin import BuiltinSpec
from exactrl.workers.reference_cache import forward_layout
from exactrl.workers.worker import Worker

pytest.importorskip("peft")

SPEC = BuiltinSpec(n_sft=20, n_rl=40, n_eval=10)
COMMON = ["model.path=builtin", "data.eval=null", "train.global_batch_size=8", "train.micro_batch_size=2",
          "train.max_steps=2", "train.log_every=1", "optim.lr=1e-2", "data.eval_size=4", "model.lora.rank=4"]


@pytest.mark.parametrize("command", ["dpo", "kto"])
def test_lora_reference_is_the_base_and_only_adapters_train(tmp_path, monkeypatch, command):
    built = {}
    build = Worker.build.__func__

    def keep(cls, cfg, role, path, **kw):
        built[role] = build(cls, cfg, role, path, **kw)
        return built[role]

    monkeypatch.setattr(Worker, "build", classmethod(keep))
    schema, train = (DPOConfig, train_dpo) if command == "dpo" else (KTOConfig, train_kto)
    train(load_config(schema, None, [*COMMON, f"output_dir={tmp_path / 'run'}"]), spec=SPEC)
    policy, reference = built["policy"], built["reference"]
    assert reference.model is policy.model  # no second copy

    path = resolve("builtin", "model", SPEC)
    base = load_causal_lm(path, trainable=False)
    trained = dict(policy.model.named_parameters())
    adapters = {n: p for n, p in trained.items() if "lora_" in n}
    assert adapters and all(p.requires_grad for p in adapters.values())
    assert any(float(p.detach().abs().max()) > 0 for n, p in adapters.items() if "lora_B" in n)  # peft starts B at 0
    frozen = {n.replace("base_model.model.", "").replace(".base_layer", ""): p for n, p in trained.items()
              if "lora_" not in n}
    assert frozen.keys() == dict(base.named_parameters()).keys()
    assert all(torch.equal(frozen[n], p) for n, p in base.named_parameters())  # the base did not move

    tok = load_tokenizer(path)
    pairs = load_pairs(resolve("builtin", "pairs_eval", SPEC), tok, load_config(DPOConfig, None, []).data)[0][:4]
    samples = [s for p in pairs for s in p.samples()]
    layout = forward_layout(len(samples), 4, 1)
    plain = Worker("reference", base, pad_id=tok.pad_token_id, logprob_chunk=reference.logprob_chunk,
                   autocast=reference.autocast)
    got, want = reference.forward(samples, "logprobs", layout), plain.forward(samples, "logprobs", layout)
    assert all(torch.equal(a, b) for a, b in zip(got, want))  # adapters off: the base, bit for bit
    adapted = policy.forward(samples, "logprobs", layout)
    assert max(float((a - b).abs().max()) for a, b in zip(adapted, want)) > 1e-4  # the adapters are on elsewhere


def test_a_reference_path_with_lora_exits_2(tmp_path):
    from typer.testing import CliRunner

    from exactrl.cli import app

    for command in ("dpo", "kto"):
        result = CliRunner().invoke(app, [command, "model.lora.rank=4", f"{command}.reference={tmp_path}",
                                          f"output_dir={tmp_path / 'run'}"])
        assert result.exit_code == 2, result.output
        assert f"unset {command}.reference" in result.output
