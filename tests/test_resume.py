"""Resume exactness on the single backend: stop after step n, resume, and reach bitwise the
same parameters at step m as an uninterrupted run (same seed, CPU)."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from exactrl.algorithms.rl import train_rl
from exactrl.algorithms.sft import train_sft
from exactrl.config import RLConfig, SFTConfig, load_config
from exactrl.config.loader import ConfigError
from exactrl.distributed.checkpoint import CheckpointError
from exactrl.tasks.builtin import BuiltinSpec

SPEC = BuiltinSpec(n_sft=200, n_rl=40, n_eval=10)


def same_weights(a, b) -> bool:
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return wa.keys() == wb.keys() and all(wa[k].equal(wb[k]) for k in wa)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EXACTRL_CACHE", str(tmp_path / "cache"))


def test_sft_resume_is_bitwise_exact(tmp_path):
    common = ["data.eval=null", "train.global_batch_size=8", "train.micro_batch_size=4", "train.max_steps=6",
              "optim.warmup_steps=2", "optim.weight_decay=0.01"]
    full = train_sft(load_config(SFTConfig, None, [*common, "train.save_every=3", f"output_dir={tmp_path / 'full'}"]),
                     spec=SPEC)
    resumed = train_sft(load_config(SFTConfig, None, [*common, f"train.resume_from={full.run_dir / 'checkpoint-3'}",
                                                      f"output_dir={tmp_path / 'resumed'}"]), spec=SPEC)
    assert same_weights(full.final_model, resumed.final_model)
    # ...and the resumed run really continued from step 3 rather than starting over.
    assert not same_weights(full.final_model, full.run_dir / "checkpoint-3")


def test_rl_resume_is_bitwise_exact(tmp_path):
    common = ["data.eval=null", "train.global_batch_size=8", "train.micro_batch_size=4", "algo.group_size=4",
              "train.max_steps=4", "algo.mini_batches=2", "algo.kl_coef=0.1", "rollout.max_new_tokens=8",
              "algo.kl_target=0.05", "algo.kl_horizon=20",  # the adaptive coefficient must come back too
              "optim.lr=1e-3", "reward.fn=reward_fixtures:varied"]
    full = train_rl(load_config(RLConfig, None, [*common, "train.save_every=2", f"output_dir={tmp_path / 'full'}"]),
                    spec=SPEC)
    resumed = train_rl(load_config(RLConfig, None, [*common, f"train.resume_from={full.run_dir / 'checkpoint-2'}",
                                                    f"output_dir={tmp_path / 'resumed'}"]), spec=SPEC)
    assert same_weights(full.final_model, resumed.final_model)
    assert not same_weights(full.final_model, full.run_dir / "checkpoint-2")


def test_rl_checkpoints_only_between_rollouts():
    with pytest.raises(ConfigError,
                       match="train.save_every=3 must be a multiple of algo.ppo_epochs x algo.mini_batches = 2"):
        load_config(RLConfig, None, ["train.save_every=3", "algo.mini_batches=2"])


def test_resume_from_a_directory_without_state_says_so(tmp_path):
    cfg = load_config(SFTConfig, None, ["data.eval=null", "train.max_steps=2", "train.global_batch_size=8",
                                        "train.micro_batch_size=4", f"train.resume_from={tmp_path}",
                                        f"output_dir={tmp_path / 'r'}"])
    with pytest.raises(CheckpointError, match="lacks trainer_state.pt, config.json"):
        train_sft(cfg, spec=SPEC)
    assert not (tmp_path / "r").exists()  # refused before the run directory was created
