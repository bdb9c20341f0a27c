"""Workers built from the config by role (Worker.build): the LoRA reference is the policy's own
model with its adapters off, the critic trains with critic.optim on the run's validated config,
and an unknown role is named."""

from __future__ import annotations

import pytest
import torch

from exactrl.config import RLConfig, load_config
from exactrl.distributed.engine import SingleEngine
from exactrl.workers.worker import Worker

RL = ["algo.group_size=2", "train.global_batch_size=4", "train.micro_batch_size=2", "data.max_length=32",
      "rollout.max_new_tokens=8"]


@pytest.fixture
def model_dir(tmp_path, make_model, tokenizer):
    make_model(5).save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def build(cfg, role, path, run_dir, tokenizer, **kw):
    return Worker.build(cfg, role, str(path), run_dir=run_dir, phase="rl", longest=40, pad_id=tokenizer.pad_token_id,
                        **kw)


def test_the_lora_reference_is_the_policys_model_with_adapters_off(model_dir, tmp_path, tokenizer, make_model):
    pytest.importorskip("peft")
    cfg = load_config(RLConfig, None, [*RL, "model.lora.rank=4", "algo.kl_coef=0.1"])
    policy = build(cfg, "policy", model_dir, tmp_path, tokenizer)
    with torch.no_grad():  # adapters that change the policy's output
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.5)
    reference = build(cfg, "reference", model_dir, tmp_path, tokenizer, policy=policy)
    assert reference.model is policy.model and reference.engine is None
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with reference.mode(), torch.no_grad():
        frozen = reference.model(input_ids=ids).logits
    base = make_model(5).eval()
    assert torch.equal(frozen, base(input_ids=ids).logits)
    assert not torch.equal(policy.model(input_ids=ids).logits, frozen)


def test_the_critic_trains_with_critic_optim_on_the_runs_own_config(model_dir, tmp_path, tokenizer, monkeypatch):
    """Its engine was built from ``cfg.model_copy(update={"optim": ...})``, a config no validator saw."""
    seen = []
    original = SingleEngine.from_config.__func__
    monkeypatch.setattr(SingleEngine, "from_config", classmethod(lambda cls, model, cfg, *a: seen.append(cfg) or
                                                                 original(cls, model, cfg, *a)))
    cfg = load_config(RLConfig, None, [*RL, "algo.name=ppo", "algo.group_size=1", "critic.optim.lr=0.25",
                                       "critic.optim.name=sgd"])
    critic = build(cfg, "critic", model_dir, tmp_path, tokenizer, total_steps=3)
    assert seen == [cfg] and seen[0] is cfg  # the validated config itself, not a copy
    assert isinstance(critic.engine.optimizer,
                      torch.optim.SGD) and critic.engine.optimizer.param_groups[0]["lr"] == 0.25


def test_an_unknown_role_is_named(model_dir, tmp_path, tokenizer):
    with pytest.raises(ValueError, match=r"no worker role 'judge'; the roles are policy, reference, critic, "
                                         r"reward_model, reward, teacher"):
        build(load_config(RLConfig, None, RL), "judge", model_dir, tmp_path, tokenizer)
