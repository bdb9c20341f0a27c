"""`exactrl config check` plans the FLOPs of dpo, kto, rm and kd (exactrl/pipelines/plan_pref.py), and the plan is
what the run's own FLOPs counter records: one epoch of each command on the small built-in sets, its last metrics record
against the plan of the same config file (N counted on the meta device, D measured on the data); kd's with a teacher
of another size, whose forward (2*N_teacher*D, no backward) is in the FLOPs."""

from __future__ import annotations

import json

import pytest
import yaml

from exactrl.algorithms.dpo import train_dpo
from exactrl.algorithms.kd import train_kd
from exactrl.algorithms.kto import train_kto
from exactrl.algorithms.rm import train_rm
from exactrl.cli import COMMANDS
from exactrl.compute import count_parameters
from exactrl.config import load_config
from exactrl.models.loading import load_value_model
from exactrl.pipelines.plan import Options, check_config, plan
from exactrl.tasks.builtin import BuiltinSpec, ensure_builtin, resolve

SPEC = BuiltinSpec(n_sft=20, n_rl=40, n_eval=10)  # 40 pairs, 40 unpaired rows
TRAIN = {"dpo": train_dpo, "kto": train_kto, "rm": train_rm}
KIND = {"dpo": "pairs_train", "kto": "unpaired_train", "rm": "pairs_train"}


def config_file(tmp_path, command: str, extra: dict) -> tuple:
    model = str(ensure_builtin(SPEC).model)
    data = resolve("builtin", KIND[command], SPEC)
    body = {"model": {"path": model}, "data": {"train": str(data), **({"eval": None} if command == "rm" else {})},
            "train": {"global_batch_size": 20, "micro_batch_size": 5, "max_steps": 0, "epochs": 1, "log_every": 1,
                      "eval_every": 0},
            "optim": {"lr": 1e-4}, "output_dir": str(tmp_path / "run"), command: extra}
    path = tmp_path / f"{command}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path, load_config(COMMANDS[command], path)


@pytest.mark.parametrize("command,extra", [("dpo", {"loss": "dpo", "nll_coef": 0.5}), ("kto", {"beta": 0.1}),
                                           ("rm", {"center_rewards": 0.01})])
def test_the_plan_is_what_a_run_s_flops_counter_records(tmp_path, command, extra):
    path, cfg = config_file(tmp_path, command, extra)
    (p,) = plan(cfg, command, Options())
    per_step = 20 if command == "kto" else 40  # sequences: a pair is two
    assert (p.steps, p.samples_per_step) == (2, per_step)
    result = TRAIN[command](cfg, spec=SPEC)
    record = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
              if '"flops"' in line][-1]
    n = count_parameters(load_value_model(result.final_model) if command == "rm" else _causal(result.final_model))
    assert p.n_params == record["n_params"] == n
    assert p.tokens_per_sample * p.steps * p.samples_per_step == pytest.approx(record["flops_trained_tokens"],
                                                                               rel=1e-12)
    assert p.flops == pytest.approx(record["flops"], rel=1e-12) and record["flops_generated_tokens"] == 0
    lines = check_config(path, None, [], Options(), COMMANDS)
    assert lines[0].endswith(f"a valid `exactrl {command}` config")
    assert f"FLOPs: {p.flops:.3g}" in lines[2], lines
    if command != "rm":  # the no-grad forwards, beside the FLOPs: dpo's reference; kto's reference and z's pre-pass
        note = next(line for line in lines if "not in the FLOPs" in line)
        forwards = {"dpo": 1, "kto": 3}[command]
        assert f"{forwards * 2 * p.flops / 6:.3g} more" in note, note


def _causal(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)


def test_a_reference_free_loss_plans_no_reference_forward(tmp_path):
    _, cfg = config_file(tmp_path, "dpo", {"loss": "simpo", "beta": 2.0})
    (p,) = plan(cfg, "dpo", Options())
    assert p.flops and not any("not in the FLOPs" in note for note in p.notes)


def test_kd_plans_and_logs_the_student_s_training_and_the_teacher_s_forward(tmp_path):
    """6*N_student*D + 2*N_teacher*D over every trained sequence, each N counted here on the model loaded from
    disk: a teacher left out (6*N_s*D), or counted with a backward (6*N_t*D), or with the student's N, fails."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    student = ensure_builtin(SPEC).model
    config = AutoConfig.from_pretrained(student)
    config.num_hidden_layers += 1  # the same tokenizer and vocabulary, another size
    config.intermediate_size *= 2
    teacher_dir = tmp_path / "teacher"
    AutoModelForCausalLM.from_config(config).save_pretrained(teacher_dir)
    AutoTokenizer.from_pretrained(student).save_pretrained(teacher_dir)
    body = {"model": {"path": str(student)}, "data": {"train": str(resolve("builtin", "sft_train", SPEC)),
                                                     "eval": None},
            "train": {"global_batch_size": 10, "micro_batch_size": 5, "max_steps": 0, "epochs": 1, "log_every": 1,
                      "eval_every": 0},
            "optim": {"lr": 1e-4}, "output_dir": str(tmp_path / "run"), "kd": {"teacher": str(teacher_dir)}}
    path = tmp_path / "kd.yaml"
    path.write_text(yaml.safe_dump(body))
    cfg = load_config(COMMANDS["kd"], path)
    (p,) = plan(cfg, "kd", Options())
    assert (p.steps, p.samples_per_step) == (2, 10)
    result = train_kd(cfg, spec=SPEC)
    record = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
              if '"flops"' in line][-1]
    n_s, n_t = count_parameters(_causal(result.final_model)), count_parameters(_causal(teacher_dir))
    assert n_t > n_s
    assert (p.n_params, p.teacher_params) == (record["n_params"], record["teacher_n_params"]) == (n_s, n_t)
    tokens = record["flops_trained_tokens"]
    assert p.tokens_per_sample * p.steps * p.samples_per_step == pytest.approx(tokens, rel=1e-12)
    assert record["flops"] == pytest.approx((6 * n_s + 2 * n_t) * tokens, rel=1e-12)
    assert p.flops == pytest.approx(record["flops"], rel=1e-12) and record["flops_generated_tokens"] == 0
    lines = check_config(path, None, [], Options(), COMMANDS)
    assert lines[0].endswith("a valid `exactrl kd` config") and f"FLOPs: {p.flops:.3g}" in lines[2], lines
    assert f"N = {n_s:.4g} (student), {n_t:.4g} (teacher)" in lines[2], lines
