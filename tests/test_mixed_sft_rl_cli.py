"""CHORD, HPT and ReLIFT through the real entry point (in this process) on a small data file of
prompts, answers and demonstrations, with a reward that makes every question's group all right or
all wrong (reward_fixtures.prompt_parity), so what each method must do with a rollout is known
from its logged accuracy."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from exactrl.config import RLConfig
from test_cli_failures import exactrl

COMMON = ["model.path=builtin", "data.eval=null", "reward.fn=reward_fixtures:prompt_parity", "algo.group_size=4",
          "train.global_batch_size=16", "train.micro_batch_size=8", "rollout.max_new_tokens=6", "train.log_every=1"]
PROMPTS = 4  # per rollout: 16 responses / groups of 4


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "mixed.jsonl"
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "demonstration": f"{a + b} #### {a + b}"}
            for a, b in [(i * 7 % 50, i * 13 % 40) for i in range(24)]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run(tmp_path, cache, data, name, *args) -> list[dict]:
    out = tmp_path / name
    proc = exactrl(["rl", *COMMON, f"data.train={data}", f"output_dir={out}", *args], tmp_path, cache)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [r for r in map(json.loads, open(out / "metrics.jsonl")) if "loss" in r]


def test_hpt_sends_exactly_the_unsolved_questions_to_sft(tmp_path, cache, data):
    """Gate 0 with all-or-nothing groups: the share of questions learnt by SFT is 1 - accuracy, and
    the step holds their demonstrations plus the other questions' groups."""
    rows = run(tmp_path, cache, data, "hpt", "algo.name=hpt", "train.max_steps=3")
    assert len(rows) == 3 and {r["canary"] for r in rows} == {1.0}
    for r in rows:
        assert r["sft_share"] == pytest.approx(1 - r["accuracy"])
        assert r["demonstrations"] == round(PROMPTS * r["sft_share"])
        assert r["samples"] == 4 * (PROMPTS - r["demonstrations"]) + r["demonstrations"]
    assert 0 < sum(r["sft_share"] for r in rows) < 3  # both branches of the gate were taken


def test_chord_with_mu_zero_is_grpo_on_the_same_rollouts(tmp_path, cache, data):
    """CHORD's steps hold the rollout's 16 responses and its 4 prompts' demonstrations; with mu = 0
    the demonstrations weigh nothing and do not enter the GRPO term's normaliser, so the final
    weights are GRPO's on the same rollouts (scoping the GRPO terms to all samples fails this)."""
    # rewards that differ within a group; SGD, because AdamW's first steps divide a gradient by its own size and
    # so magnify the rounding of sums taken over other micro-batches (CHORD's steps hold 4 more samples)
    varied = ["reward.fn=reward_fixtures:varied", "train.max_steps=2", "optim.name=sgd", "optim.lr=0.5"]
    rows = run(tmp_path, cache, data, "chord", "algo.name=chord", "algo.chord.mu_peak=0", "algo.chord.mu_valley=0",
               *varied)
    assert [r["samples"] for r in rows] == [16 + PROMPTS] * 2 and {r["canary"] for r in rows} == {1.0}
    assert all(r["grad_norm"] > 0 for r in rows)
    run(tmp_path, cache, data, "grpo", "algo.name=grpo", *varied)
    chord = load_file(tmp_path / "chord" / "final" / "model.safetensors")
    grpo = load_file(tmp_path / "grpo" / "final" / "model.safetensors")
    for key, value in grpo.items():
        assert torch.allclose(chord[key], value, rtol=1e-5, atol=1e-7), key


def test_relift_trains_an_sft_step_each_time_the_buffer_fills(tmp_path, cache, data):
    """Every question no response solved is buffered (1 - accuracy of the rollout's 4); an SFT
    step runs, and empties 3 from the buffer, exactly when it holds 3."""
    rows = run(tmp_path, cache, data, "relift", "algo.name=relift", "algo.relift.buffer_size=3", "train.max_steps=4")
    pending, released = 0, 0
    for r in rows:
        assert r["sft_buffered"] == round(PROMPTS * (1 - r["accuracy"]))
        pending += r["sft_buffered"]
        fills = pending >= 3
        pending -= 3 * fills
        released += fills
        assert r["sft_buffer"] == pending and ("sft_loss" in r) == fills
    assert released > 0


def test_relift_resumes_with_its_buffer(tmp_path, cache, data, monkeypatch):
    """Stopped after step 2 and resumed, ReLIFT reaches bitwise the uninterrupted run's weights:
    the buffered questions are part of the checkpoint (lost, the resumed run's SFT steps come late)."""
    from exactrl.algorithms.rl import train_rl
    from exactrl.config import load_config

    monkeypatch.setenv("EXACTRL_CACHE", str(cache))
    common = [*COMMON, f"data.train={data}", "algo.name=relift", "algo.relift.buffer_size=5", "train.max_steps=4"]
    full = train_rl(load_config(RLConfig, None, [*common, "train.save_every=2", f"output_dir={tmp_path / 'full'}"]))
    rows = [r for r in map(json.loads, open(full.run_dir / "metrics.jsonl")) if "loss" in r]
    assert rows[1]["sft_buffer"] > 0 and any("sft_loss" in r for r in rows[2:])  # the buffer carries over step 2
    resumed = train_rl(load_config(RLConfig, None, [*common, f"train.resume_from={full.run_dir / 'checkpoint-2'}",
                                                    f"output_dir={tmp_path / 'resumed'}"]))
    a, b = (load_file(r.final_model / "model.safetensors") for r in (full, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a)
