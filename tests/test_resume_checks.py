"""Resume refuses what could not continue a run exactly, before writing anything: another
config (naming the keys), another command's checkpoint, an interrupted checkpoint write, a
max_steps the checkpoint has passed. Checkpoint retention keeps the latest N complete ones."""

from __future__ import annotations

import shutil

import pytest
import torch

from exactrl.algorithms.rl import train_rl
from exactrl.algorithms.sft import train_sft
from exactrl.config import RLConfig, SFTConfig, load_config
from exactrl.config.loader import ConfigError
from exactrl.distributed.checkpoint import STATE_FILE, CheckpointError
from exactrl.tasks.builtin import BuiltinSpec

SPEC = BuiltinSpec(n_sft=64, n_rl=16, n_eval=8)
SFT = ["data.eval=null", "train.global_batch_size=8", "train.micro_batch_size=4", "train.max_steps=4"]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EXACTRL_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def sft_run(tmp_path):
    return train_sft(load_config(SFTConfig, None, [*SFT, "train.save_every=1", "train.save_total_limit=2",
                                                   f"output_dir={tmp_path / 'full'}"]), spec=SPEC).run_dir


def resume_sft(tmp_path, checkpoint, *more):
    return train_sft(load_config(SFTConfig, None, [*SFT, f"train.resume_from={checkpoint}",
                                                   f"output_dir={tmp_path / 'r'}", *more]),
                     spec=SPEC)


def test_retention_keeps_the_latest_complete_checkpoints(sft_run):
    # Steps 1-3 saved a checkpoint each (step 4 is the final model); the limit of 2 kept 2 and 3.
    assert sorted(p.name for p in sft_run.iterdir() if p.name.startswith(("checkpoint", ".checkpoint"))) == \
        ["checkpoint-2", "checkpoint-3"]


def test_changed_keys_are_named_and_can_be_allowed(tmp_path, sft_run):
    with pytest.raises(CheckpointError,
                       match=r"differs from the checkpoint's run .* in train.global_batch_size: 8 -> 16; "
                             r"train.seed: 0 -> 1\..*"
                             r"train.resume_allow_changes=\[train.global_batch_size,train.seed\]"):
        resume_sft(tmp_path, sft_run / "checkpoint-2", "train.global_batch_size=16", "train.seed=1")
    with pytest.raises(CheckpointError, match=r"in data.train: 'builtin' -> '.*other.jsonl'"):
        other = tmp_path / "other.jsonl"
        other.write_text('{"prompt": "1+1=", "completion": "2"}\n' * 8)
        resume_sft(tmp_path, sft_run / "checkpoint-2", f"data.train={other}")
    assert not (tmp_path / "r").exists()  # refused before the run directory was created
    # Cadence, length and micro-batching may change; a listed key may too.
    resume_sft(tmp_path, sft_run / "checkpoint-2", "train.seed=1", "train.resume_allow_changes=[train.seed]",
               "train.micro_batch_size=2", "train.log_every=1", "train.max_steps=5")


def test_keys_the_checkpoints_tensors_depend_on_cannot_be_allowed_to_change(tmp_path, sft_run):
    """A resume with another LoRA rank was told to list model.lora.rank in train.resume_allow_changes,
    which then failed on the adapter's shapes ('56 tensors saved, 56 expected')."""
    with pytest.raises(CheckpointError,
                       match=r"in model.lora.rank: 0 -> 4 \(it sets the shapes of the adapters .*\)\. A resume "
                                              r"cannot change that: restore") as info:
        resume_sft(tmp_path, sft_run / "checkpoint-2", "model.lora.rank=4", "train.seed=1")
    assert "resume_allow_changes=" not in str(info.value)
    with pytest.raises(CheckpointError,
                       match=r"train.resume_allow_changes: model.lora.rank cannot change on resume: it sets the "
                                              r"shapes .*; resume with model.lora.rank=0 \(the checkpoint's run's\)"):
        resume_sft(tmp_path, sft_run / "checkpoint-2", "model.lora.rank=4",
                   "train.resume_allow_changes=[model.lora.rank]")
    assert not (tmp_path / "r").exists()


def test_max_steps_behind_the_checkpoint_is_an_error(tmp_path, sft_run):
    with pytest.raises(CheckpointError, match=r"is at step 3, and this run ends at step 3 .*raise train.max_steps"):
        resume_sft(tmp_path, sft_run / "checkpoint-3", "train.max_steps=3")


def test_an_interrupted_checkpoint_write_is_named(tmp_path, sft_run):
    tmp = sft_run / ".checkpoint-4.tmp"
    shutil.copytree(sft_run / "checkpoint-3", tmp)
    (tmp / "trainer_state.pt").write_bytes(b"\x80\x02half")
    with pytest.raises(CheckpointError,
                       match=r"whose write was interrupted .* resume from a complete one: checkpoint-2, checkpoint-3"):
        resume_sft(tmp_path, tmp)
    shutil.copy(tmp / "trainer_state.pt", sft_run / "checkpoint-3" / "trainer_state.pt")  # a corrupt state file
    with pytest.raises(CheckpointError, match=r"trainer_state.pt' cannot be read \("):
        resume_sft(tmp_path, sft_run / "checkpoint-3")


def test_an_sft_checkpoint_cannot_be_resumed_by_rl(tmp_path, sft_run):
    cfg = load_config(RLConfig, None, ["data.eval=null", "train.global_batch_size=8", "train.micro_batch_size=4",
                                       "algo.group_size=4", "train.max_steps=2", "rollout.max_new_tokens=4",
                                       f"train.resume_from={sft_run / 'checkpoint-2'}",
                                       f"output_dir={tmp_path / 'rl'}"])
    with pytest.raises(CheckpointError,
                       match=r"is an sft checkpoint and cannot be resumed by `exactrl rl`; .* set model.path="):
        train_rl(cfg, spec=SPEC)


def test_the_checkpoint_names_its_command_and_an_old_one_is_inferred(tmp_path, sft_run):
    """The command is stored, not guessed from what the position holds: a checkpoint that says
    rl is refused by sft though it holds no rollout position (before, it was taken for sft's and
    resumed); one from before the command was stored resumes as its contents say (no rollout: sft)."""
    path = sft_run / "checkpoint-2" / STATE_FILE
    state = torch.load(path, weights_only=True)
    assert state["command"] == "sft"
    torch.save({**state, "command": "rl"}, path)
    with pytest.raises(CheckpointError, match=r"is an rl checkpoint and cannot be resumed by `exactrl sft`"):
        resume_sft(tmp_path, sft_run / "checkpoint-2")
    torch.save({k: v for k, v in state.items() if k != "command"}, path)
    assert resume_sft(tmp_path, sft_run / "checkpoint-2").steps == 4


def test_a_batch_larger_than_the_data_is_an_error(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "completion": "2"}\n' * 6)
    cfg = load_config(SFTConfig, None, [*SFT, f"data.train={data}", f"output_dir={tmp_path / 'r'}"])
    with pytest.raises(ConfigError,
                       match=rf"train.global_batch_size asks for 8 samples per step .* but '{data}' has only 6"):
        train_sft(cfg, spec=SPEC)
