"""`exactrl pipeline`: SFT then RL from the SFT model in one run directory, one summary of both
phases (accuracy before and after each, FLOPs, wall time), the truncated variant, and resume: a
finished phase is never re-run, an interrupted one continues from its checkpoint to the weights of an
uninterrupted run."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file

from exactrl.config import ConfigError, PipelineConfig, load_config
from exactrl.metrics import read_metrics
from exactrl.pipelines.pipeline import run_pipeline
from exactrl.run_dir import forget_current
from exactrl.tasks.builtin import BuiltinSpec
from own_audit import assert_verdicts

SPEC = BuiltinSpec(n_sft=64, n_rl=16, n_eval=8)
TINY = ["sft.train.global_batch_size=8", "sft.train.micro_batch_size=4", "sft.train.max_steps=2",
        "sft.data.eval=null", "sft.train.log_every=1",
        "rl.train.global_batch_size=8", "rl.train.micro_batch_size=4", "rl.train.max_steps=2", "rl.train.save_every=1",
        "rl.train.log_every=1", "rl.algo.group_size=4", "rl.rollout.max_new_tokens=8", "rl.data.eval_size=4",
        "rl.eval.max_new_tokens=8"]


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EXACTRL_CACHE", str(tmp_path / "cache"))


def pipeline(out, *extra):
    try:
        return run_pipeline(load_config(PipelineConfig, None, [*TINY, f"output_dir={out}", *extra]), spec=SPEC)
    finally:
        forget_current()


def test_a_pipeline_runs_sft_then_rl_from_the_sft_model_and_resumes_only_what_is_unfinished(tmp_path, cache):
    out = tmp_path / "p"
    summary = pipeline(out)
    rl_cfg = load_config(PipelineConfig.model_fields["rl"].annotation, out / "rl" / "config.yaml")
    assert rl_cfg.model.path == str(out / "sft" / "final")  # RL started from the SFT model
    assert set(summary["accuracy"]) == {"before", "after_sft", "after_rl"}
    assert all(a["n"] == 8 for a in summary["accuracy"].values())
    for phase in ("sft", "rl"):  # each phase's FLOPs are its own metrics' last cumulative count
        last = [r for r in read_metrics(out / phase / "metrics.jsonl") if "flops" in r][-1]
        assert summary["flops"][phase] == last["flops"] == summary["phases"][phase]["compute"]["flops"] > 0
    assert summary["flops"]["total"] == summary["flops"]["sft"] + summary["flops"]["rl"]
    assert set(summary["seconds"]) >= {"sft", "rl", "eval", "total"}
    assert "FLOPs" in (out / "report.md").read_text() and (out / "plot.png").is_file()
    assert_verdicts(out, facts={"trainer": ["sft", "rl (grpo)"], "effective_k": [2, 2]})  # each phase read

    # The RL phase interrupted after its checkpoint-1 (as a preemption leaves it): resume=true keeps
    # the SFT phase and the accuracies measured so far, and continues RL to the uninterrupted weights.
    want = load_file(out / "rl" / "final" / "model.safetensors")
    sft_records = (out / "sft" / "metrics.jsonl").read_text()
    shutil.rmtree(out / "rl" / "final")
    (out / "rl" / "result.json").unlink()
    kept = [r for r in read_metrics(out / "metrics.jsonl") if r.get("stage") != "after_rl"]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    status = json.loads((out / "status.json").read_text())
    (out / "status.json").write_text(json.dumps({**status, "state": "interrupted"}))

    again = pipeline(out, "resume=true")
    assert (out / "sft" / "metrics.jsonl").read_text() == sft_records  # not re-run
    assert again["accuracy"]["after_sft"] == summary["accuracy"]["after_sft"]
    continued = [r for r in read_metrics(out / "rl" / "metrics.jsonl") if r.get("event") == "continued"]
    assert [r["resume_from"] for r in continued] == [str(out / "rl" / "checkpoint-1")]
    got = load_file(out / "rl" / "final" / "model.safetensors")
    assert got.keys() == want.keys() and all(got[k].equal(want[k]) for k in want)
    assert again["flops"]["rl"] == summary["flops"]["rl"]  # the count went on from the checkpoint's


def test_truncate_sets_the_rl_phases_length_and_learning_rate():
    cfg = load_config(PipelineConfig, None, ["rl.algo.mini_batches=2", "rl.algo.ppo_epochs=2",
                                             "rl.train.max_steps=400", "truncate.rollouts=3", "truncate.lr=5e-6"])
    rl = cfg.rl_phase()
    assert (rl.train.max_steps, rl.optim.lr) == (3 * 2 * 2, 5e-6)  # 3 rollouts of ppo_epochs x mini_batches steps
    assert (cfg.rl.train.max_steps, cfg.rl.optim.lr) == (400, PipelineConfig().rl.optim.lr)  # the config is kept
    assert load_config(PipelineConfig, None, ["rl.train.max_steps=400"]).rl_phase().train.max_steps == 400


@pytest.mark.parametrize("override, message", [
    ("truncate.lr=5e-6", "truncate.lr=5e-06 needs truncate.rollouts"),
    ("rl.model.path=/models/x", "rl.model.path=/models/x: the RL phase starts from the SFT phase's model"),
    ("resume=true", "resume=true continues the pipeline in output_dir"),
    ("rl.train.resume_from=latest", "rl.train.resume_from=latest: the pipeline continues its phases itself"),
    ("sft.model.lora.rank=4", "the pipeline hands full models from phase to phase"),
])
def test_what_the_pipeline_cannot_honour_is_refused_by_name(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        load_config(PipelineConfig, None, [override])


@pytest.mark.slow
def test_a_phase_of_two_processes_runs_as_its_own_command(tmp_path, cache):
    """rl.distributed.nproc_per_node=2: the RL phase runs as `exactrl rl` under torchrun (FSDP2, gloo); the
    pipeline reads its final model and FLOPs from its run directory."""
    import os
    import subprocess
    import sys

    evals = tmp_path / "eval.jsonl"
    rows = [{"prompt": f"{a}+{a}=", "answer": f"{2 * a:04d}"} for a in range(100, 104)]
    evals.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "p"
    args = [*TINY, f"output_dir={out}", f"rl.data.eval={evals}", "rl.eval.reward_fn=exactrl.tasks.arithmetic:reward",
            "rl.distributed.backend=fsdp2", "rl.distributed.nproc_per_node=2", "rl.train.save_every=0"]
    proc = subprocess.run([sys.executable, "-m", "exactrl.cli", "pipeline", *args], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    last = [r for r in read_metrics(out / "rl" / "metrics.jsonl") if "flops" in r][-1]
    assert summary["flops"]["rl"] == last["flops"] > 0 and (out / "rl" / "final" / "config.json").is_file()
    assert summary["accuracy"]["after_rl"]["n"] == 4
