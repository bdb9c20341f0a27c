"""End-to-end smoke runs of the real entry point: sft, rl and demo on the built-in task.

Short budgets: these prove the commands run through and leave a complete, replayable run
directory with a loadable model, not that the model learns (the demo itself shows that).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from old_deepspeed import ds_env
from own_audit import assert_verdicts

SMALL_TASK = ["task.n_sft=256", "task.n_rl=64", "task.n_eval=40"]


def exactrl(args, cwd, cache, check=True):
    env = {**os.environ, "EXACTRL_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "exactrl.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"exactrl {' '.join(args)} failed "
                             f"({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e"), tmp_path_factory.mktemp("cache")


def test_sft_then_rl_cli(workdir):
    cwd, cache = workdir
    exactrl(["sft", "--config", "examples/sft_tiny.yaml", "output_dir=" + str(cwd / "sft"), "train.max_steps=3",
             "train.global_batch_size=8", "train.micro_batch_size=4", "data.eval_size=8", "train.eval_every=0"],
            cwd=os.getcwd(), cache=cache)
    run = cwd / "sft"
    for name in ("config.yaml", "status.json", "manifest.json", "metrics.jsonl", "final/config.json",
                 "final/model.safetensors", "final/tokenizer.json"):
        assert (run / name).exists(), name
    model = AutoModelForCausalLM.from_pretrained(run / "final")
    tok = AutoTokenizer.from_pretrained(run / "final")
    assert model.config.vocab_size == len(tok)
    steps = [r for r in map(json.loads, open(run / "metrics.jsonl")) if "loss" in r]
    assert [r["step"] for r in steps][-1] == 3 and all(r["samples"] == 8 and r["micro_batches"] == 2 for r in steps)
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["versions"]["torch"].startswith(torch.__version__.split("+")[0])
    assert len(manifest["data"]["train"]["sha256"]) == 64
    for given in (run, run / "config.yaml"):  # the directory, or a file of it
        assert_verdicts(given, facts={"trainer": ["sft"], "uses_deepspeed": [False], "effective_k": [2]})

    exactrl(["rl", "--config", "examples/grpo_tiny.yaml", "model.path=" + str(run / "final"), "output_dir="
             + str(cwd / "rl"),
             "train.max_steps=4", "train.global_batch_size=16", "train.micro_batch_size=8", "algo.group_size=4",
             "algo.kl_coef=0.05", "algo.ppo_epochs=2", "algo.mini_batches=2", "algo.log_entropy=true",
             "data.eval_size=8", "train.eval_every=0",
             "rollout.max_new_tokens=12", "train.log_every=1"],
            cwd=os.getcwd(), cache=cache)
    rl = [r for r in map(json.loads, open(cwd / "rl" / "metrics.jsonl")) if "reward_mean" in r]
    # One rollout of 2 mini-batches x 2 epochs = 4 optimizer steps of 16 responses each.
    assert len(rl) == 4 and {r["rollout"] for r in rl} == {0} and all(r["samples"] == 16 for r in rl)
    for key in ("reward_mean", "reward_std", "accuracy", "kl", "clip_frac", "entropy", "response_length",
                "gen_tokens_per_s"):
        assert key in rl[0], key
    # The on-policy check ran and the ratio was exactly 1 at the first update of the rollout.
    assert [r["ratio_dev_first"] for r in rl] == [0.0, None, None, None]
    assert (cwd / "rl" / "final" / "model.safetensors").exists()
    assert_verdicts(cwd / "rl", facts={"trainer": ["rl (grpo)"], "world_size": [1], "effective_k": [2]})


def test_config_replay_reproduces_the_resolved_config(workdir):
    cwd, cache = workdir
    saved = yaml.safe_load((cwd / "sft" / "config.yaml").read_text())
    assert saved["train"]["max_steps"] == 3 and saved["optim"]["lr"] == 3e-3  # from the example file
    proc = exactrl(["sft", "--config", str(cwd / "sft" / "config.yaml"), f"output_dir={cwd / 'sft'}"], cwd=os.getcwd(),
                   cache=cache, check=False)
    # The same output_dir given again: refused, and nothing of the first run was touched (a replay
    # without it goes next to the run, tests/test_cli_failures.py).
    assert proc.returncode == 2 and "already holds a run (its run ended 'success')" in proc.stderr
    assert yaml.safe_load((cwd / "sft" / "config.yaml").read_text()) == saved
    assert json.loads((cwd / "sft" / "status.json").read_text())["state"] == "success"


def test_cli_reports_bad_config_and_data_without_traceback(workdir, tmp_path):
    _, cache = workdir
    proc = exactrl(["sft", "train.lr=1e-3"], cwd=tmp_path, cache=cache, check=False)
    assert proc.returncode == 2 and "did you mean 'optim.lr'" in proc.stderr and "Traceback" not in proc.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "completion": "2"}\n{"prompt": "2+2="}\n')
    proc = exactrl(["sft", f"data.train={bad}", "data.eval=null", f"output_dir={tmp_path / 'r'}"], cwd=tmp_path,
                   cache=cache, check=False)
    assert proc.returncode == 2 and f"{bad}:2" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "r").exists()  # data errors stop the run before it creates anything


def test_demo_smoke_writes_complete_run_directory(workdir):
    cwd, cache = workdir
    out = cwd / "demo"
    proc = exactrl(["demo", f"output_dir={out}", *SMALL_TASK, "sft.train.max_steps=4", "sft.train.eval_every=2",
                    "sft.data.eval_size=8", "rl.train.max_steps=2", "rl.train.eval_every=0", "rl.data.eval_size=8",
                    "rl.train.global_batch_size=16", "rl.train.micro_batch_size=8", "rl.rollout.max_new_tokens=12"],
                   cwd=os.getcwd(), cache=cache)
    summary = json.loads((out / "summary.json").read_text())
    for stage in ("before", "after_sft", "after_rl"):
        acc = summary["accuracy"][stage]
        assert 0.0 <= acc["ci95"][0] <= acc["value"] <= acc["ci95"][1] <= 1.0
        assert acc["n"] == 40
    assert set(summary["seconds"]) >= {"sft", "rl", "total"}
    for name in ("config.yaml", "manifest.json", "metrics.jsonl", "plot.png", "report.md", "sft/final/config.json",
                 "rl/final/config.json", "sft/metrics.jsonl", "rl/metrics.jsonl"):
        assert (out / name).exists(), name
    assert "after sft" in proc.stdout and "after rl" in proc.stdout
    assert "Setting accelerator" not in proc.stdout + proc.stderr  # DeepSpeed's probe line (issue 21)


@pytest.mark.slow  # ~21 s: tests/test_resume_distributed.py relaunches the CLI under torchrun with FSDP2 in CI
def test_sft_relaunches_itself_under_torchrun_with_fsdp2(workdir):
    cwd, cache = workdir
    out = cwd / "fsdp2"
    proc = exactrl(["sft", "--config", "examples/sft_tiny.yaml", f"output_dir={out}", "distributed.backend=fsdp2",
                    "distributed.nproc_per_node=2", "train.max_steps=2", "train.global_batch_size=8",
                    "train.micro_batch_size=2",
                    "data.eval_size=4", "train.log_every=1"], cwd=os.getcwd(), cache=cache)
    steps = [r for r in map(json.loads, open(out / "metrics.jsonl")) if "loss" in r]
    # Each rank ran 2 of the step's 4 micro-batches; the canary saw all of them, once.
    assert [(r["micro_batches"], r["samples"], r["canary"]) for r in steps] == [(2, 4, 1.0), (2, 4, 1.0)]
    assert (proc.stdout + proc.stderr).count("final model:") == 1  # only the main process speaks
    AutoModelForCausalLM.from_pretrained(out / "final")


# ~65 s (two 2-rank DeepSpeed launches): under `slow`. In CI, DeepSpeed under torchrun is held to the full-batch
# update (tests/test_deepspeed.py) and the launcher's appended --local_rank is dropped (below).
@pytest.mark.slow
def test_the_deepspeed_launcher_runs_exactrl_as_torchrun_does(workdir):
    """`deepspeed --num_gpus 2 --module exactrl.cli sft ...` (which appends --local_rank=N)
    trains the same model, bit for bit, as exactrl relaunching itself under torchrun."""
    pytest.importorskip("deepspeed")
    cwd, cache = workdir
    common = ["sft", "--config", "examples/sft_tiny.yaml", "distributed.backend=deepspeed", "deepspeed.zero_stage=2",
              "train.max_steps=2", "train.global_batch_size=8", "train.micro_batch_size=2", "data.eval=null",
              "train.log_every=1"]
    env = {**os.environ, "EXACTRL_CACHE": str(cache), "OMP_NUM_THREADS": "1", **ds_env()}
    launcher = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", "2", "--master_port", "29631",
                "--module"]
    proc = subprocess.run([*launcher, "exactrl.cli", *common, f"output_dir={cwd / 'ds-launcher'}"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    exactrl([*common, "distributed.nproc_per_node=2", f"output_dir={cwd / 'ds-torchrun'}"], cwd=os.getcwd(),
            cache=cache)
    steps = [r for r in map(json.loads, open(cwd / "ds-launcher" / "metrics.jsonl")) if "loss" in r]
    assert [(r["micro_batches"], r["samples"], r["canary"]) for r in steps] == [(2, 4, 1.0), (2, 4, 1.0)]
    a, b = (load_file(cwd / d / "final" / "model.safetensors") for d in ("ds-launcher", "ds-torchrun"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_the_local_rank_flag_a_deepspeed_launcher_appends_is_dropped(monkeypatch):
    """`deepspeed --module exactrl.cli ...` appends --local_rank=N (or --local_rank N) to the arguments; every
    launcher sets LOCAL_RANK, which exactrl reads, so the command line the app parses is the user's own."""
    from exactrl import cli

    seen = []
    monkeypatch.setattr(cli, "app", lambda: seen.append(list(cli.sys.argv[1:])))
    for tail in (["--local_rank=1"], ["--local_rank", "1"], []):
        monkeypatch.setattr(cli.sys, "argv", ["exactrl", "sft", "--config", "x.yaml", *tail, "train.max_steps=2"])
        cli.main()
    assert seen == [["sft", "--config", "x.yaml", "train.max_steps=2"]] * 3
