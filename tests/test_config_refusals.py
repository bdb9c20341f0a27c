"""Every setting acts, or is refused in one line that says where it came from (issue 21):
duplicated YAML keys, settings of a switched-off feature, an override's bad value blamed on
the override, other frameworks' names, RL step counts that are not whole rollouts."""

from __future__ import annotations

import re

import pytest

from exactrl.config import ConfigError, DemoConfig, RLConfig, SFTConfig, dump_config, load_config
from exactrl.config.schema_study import StudyConfig


def error_of(cls, path=None, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(cls, path, list(overrides))
    return str(info.value)


# ---------------------------------------------------------------- duplicated keys


@pytest.mark.parametrize("text,line,first,key", [
    ("train:\n  max_steps: 2\n  micro_batch_size: 8\noptim:\n  lr: 0.1\ntrain:\n  micro_batch_size: 16\n", 6, 1,
     "train"),
    ("optim:\n  lr: 0.1\n  warmup_steps: 2\n  lr: 0.2\n", 4, 2, "optim.lr"),
])
def test_a_key_given_twice_is_refused_at_its_line(tmp_path, text, line, first, key):
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    assert error_of(SFTConfig, p) == f"{p}:{line}: duplicate key '{key}' (first at line {first}); keep one"


def test_the_same_key_in_two_sections_is_no_duplicate(tmp_path):
    p = tmp_path / "cfg.yaml"
    p.write_text("optim:\n  lr: 0.1\ncritic:\n  optim:\n    lr: 0.2\nalgo:\n  name: ppo\n")
    assert load_config(RLConfig, p).critic.optim.lr == 0.2


# ---------------------------------------------------------------- settings that would do nothing


@pytest.mark.parametrize("cls,overrides,message", [
    (SFTConfig, ["model.lora.target_modules=[q_proj]", "model.lora.merge_on_save=true"],
     ("model.lora.target_modules=[q_proj] has no effect: LoRA is off (model.lora.rank=0); set model.lora.rank > 0 "
      "or remove it")),
    (SFTConfig, ["model.lora.alpha=32"], "model.lora.alpha=32.0 has no effect: LoRA is off"),
    (RLConfig, ["critic.value_clip=0.5"],
     ("critic.value_clip=0.5 has no effect: only ppo trains a critic (algo.name=grpo); "
     "set algo.name=ppo or remove it")),
    (RLConfig, ["algo.name=rloo", "algo.std_normalize=false"],
     ("algo.std_normalize=false has no effect: algo.name=rloo "
     "does not divide by the group std")),
    (RLConfig, ["algo.gamma=0.9"], "algo.gamma=0.9 has no effect: algo.name=grpo does not discount returns"),
    (RLConfig, ["algo.kl_estimator=k1"], "algo.kl_estimator=k1 has no effect: there is no KL term (algo.kl_coef=0)"),
    (RLConfig, ["algo.kl_coef=0.1", "algo.kl_in_reward=true", "algo.kl_estimator=k2"],
     "algo.kl_estimator=k2 has no effect: the KL in the reward is k1 per token"),
    (RLConfig, ["algo.kl_coef=0.1", "algo.kl_horizon=100"],
     "algo.kl_horizon=100 has no effect: the KL coefficient is fixed"),
    (RLConfig, ["algo.overlong_penalty=0.5"], "algo.overlong_penalty=0.5 has no effect: the overlong penalty is off"),
    (RLConfig, ["algo.policy_loss=reinforce", "algo.clip_eps_high=0.3"], "algo.clip_eps_high=0.3 has no effect"),
    (SFTConfig, ["deepspeed.zero_stage=3"], ("deepspeed.zero_stage=3 has no effect: the train engine is not DeepSpeed "
     "(distributed.backend=single); set distributed.backend=deepspeed or remove it")),
    (SFTConfig, ["distributed.fsdp_cpu_offload=true"], "distributed.fsdp_cpu_offload=true has no effect"),
    (SFTConfig, ["train.loss_agg_norm=100"], "train.loss_agg_norm=100.0 has no effect"),
    (SFTConfig, ["optim.momentum=0.9"], "optim.momentum=0.9 has no effect: optim.name=adamw has no momentum setting"),
    (SFTConfig, ["optim.name=sgd", "optim.betas=[0.8,0.9]"],
     "optim.betas=[0.8,0.9] has no effect: optim.name=sgd has no betas"),
    (RLConfig, ["algo.name=ppo", "critic.optim.min_lr_ratio=0.1"], ("critic.optim.min_lr_ratio=0.1 has no effect: the "
     "learning rate is constant (critic.optim.scheduler=constant)")),
    (SFTConfig, ["train.save_total_limit=2"], "train.save_total_limit=2 has no effect: no checkpoints are taken"),
    (DemoConfig, ["rl.critic.warmup_rollouts=2"],
     ("rl.critic.warmup_rollouts=2 has no effect: only ppo trains a critic "
     "(rl.algo.name=grpo); set rl.algo.name=ppo")),
])
def test_a_setting_the_run_cannot_use_is_refused(cls, overrides, message):
    assert message in error_of(cls, overrides=overrides)


def test_a_setting_the_run_cannot_use_is_blamed_on_its_source(tmp_path):
    p = tmp_path / "cfg.yaml"
    p.write_text("model:\n  path: builtin\n  lora:\n    merge_on_save: true\n")
    assert error_of(SFTConfig, p) == (f"{p}:4: model.lora.merge_on_save=true has no effect: LoRA is off "
                                      "(model.lora.rank=0); set model.lora.rank > 0 or remove it (or override it "
                                      "back: model.lora.merge_on_save=false)")
    assert load_config(SFTConfig, p, ["model.lora.merge_on_save=false"]).model.lora.merge_on_save is False
    assert error_of(SFTConfig, p, ["model.lora.merge_on_save=false", "model.lora.alpha=8"]).startswith(
        "override 'model.lora.alpha=8': model.lora.alpha=8.0 has no effect")


def test_settings_in_use_or_at_their_defaults_pass(tmp_path):
    load_config(SFTConfig, None, ["model.lora.rank=4", "model.lora.target_modules=[q_proj]", "model.lora.alpha=32"])
    load_config(SFTConfig, None, ["model.lora.alpha=16"])  # the default: harmless
    load_config(RLConfig, None, ["algo.name=ppo", "critic.value_clip=0.5", "algo.gamma=0.9", "algo.gae.lam=0.9"])
    load_config(RLConfig, None, ["algo.kl_coef=0.1", "algo.kl_target=0.05", "algo.kl_horizon=100",
                                 "algo.kl_estimator=k1"])
    load_config(SFTConfig, None, ["optim.name=sgd", "optim.momentum=0.9"])
    # A resolved config.yaml holds every key at its value: those at the defaults pass, for every command.
    for cls, overrides in [(SFTConfig, []), (RLConfig, ["algo.name=rloo"]), (DemoConfig, [])]:
        p = tmp_path / f"{cls.__name__}.yaml"
        dump_config(load_config(cls, None, overrides), p)
        load_config(cls, p)


# ---------------------------------------------------------------- where a bad value came from


def test_a_bad_override_is_blamed_on_the_override_not_the_file(tmp_path):
    p = tmp_path / "cfg.yaml"
    p.write_text("optim:\n  lr: 0.1\ntrain:\n  micro_batch_size: 8\n")
    assert error_of(SFTConfig, p, ["optim.lr=-1"]) == ("override 'optim.lr=-1': optim.lr: Input should be greater "
                                                        "than 0 (given: -1)")
    p.write_text("optim:\n  warmup_steps: 2\n  lr: -1\n")
    assert error_of(SFTConfig, p).startswith(f"{p}:3: optim.lr: Input should be greater than 0")
    # A cross-field check names the sources of the keys it names.
    p.write_text("train:\n  global_batch_size: 64\n")
    assert error_of(SFTConfig, p, ["train.micro_batch_size=48"]).startswith(
        f"{p}:2; override 'train.micro_batch_size=48': train.global_batch_size=64 must be a multiple")


def test_a_sections_check_names_its_keys_once():
    msg = error_of(SFTConfig, overrides=["model.lora.rank=4", "model.lora.target_modules=[]"])
    assert msg.startswith("override 'model.lora.target_modules=[]': model.lora.target_modules: give 'all-linear'")
    assert "model.lora.model.lora" not in msg
    msg = error_of(DemoConfig, overrides=["sft.model.lora.target_modules=[]"])
    assert " sft.model.lora.target_modules: give" in msg and "lora.sft" not in msg


# ---------------------------------------------------------------- other frameworks' names


@pytest.mark.parametrize("cls,typed,meant", [
    (SFTConfig, "optim.learning_rate", "optim.lr"), (SFTConfig, "learning_rate", "optim.lr"),
    (SFTConfig, "model.lora.r", "model.lora.rank"), (SFTConfig, "lora_alpha", "model.lora.alpha"),
    (SFTConfig, "lora_dropout", "model.lora.dropout"), (SFTConfig, "target_modules", "model.lora.target_modules"),
    (SFTConfig, "per_device_train_batch_size", "train.micro_batch_size"), (
        SFTConfig, "num_train_epochs", "train.epochs"),
    (SFTConfig, "max_grad_norm", "train.max_grad_norm"), (RLConfig, "beta", "algo.kl_coef"),
    (RLConfig, "num_generations", "algo.group_size"), (RLConfig, "max_completion_length", "rollout.max_new_tokens"),
    (DemoConfig, "rl.model.lora.r", "rl.model.lora.rank"), (DemoConfig, "rl.lora_alpha", "rl.model.lora.alpha"),
    (RLConfig, "epsilon", "algo.clip_eps"), (RLConfig, "optim.epsilon", "optim.eps"),  # in a real section, stay there
])
def test_names_from_trl_peft_and_openrlhf_get_a_did_you_mean(cls, typed, meant):
    assert f"unknown key '{typed}'; did you mean '{meant}'?" in error_of(cls, overrides=[f"{typed}=1"])


def test_gradient_accumulation_steps_is_explained():
    msg = error_of(SFTConfig, overrides=["gradient_accumulation_steps=4"])
    assert "did you mean 'train.global_batch_size'? exactrl derives the accumulation steps" in msg


# ---------------------------------------------------------------- RL runs whole rollouts


def test_rl_max_steps_must_be_whole_rollouts():
    msg = error_of(RLConfig, overrides=["train.max_steps=2", "algo.ppo_epochs=2", "algo.mini_batches=2",
                                        "train.global_batch_size=16", "train.micro_batch_size=8"])
    assert msg.startswith("override 'train.max_steps=2'; override 'algo.ppo_epochs=2'; override 'algo.mini_batches=2': "
                          "train.max_steps=2 must be a multiple of algo.ppo_epochs x algo.mini_batches = 4")
    assert "set train.max_steps=4" in msg
    load_config(RLConfig, None, ["train.max_steps=4", "algo.ppo_epochs=2", "algo.mini_batches=2",
                                 "train.global_batch_size=16", "train.micro_batch_size=8"])
    load_config(RLConfig, None, ["algo.ppo_epochs=2", "train.epochs=0.5"])  # max_steps=0: derived in whole rollouts


def test_the_tables_name_real_keys():
    """A row of USED_WHEN or ALIASES with a misspelt key would never act."""
    from exactrl.config.loader import valid_keys
    from exactrl.config.schema_kd import KDConfig
    from exactrl.config.schema_pref import DPOConfig, KTOConfig
    from exactrl.config.schema_rl import ALIASES
    from exactrl.config.schema_rm import RMConfig
    from exactrl.config.used import USED_WHEN

    keys = set().union(*(valid_keys(c) for c in (SFTConfig, RLConfig, DPOConfig, KTOConfig, RMConfig, KDConfig)))
    sections = {k.rsplit(".", i)[0] + "." for k in keys for i in range(1, k.count(".") + 1)}
    assert not [row.key for row in USED_WHEN if row.key not in keys | sections]
    assert not [target for target, _ in ALIASES.values() if target not in keys]


@pytest.mark.parametrize("cls, overrides, message", [
    (RLConfig, ["task.name=calculator"], "task.name=calculator is a tool task"),
    (DemoConfig, ["task.name=calculator"], "set rl.env.tools=exactrl.tasks.calculator_tools"),
    (StudyConfig, ["task.name=calculator"], "a study compares one-turn methods"),
    (RLConfig, ["env.tools=m", "algo.name=luffy"], "with env.* a rollout is the policy's own episodes"),
    (RLConfig, ["env.tools=m", "algo.overlong_buffer=8"], "an episode's budget is env.max_tokens"),
    (RLConfig, ["env.tools=m", "env.cls=m:C"], "env.cls and env.tools are both set"),
    (RLConfig, ["env.args={a: 1}"], "env.args are env.cls's constructor arguments"),
])
def test_episode_settings_that_cannot_work_are_refused(cls, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(cls, None, overrides)


def test_a_dotted_override_inside_env_args_sets_a_constructor_argument():
    cfg = load_config(RLConfig, None, ["env.cls=m:C", "env.args.delay=0.2", "env.args.name=x"])
    assert cfg.env.args == {"delay": 0.2, "name": "x"}
