"""LUFFY's and SRFT's settings: a group must keep room for the policy's samples, and no key they
cannot honour is accepted silently (config/used.py)."""

from __future__ import annotations

import pytest

from exactrl.config import ConfigError, RLConfig, load_config


def test_a_group_of_only_demonstrations_is_refused():
    with pytest.raises(ConfigError, match=r"algo.luffy.demonstrations=8 leaves no response for the policy to sample in "
                                          r"a group of algo.group_size=8"):
        load_config(RLConfig, None, ["algo.name=luffy", "algo.luffy.demonstrations=8"])
    assert load_config(RLConfig, None, ["algo.name=srft", "algo.srft.demonstrations=7"]).algo.srft.demonstrations == 7


@pytest.mark.parametrize("overrides,message", [
    (["algo.name=luffy", "algo.srft.sft_coef=1"], "these are srft's settings"),
    (["algo.name=grpo", "algo.luffy.gamma=0.5"], "these are luffy's settings"),
    (["algo.name=luffy", "algo.luffy.clip=false", "algo.clip_eps=0.3"], "nothing is clipped"),
    (["algo.name=luffy", "algo.policy_loss=gspo", "algo.luffy.clip=false"], "algo.policy_loss=gspo is the loss"),
    (["algo.name=srft", "algo.policy_loss=ppo"], "srft has no ratio loss"),
    (["algo.name=srft", "algo.clip_eps_high=0.28"], "never exceeds 1"),
    (["algo.name=srft", "algo.ratio_check=warn"], "no on-policy ratio to check"),
    (["algo.name=srft", "algo.srft.demo_clip=false", "algo.clip_eps=0.3"], "nothing is clipped"),
])
def test_a_setting_the_method_cannot_honour_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(RLConfig, None, overrides)


def test_the_code_variant_of_luffy_loads():
    cfg = load_config(RLConfig, None, ["algo.name=luffy", "algo.luffy.clip=false", "algo.std_normalize=false",
                                       "train.loss_agg=seq-mean-token-sum-norm", "train.loss_agg_norm=8192"])
    assert (cfg.algo.luffy.clip, cfg.algo.std_normalize, cfg.train.loss_agg_norm) == (False, False, 8192)
