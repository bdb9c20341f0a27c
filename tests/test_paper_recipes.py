"""examples/paper/: every recipe passes `exactrl config check` (its model and data paths do not exist
here), and the FLOPs plan of the Qwen2.5-Math-7B recipes matches the seed paper's Appendix B
(arXiv 2604.23747): N = 7e9, D = 4,200 tokens, 46k SFT rows."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from exactrl.cli import COMMANDS, app
from exactrl.compute import rl_flops, sft_flops
from exactrl.config import PipelineConfig, RLConfig, load_config
from exactrl.config.methods import names
from exactrl.pipelines.plan import Options, plan

PAPER = Path(__file__).resolve().parents[1] / "examples" / "paper"
RECIPES = sorted(PAPER.glob("*.yaml"))
ONE_STAGE = names(demonstrations=True)  # mixed-policy recipes: `exactrl rl` from the base model
SFT_THEN_RL = [p for p in RECIPES if not any(m in p.name for m in ONE_STAGE)]
OPTIONS = Options(params=7e9, tokens_per_sample=4200, data_rows=46_000)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_each_recipe_passes_config_check(path):
    out = CliRunner().invoke(app, ["config", "check", str(path), "--params", "7e9", "--tokens-per-sample", "4200",
                                   "--data-rows", "46000"], terminal_width=200)
    assert out.exit_code == 0, out.output
    command = "pipeline" if path in SFT_THEN_RL else "rl"
    assert f"a valid `exactrl {command}` config" in out.output and "not found here" in out.output
    assert "FLOPs: unknown" not in out.output and ("total FLOPs: " in out.output or command == "rl")


def _plan(name: str):
    return plan(load_config(PipelineConfig, PAPER / name), "pipeline", OPTIONS)


def test_the_truncated_recipe_plans_the_papers_flops():
    sft, rl = _plan("qwen2.5-math-7b_sft_then_rl_truncated.yaml")
    # 3 epochs of 46k at batch 64: ceil(138000 / 64) = 2157 full steps, 48 samples more than 3 x 46,000
    assert (sft.steps, sft.samples_per_step) == (2157, 64)
    assert sft.flops == sft_flops(7e9, 2157 * 64, 4200)
    # the paper's 2.43e19 counts 3 x 46,000 samples (test_compute.py): the plan is that times 138048 / 138000
    assert sft.flops / sft_flops(7e9, 3 * 46_000, 4200) == pytest.approx(2157 * 64 / 138_000, rel=1e-12)
    # Appendix B: "50 RL steps at batch size 128 with 8 on-policy rollouts ... 1.20x10^19 FLOPs total"
    assert (rl.rollouts, rl.prompts_per_rollout, rl.group_size, rl.steps) == (50, 128, 8, 100)
    assert rl.flops == rl_flops(7e9, 50, 128, 8, 4200) and f"{rl.flops:.2e}" == "1.20e+19"
    assert f"{float(f'{sft.flops:.2e}') + float(f'{rl.flops:.2e}'):.2e}" == "3.64e+19"  # see examples/paper/README.md


def test_the_luffy_recipe_plans_the_papers_flops():
    """LUFFY as its script runs it: 500 RL steps of 128 prompts x (7 rollouts of 2,200 tokens at 8ND + 1
    demonstration of 4,200 at 6ND), the seed paper's 6.65e19 (Appendix B; tests/test_compute.py)."""
    out = CliRunner().invoke(app, ["config", "check", str(PAPER / "qwen2.5-math-7b_luffy.yaml"), "--params", "7e9",
                                   "--tokens-per-sample", "4200", "--rollout-tokens", "2200", "--data-rows", "46000"],
                             terminal_width=200)
    assert out.exit_code == 0, out.output
    assert "500 rollouts of 128 prompts x 8 responses" in out.output and "FLOPs: 6.65e+19" in out.output
    assert "7 rollouts (8ND, D = 2200.0) and 1 demonstration(s) (6ND, D = 4200.0) per prompt" in out.output
    expected = rl_flops(7e9, 500, 128, 7, 2200, demonstrations_per_prompt=1, demonstration_tokens=4200)
    assert f"{expected:.2e}" == "6.65e+19"


def test_the_luffy_recipe_holds_its_scripts_hyperparameters():
    cfg = load_config(RLConfig, PAPER / "qwen2.5-math-7b_luffy.yaml")
    a, t = cfg.algo, cfg.train
    assert (a.name, a.group_size, a.luffy.demonstrations, a.luffy.gamma, a.luffy.clip, a.std_normalize) == (
        "luffy", 8, 1, 0.1, False, False)
    assert t.global_batch_size * a.mini_batches // a.group_size == 128 and t.max_steps // a.mini_batches == 500
    assert (cfg.optim.lr, t.loss_agg, t.loss_agg_norm, cfg.rollout.max_new_tokens) == (
        1e-6, "seq-mean-token-sum-norm", 8192, 8192)


def test_the_srft_recipe_holds_its_codes_choices_and_plans_luffys_flops():
    """SRFT as its script runs it (github.com/fyqqyf/SRFT exp_scripts/train.sh): the code's entropy sign and
    shaped, unclipped demonstration term, its entropy bonus; at LUFFY's counts, LUFFY's 6.65e19."""
    cfg = load_config(RLConfig, PAPER / "qwen2.5-math-7b_srft.yaml")
    a, s, t = cfg.algo, cfg.algo.srft, cfg.train
    assert (a.name, a.group_size, s.demonstrations, a.kl_coef, a.entropy_coef) == ("srft", 8, 1, 0.0, 0.001)
    assert (s.sft_coef, s.sft_weight, s.positive_coef, s.demo_gamma, s.demo_clip) == (
        0.5, "exp_entropy", 0.1, 0.1, False)
    assert t.global_batch_size * a.mini_batches // a.group_size == 128 and t.max_steps // a.mini_batches == 500
    assert (cfg.optim.lr, cfg.rollout.max_new_tokens) == (1e-6, 8192)
    out = CliRunner().invoke(app, ["config", "check", str(PAPER / "qwen2.5-math-7b_srft.yaml"), "--params", "7e9",
                                   "--tokens-per-sample", "4200", "--rollout-tokens", "2200", "--data-rows", "46000"],
                             terminal_width=200)
    assert out.exit_code == 0 and "FLOPs: 6.65e+19" in out.output, out.output


def test_the_full_recipe_is_ten_times_the_truncated_rl():
    _, rl = _plan("qwen2.5-math-7b_sft_then_rl.yaml")
    _, short = _plan("qwen2.5-math-7b_sft_then_rl_truncated.yaml")
    assert (rl.rollouts, rl.steps) == (500, 1000) and rl.flops == 10 * short.flops
    cfg = load_config(PipelineConfig, PAPER / "qwen2.5-math-7b_sft_then_rl_truncated.yaml").rl_phase()
    assert cfg.optim.lr == 5e-6 and cfg.train.max_steps == 100


def test_the_recipes_hold_the_papers_hyperparameters():
    for path in SFT_THEN_RL:
        cfg = load_config(PipelineConfig, path)
        s, r = cfg.sft, cfg.rl
        assert (s.train.global_batch_size, s.train.epochs, s.optim.lr, s.optim.scheduler, s.optim.min_lr_ratio) == (
            64, 3, 5e-5, "cosine", 0.1)
        assert s.optim.warmup_steps == round(0.1 * 2157)
        a = r.algo
        assert (a.name, a.group_size, a.clip_eps, a.clip_eps_high, a.kl_coef, a.std_normalize) == (
            "grpo", 8, 0.2, 0.28, 0.0, False)
        assert r.train.global_batch_size * a.mini_batches // a.group_size == 128  # prompts per RL step
        assert r.train.global_batch_size // a.group_size == 64  # the mini-batch, in prompts
        assert (r.optim.lr, r.train.loss_agg) == (1e-6, "token-mean")


def test_config_check_refuses_what_a_run_would_in_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((PAPER / "qwen2.5-math-7b_sft_then_rl.yaml").read_text().replace("group_size: 8", "group_size: 7"))
    out = CliRunner().invoke(app, ["config", "check", str(bad)], terminal_width=200)
    assert out.exit_code == 2 and "Traceback" not in out.output
    assert "rl.train.global_batch_size=512 must be a multiple of rl.algo.group_size=7" in out.output
    assert f"{bad}:" in out.output and len(out.output.strip().splitlines()) == 1
    out = CliRunner().invoke(app, ["config", "check", str(tmp_path / "absent.yaml")], terminal_width=200)
    assert out.exit_code == 2 and "does not exist" in out.output


def test_config_check_plans_from_local_data_and_model(tmp_path, monkeypatch):
    """A demo config (detected by its task section) on a small built-in task: the steps from its rows
    and train.epochs, N counted from the local model, D measured on the local data."""
    from transformers import AutoModelForCausalLM

    from exactrl.pipelines.plan import check_config, detect_command
    from exactrl.tasks.builtin import BuiltinSpec, ensure_builtin

    monkeypatch.setenv("EXACTRL_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "demo.yaml"
    path.write_text("task: {n_sft: 64, n_rl: 16, n_eval: 8}\n"
                    "sft: {train: {max_steps: 0, epochs: 2, global_batch_size: 16, micro_batch_size: 8}}\n"
                    "rl: {train: {max_steps: 0, epochs: 1, global_batch_size: 16, micro_batch_size: 8}, "
                    "algo: {group_size: 8}}\n")
    assert detect_command(path) == "demo"
    cfg = load_config(COMMANDS["demo"], path)
    sft, rl = plan(cfg, "demo", Options())
    assert (sft.steps, rl.rollouts, rl.prompts_per_rollout) == (2 * 64 // 16, 16 // 2, 2)
    model = AutoModelForCausalLM.from_pretrained(ensure_builtin(BuiltinSpec(n_sft=64, n_rl=16, n_eval=8)).model)
    assert sft.n_params == rl.n_params == sum(p.numel() for p in model.parameters())
    assert sft.flops == sft_flops(sft.n_params, 8 * 16, sft.tokens_per_sample) and rl.flops > 0
    lines = check_config(path, None, [], Options(), COMMANDS)
    assert lines[0].endswith("a valid `exactrl demo` config") and lines[-1].startswith("total FLOPs: ")
