"""`exactrl audit run` on run directories assembled from real public files (tests/fixtures/runs_real/,
each with a SOURCES.md naming repository, path and commit, and the verdicts expected from a manual
reading written before the audit was run), then each class of disagreement issue 14 found, and
hostile files."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from exactrl.audit.evidence import package_list_kind, package_pins
from exactrl.audit.report import exit_code
from exactrl.audit.rules import Status
from exactrl.audit.runs import audit_runs
from exactrl.cli import app

REAL = Path(__file__).parent / "fixtures" / "runs_real"
A, N, U, C = Status.AFFECTED, Status.NOT_AFFECTED, Status.UNKNOWN, Status.CONDITIONAL
DS, ORLHF, TF = "deepspeed-offload-accumulation", "openrlhf-mean-of-means", "transformers-ga-normalisation"

# (fixture, bug) -> (verdict, a phrase of the reason); the same verdicts as each fixture's SOURCES.md
TABLE = {
    ("openrlhf_0_6_ppo_bare_deepspeed", DS): (C, "AFFECTED if run on <= 21 GPUs"),
    ("openrlhf_0_6_ppo_bare_deepspeed", ORLHF): (N, "without --packing_samples averages each sequence"),
    ("openrlhf_0_6_ppo_bare_deepspeed", TF): (N, "Not a Trainer-based run"),
    ("openrlhf_0_6_sft_bare_deepspeed", DS): (N, "The offload_optimizer device is none"),
    ("openrlhf_0_6_sft_bare_deepspeed", ORLHF): (A, "Every one gives AFFECTED"),
    ("openrlhf_0_6_sft_bare_deepspeed", TF): (N, "Not a Trainer-based run"),
    ("openrlhf_0_6_ppo_ray_packing", DS): (N, "ZeRO stage 3"),
    ("openrlhf_0_6_ppo_ray_packing", ORLHF): (U, "`git tag --contains 796f6f25`"),
    ("openrlhf_0_6_ppo_ray_packing", TF): (N, "Not a Trainer-based run"),
    ("openrlhf_0_6_dpo", DS): (N, "ZeRO stage 3"),
    ("openrlhf_0_6_dpo", ORLHF): (N, "DPO averages one loss per pair"),
    ("openrlhf_0_6_dpo", TF): (N, "Not a Trainer-based run"),
    ("openrlhf_0_9_ppo_dynamic_batch", DS): (N, "--use_dynamic_batch sets DeepSpeed's gradient_accumulation_steps"),
    ("openrlhf_0_9_ppo_dynamic_batch", ORLHF): (A, "With openrlhf 0.9.0 (ppo), K = 4 on 8 ranks"),
    ("openrlhf_0_9_ppo_dynamic_batch", TF): (N, "Not a Trainer-based run"),
    ("llamafactory_0_9_dpo_z2_offload", DS): (A,
                                              "With deepspeed 0.15.4, ZeRO stage 2, offload_optimizer cpu and K = 8,"),
    ("llamafactory_0_9_dpo_z2_offload", ORLHF): (N, "Not an OpenRLHF run"),
    ("llamafactory_0_9_dpo_z2_offload", TF): (N, "DPO averages one loss per pair"),
    ("trl_0_11_sft_accelerate_zero2", DS): (N, "The offload_optimizer device is none"),
    ("trl_0_11_sft_accelerate_zero2", ORLHF): (N, "Not an OpenRLHF run"),
    ("trl_0_11_sft_accelerate_zero2", TF): (A, "With transformers 4.44.2 and gradient_accumulation_steps = 16"),
    ("deepspeed_chat_dpo_offload", DS): (N, "ZeRO stage 3"),
    ("deepspeed_chat_dpo_offload", ORLHF): (N, "Not an OpenRLHF run"),
    ("deepspeed_chat_dpo_offload", TF): (N, "Not a Trainer-based run"),
    ("verl_0_4_grpo_fsdp_offload", DS): (N, "FSDP (verl, with its own offload) trained this run, not DeepSpeed"),
    ("verl_0_4_grpo_fsdp_offload", ORLHF): (N, "Not an OpenRLHF run"),
    ("verl_0_4_grpo_fsdp_offload", TF): (N, "Not a Trainer-based run"),
    ("luffy_mixed_policy", DS): (N, "FSDP (verl) trained this run, not DeepSpeed"),
    ("luffy_mixed_policy", ORLHF): (N, "Not an OpenRLHF run"),
    ("luffy_mixed_policy", TF): (N, "Not a Trainer-based run"),
}


def verdict(path, bug: str):
    return next(v for v in audit_runs([path])[0].verdicts if v.bug == bug)


def test_every_real_fixture_is_covered_and_sourced():
    names = sorted(p.name for p in REAL.iterdir() if p.is_dir())
    assert sorted({name for name, _ in TABLE}) == names
    for name in names:
        sources = (REAL / name / "SOURCES.md").read_text()
        assert "## Expected" in sources
        for file in (REAL / name).iterdir():
            assert file.name == "SOURCES.md" or f"| {file.name} |" in sources, (name, file.name)


@pytest.mark.parametrize("name, bug", sorted(TABLE))
def test_real_fixture_verdicts(name, bug):
    status, phrase = TABLE[name, bug]
    v = verdict(REAL / name, bug)
    assert (v.status, phrase in v.reason) == (status, True), v.reason
    assert v.reason[0].isupper() and "  " not in v.reason


# ---------------------------------------------------------------- the classes of disagreement


def run(tmp_path, files: dict[str, str]):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return audit_runs([tmp_path])[0]


def of(audit, bug):
    return next(v for v in audit.verdicts if v.bug == bug)


ORLHF_CMD = "deepspeed --num_gpus 4 --module openrlhf.cli.{} --micro_train_batch_size 2 --train_batch_size 64 {}\n"


@pytest.mark.parametrize("trainer, flags, status", [
    ("train_sft", "", A), ("train_dpo", "", N), ("train_rm", "", N),
    ("train_dpo", "--nll_loss_coef 0.2", A),  # the NLL term is a token mean
    ("train_ppo", "", N), ("train_ppo", "--packing_samples", A),  # 0.6.x: per sequence unless packed
])
def test_openrlhf_loss_modelled_per_trainer(tmp_path, trainer, flags, status):
    audit = run(tmp_path, {"run.sh": ORLHF_CMD.format(trainer, flags), "pip_freeze.txt": "openrlhf==0.6.1\n"})
    assert of(audit, ORLHF).status is status, of(audit, ORLHF).reason


@pytest.mark.parametrize("version, status", [("0.6.4", N), ("0.7.0", A), ("0.10.3", A), ("0.10.4", N)])
def test_openrlhf_ppo_token_level_from_0_7_0(tmp_path, version, status):
    audit = run(tmp_path, {"run.sh": ORLHF_CMD.format("train_ppo", ""), "pip_freeze.txt": f"openrlhf=={version}\n"})
    assert of(audit, ORLHF).status is status


@pytest.mark.parametrize("stage, extra, status", [("sft", "", A), ("pt", "", A), ("dpo", "", N), ("rm", "", N),
                                                  ("kto", "", N), ("dpo", "pref_ftx: 1\n", A)])
def test_llamafactory_stage_decides_the_transformers_rule(tmp_path, stage, extra, status):
    config = (f"stage: {stage}\nfinetuning_type: lora\ntemplate: llama3\nper_device_train_batch_size: 1\n"
              f"gradient_accumulation_steps: 8\noutput_dir: out\n{extra}")
    audit = run(tmp_path, {"train.yaml": config, "pip_freeze.txt": "transformers==4.45.2\nllamafactory==0.9.1\n"})
    assert of(audit, TF).status is status, of(audit, TF).reason


def test_bare_deepspeed_launch_gives_a_conditional_verdict(tmp_path):
    audit = run(tmp_path, {"run.sh": "deepspeed --module openrlhf.cli.train_sft --micro_train_batch_size 2 "
                                     "--train_batch_size 128 --adam_offload\n",
                           "pip_freeze.txt": "deepspeed==0.16.4\n"})
    ds = of(audit, DS)
    assert ds.status is C and ds.condition == "run on <= 21 GPUs"  # 128 / (2 x 21) >= 3 > 128 / (2 x 22)
    assert exit_code([audit]) == 2
    # the same run with its world size known is decided either way
    for gpus, status in ((16, A), (32, N)):
        (tmp_path / "run.sh").write_text(f"deepspeed --num_gpus {gpus} --module openrlhf.cli.train_sft "
                                         "--micro_train_batch_size 2 --train_batch_size 128 --adam_offload\n")
        assert of(audit_runs([tmp_path])[0], DS).status is status


def test_unknown_asks_only_for_what_the_world_size_does_not_decide(tmp_path):
    audit = run(tmp_path, {"run.sh": "deepspeed --module openrlhf.cli.train_sft --micro_train_batch_size 2 "
                                     "--train_batch_size 128 --adam_offload\n"})  # no versions anywhere
    ds, orlhf = of(audit, DS), of(audit, ORLHF)
    assert ds.status is U and orlhf.status is U
    for v in (ds, orlhf):
        assert v.action == (f"Provide {v.bug.split('-')[0]} version (pip freeze, conda list, requirements.txt or "
                            "W&B's requirements.txt).")
        assert v.reason.count("world size") + v.reason.count("GPUs (N)") <= 1
    assert "On 32 or 64 GPUs the run is NOT AFFECTED whatever the deepspeed version is" in ds.reason
    assert "The world size would not change that." in orlhf.reason


def test_world_size_sweep_is_quick_on_large_batches(tmp_path):
    audit = run(tmp_path, {"run.sh": "deepspeed --module openrlhf.cli.train_sft --micro_train_batch_size 1 "
                                     "--train_batch_size 8192 --adam_offload\n",
                                     "pip_freeze.txt": "deepspeed==0.16.4\n"})
    start = time.perf_counter()
    assert of(audit_runs([tmp_path])[0], DS).condition == "run on <= 2730 GPUs"  # 8192 / 3 = 2730.7
    assert time.perf_counter() - start < 1.0
    assert of(audit, DS).status is C


def test_dynamic_batch_fixes_deepspeed_k_at_one_and_gets_the_7981_note(tmp_path):
    cmd = ("deepspeed --num_gpus 2 --module openrlhf.cli.train_ppo --micro_train_batch_size 1 --train_batch_size 64 "
           "--adam_offload {}\n")
    audit = run(tmp_path, {"run.sh": cmd.format("--use_dynamic_batch"), "pip_freeze.txt": "deepspeed==0.16.4\n"})
    ds = of(audit, DS)
    assert ds.status is N and "gradient_accumulation_steps to 1" in ds.reason and "PR #7981" in ds.reason
    (tmp_path / "run.sh").write_text(cmd.format(""))
    ds = of(audit_runs([tmp_path])[0], DS)
    assert ds.status is A and "PR #7981" not in ds.reason


@pytest.mark.parametrize("script", ["examples/scripts/sft.py", "trl/scripts/sft.py"])
def test_trl_example_scripts_are_trl_runs(tmp_path, script):
    audit = run(tmp_path, {"run.sh": f"accelerate launch --num_processes 2 {script} --per_device_train_batch_size 2 "
                                     "--gradient_accumulation_steps 4 --output_dir out\n",
                           "pip_freeze.txt": "transformers==4.44.2\ntrl==0.11.0\n"})
    assert [r.value for r in audit.facts["framework"]] == ["trl"]
    assert [r.value for r in audit.facts["trainer"]] == ["sft"]
    assert of(audit, TF).status is A


def test_accelerate_fsdp_offload_is_not_a_deepspeed_run(tmp_path):
    audit = run(tmp_path, {"fsdp.yaml": "compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\n"
                                        "fsdp_config:\n  fsdp_offload_params: true\nnum_processes: 8\n"})
    ds = of(audit, DS)
    assert ds.status is N and ds.reason.startswith("FSDP (Accelerate distributed_type: FSDP) trained this run")


def test_version_evidence_from_editable_git_and_wheel_lines():
    freeze = ("# Editable install with no version control (openrlhf==0.6.1.post1)\n-e /w/OpenRLHF\n"
              "-e git+https://github.com/x/trl.git@0123456789abcdef0123456789abcdef01234567#egg=trl\n"
              "deepspeed @ file:///wheels/deepspeed-0.15.4-py3-none-any.whl\n"
              "torch @ https://download.pytorch.org/whl/cu121/torch-2.4.1%2Bcu121-cp311-linux_x86_64.whl\n"
              "transformers @ file:///src/transformers\n")
    assert [(p.name, p.spec, p.line) for p in package_pins(freeze, "freeze")] == [
        ("openrlhf", "==0.6.1.post1", 1), ("trl", "@0123456789abcdef0123456789abcdef01234567", 3),
        ("deepspeed", "==0.15.4", 4), ("torch", "==2.4.1+cu121", 5), ("transformers", "", 6)]


def test_a_requirements_file_of_exact_pins_is_a_freeze():
    pins = "".join(f"pkg{i}==1.{i}\n" for i in range(30))
    assert package_list_kind("requirements.txt", pins) == "freeze"
    assert package_list_kind("requirements.txt", pins + "torch>=2\n") == "requirements"
    assert package_list_kind("requirements.txt", "torch==2.4.0\ndeepspeed==0.16.0\n") == "requirements"  # a few pins


# ---------------------------------------------------------------- hostile files


def billion_laughs() -> str:
    rows = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    rows += [f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]" for a, b in zip("abcdefghi", "bcdefghij")]
    return "\n".join(rows) + "\n"


@pytest.mark.parametrize("name, text, says", [
    ("bomb.yaml", billion_laughs(), "alias bomb"),
    ("deep.json", "[" * 100_000 + "]" * 100_000, "nested more than 500 levels deep"),
    ("deep.yaml", "[" * 100_000 + "]" * 100_000, "nested more than 500 levels deep"),
    ("deep_block.yaml", "".join(" " * i + f"k{i}:\n" for i in range(1500)) + " " * 1500 + "v\n", "nested"),
])
def test_hostile_files_are_unreadable_evidence_quickly(tmp_path, name, text, says):
    (tmp_path / name).write_text(text)
    start = time.perf_counter()
    audit = audit_runs([tmp_path])[0]
    assert time.perf_counter() - start < 1.5
    (problem,) = audit.problems
    assert problem.kind == "unreadable" and problem.message.startswith(f"{name}: not read as")
    assert says in problem.message


# ---------------------------------------------------------------- exit codes


def test_exit_codes_are_documented_in_help_and_docs():
    out = CliRunner().invoke(app, ["audit", "run", "--help"], terminal_width=200).output
    assert all(text in " ".join(out.split()) for text in ("0:", "1:", "2:", "CONDITIONAL"))
    page = " ".join((Path(__file__).parents[1] / "docs" / "audit.md").read_text().split())
    assert "Exit code 0 when every verdict is NOT AFFECTED, 1 when any is AFFECTED, 2 otherwise" in page


def test_cli_json_and_exit_code_on_a_conditional_run():
    result = CliRunner().invoke(app, ["audit", "run", str(REAL / "openrlhf_0_6_ppo_bare_deepspeed"), "--json"])
    assert result.exit_code == 2
    ds = json.loads(result.output)["runs"][0]["verdicts"][0]
    assert (ds["status"], ds["condition"]) == ("CONDITIONAL", "run on <= 21 GPUs")
