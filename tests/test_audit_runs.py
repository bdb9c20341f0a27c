"""`exactrl audit run`: verdicts, derived facts and file:line evidence on realistic run directories.

The fixtures under tests/fixtures/runs/ are written in each framework's documented format; the
expected verdicts below are the rules of exactrl/audit/rules.py applied by hand.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from rich.console import Console

from exactrl.audit.report import exit_code, format_table, to_json
from exactrl.audit.rules import Status
from exactrl.audit.runs import audit_runs

RUNS = Path(__file__).parent / "fixtures" / "runs"
A, N, U, C = "AFFECTED", "NOT AFFECTED", "UNKNOWN", "CONDITIONAL"
DS, ORLHF, TF = "deepspeed-offload-accumulation", "openrlhf-mean-of-means", "transformers-ga-normalisation"

# fixture -> (DeepSpeed offload drop, OpenRLHF mean of means, transformers GA normalisation)
EXPECTED = {
    "openrlhf_old_flags_affected": (A, A, N),
    "openrlhf_new_flags_fixed": (N, N, N),
    "openrlhf_ppo_ray_0_10_2": (N, A, N),
    "hf_trainer_json_affected": (A, N, A),
    "trl_yaml_accelerate_zero3": (N, N, N),
    "accelerate_yaml_range_unknown": (U, U, U),
    "llamafactory_conda_affected": (A, N, A),
    "wandb_hf_trainer_affected": (N, N, A),
    "wandb_openrlhf_metadata_no_world_size": (C, A, N),  # every N DeepSpeed accepts decides (issue 14)
    "deepspeed_json_only_unknown_version": (U, U, U),
    "deepspeed_auto_unresolved": (U, N, N),
    "pickle_only": (U, U, U),
    "missing_evidence": (U, N, A),
    "contradictory": (U, N, U),
    "contradictory_same_verdict": (A, N, N),
}


def audit(name: str):
    return audit_runs([RUNS / name])[0]


def verdict(run, bug: str):
    return next(v for v in run.verdicts if v.bug == bug)


def values(run, fact: str) -> list:
    return [r.value for r in run.facts.get(fact, [])]


def where(run, fact: str) -> list[str]:
    """file:line of every piece of evidence of every reading of a fact."""
    return [e.at for r in run.facts.get(fact, []) for e in r.evidence]


def line_of(path: str, needle: str) -> str:
    """`file:line` of the only line of a fixture file containing `needle` (the test's own count)."""
    file = RUNS / path
    hits = [i for i, text in enumerate(file.read_text().splitlines(), start=1) if needle in text]
    assert len(hits) == 1, (path, needle, hits)
    return f"{Path(path).relative_to(path.split('/')[0])}:{hits[0]}"


def test_every_fixture_is_covered():
    assert sorted(EXPECTED) == sorted(p.name for p in RUNS.iterdir() if p.is_dir())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_verdicts(name):
    run = audit(name)
    assert [(v.bug, v.status.value) for v in run.verdicts] == list(zip((DS, ORLHF, TF), EXPECTED[name]))
    for v in run.verdicts:
        assert v.reason and v.action
        assert (v.action == "Nothing to do.") == (v.status is Status.NOT_AFFECTED)


# ---------------------------------------------------------------- facts, derived K and evidence lines


def test_openrlhf_old_flags_heredoc_script():
    run = audit("openrlhf_old_flags_affected")
    d = "openrlhf_old_flags_affected/"
    assert values(run, "framework") == ["openrlhf"]
    assert values(run, "zero_stage") == [2] and where(run, "zero_stage") == [line_of(
        d + "train_sft.sh", "--zero_stage")]
    assert values(run, "offload_optimizer") == ["cpu"]
    assert where(run, "offload_optimizer") == [line_of(d + "train_sft.sh", "--adam_offload")]
    # --micro_train_batch_size $MICRO_BATCH: the value comes from MICRO_BATCH=2, the evidence is the flag's line
    assert values(run, "micro_batch_size") == [2]
    assert where(run, "micro_batch_size") == [line_of(d + "train_sft.sh", "--micro_train_batch_size")]
    assert values(run, "global_batch_size") == [128]
    assert values(run, "world_size") == [8] and where(run, "world_size") == [line_of(
        d + "train_sft.sh", "--num_gpus 8")]
    (k,) = run.facts["effective_k"]
    assert k.value == 8 and k.note == "derived: 128 / (2 x 8)"
    assert values(run, "version:deepspeed") == ["==0.15.4"]
    assert where(run, "version:deepspeed") == [line_of(d + "pip_freeze.txt", "deepspeed==")]
    assert where(run, "version:openrlhf") == [line_of(d + "pip_freeze.txt", "openrlhf==")]
    ds = verdict(run, DS)
    assert "(g_first + g_last)/8" in ds.reason and "PR #6550" in ds.reason and "PR #7967" in ds.reason
    assert "PR #7981" not in ds.reason  # that note is for K = 1 with several backward() calls (--use_dynamic_batch)
    assert ds.action.startswith("Upgrade to deepspeed>=0.19.0, or use K<=2, or disable offload_optimizer")
    assert "With openrlhf 0.5.4 (sft), K = 8 on 8 ranks" in verdict(run, ORLHF).reason
    assert verdict(run, TF).reason.startswith("Not a Trainer-based run")


def test_openrlhf_dotted_flags_two_nodes():
    run = audit("openrlhf_new_flags_fixed")
    d = "openrlhf_new_flags_fixed/"
    assert values(run, "zero_stage") == [2] and where(run, "zero_stage") == [line_of(
        d + "train_sft.sh", "--ds.zero_stage")]
    assert values(run, "offload_optimizer") == ["cpu"]
    assert values(run, "micro_batch_size") == [2]
    assert where(run, "global_batch_size") == [line_of(d + "train_sft.sh", "--train.batch_size")]
    assert values(run, "world_size") == [16]  # --num_nodes 2 x --num_gpus 8
    assert values(run, "effective_k") == [4]  # 128 / (2 x 16)
    # every DeepSpeed condition holds except the version: the verdict must say that one
    assert verdict(run, DS).reason == "The deepspeed version 0.19.1 is fixed (PR #7967, 0.19.0)."
    assert "0.11.0" in verdict(run, ORLHF).reason and "PR #1249" in verdict(run, ORLHF).reason


def test_openrlhf_ppo_ray_world_from_actor_flags_and_0_10_2_still_affected():
    run = audit("openrlhf_ppo_ray_0_10_2")
    d = "openrlhf_ppo_ray_0_10_2/"
    assert values(run, "world_size") == [4]
    assert where(run, "world_size") == [line_of(d + "train_ppo_ray.sh", "--actor.num_nodes"),
                                        line_of(d + "train_ppo_ray.sh", "--actor.num_gpus_per_node")]
    assert values(run, "effective_k") == [8]  # 128 / (4 x 4)
    assert values(run, "zero_stage") == [3]
    assert values(run, "version:openrlhf") == ["==0.10.2"]  # `openrlhf[vllm]==0.10.2`, extras dropped
    assert verdict(run, DS).reason.startswith("ZeRO stage 3 is a separate code path")


def test_hf_trainer_json_follows_deepspeed_path_and_resolves_auto():
    run = audit("hf_trainer_json_affected")
    d = "hf_trainer_json_affected/"
    assert values(run, "framework") == ["transformers-trainer"]
    assert where(run, "gradient_accumulation_steps") == [line_of(d + "training_args.json", '"gradient_accumulation_')]
    assert [(r.value, r.note) for r in run.facts["effective_k"]] == [(8, "given")]
    assert where(run, "zero_stage") == [line_of(d + "ds_config_zero2.json", '"stage"')]
    assert where(run, "offload_optimizer") == [line_of(d + "ds_config_zero2.json", '"device"')]
    assert values(run, "micro_batch_size") == [4]  # from TrainingArguments; the DeepSpeed "auto" is resolved
    assert not [p for p in run.problems if p.kind == "unresolved"]
    assert values(run, "version:deepspeed") == ["==0.15.4+cu121"]  # a local version, still in [0.15.2, 0.19.0)
    assert values(run, "version:transformers") == ["==4.44.2"]
    assert "With transformers 4.44.2 and gradient_accumulation_steps = 8" in verdict(run, TF).reason


def test_trl_yaml_with_accelerate_zero3_and_range_pins():
    run = audit("trl_yaml_accelerate_zero3")
    d = "trl_yaml_accelerate_zero3/"
    assert values(run, "framework") == ["trl", "trl"]  # the YAML and trl/scripts/sft.py on the launch line
    assert values(run, "zero_stage") == [3]
    assert where(run, "zero_stage") == [line_of(d + "deepspeed_zero3.yaml", "zero_stage:")]
    assert values(run, "world_size") == [8]
    assert values(run, "effective_k") == [16]
    assert verdict(run, DS).reason == "ZeRO stage 3 is a separate code path: exact (measured)."
    tf = verdict(run, TF).reason
    assert "known only as a range, transformers<5,>=4.46.0 (requirements.txt:2)" in tf
    assert "weaker evidence than an exact == pin; every version it admits gives the same verdict" in tf


def test_accelerate_config_with_a_range_that_spans_the_bug_is_unknown():
    run = audit("accelerate_yaml_range_unknown")
    d = "accelerate_yaml_range_unknown/"
    assert values(run, "effective_k") == [4]
    assert where(run, "effective_k") == [line_of(d + "accelerate_config.yaml", "gradient_accumulation_steps")]
    assert values(run, "world_size") == [2]
    ds = verdict(run, DS)
    assert ("The deepspeed version is known only as a range, deepspeed>=0.14.0 (requirements.txt:3): weaker evidence "
            "than an exact == pin; the versions it admits lead to different verdicts") in ds.reason
    assert "With deepspeed 0.14.0: NOT AFFECTED" in ds.reason and "with deepspeed 0.15.2: AFFECTED" in ds.reason
    assert "pip freeze or conda list" in ds.action
    assert "training framework" in verdict(run, ORLHF).reason


def test_llamafactory_yaml_deepspeed_found_by_name_and_conda_list():
    run = audit("llamafactory_conda_affected")
    d = "llamafactory_conda_affected/"
    assert values(run, "framework") == ["llamafactory", "llamafactory"]  # the YAML and llamafactory-cli
    assert where(run, "zero_stage") == [line_of(d + "ds_z2_offload_config.json", '"stage"')]
    assert values(run, "effective_k") == [8]
    assert values(run, "version:transformers") == ["==4.45.2"]
    assert where(run, "version:transformers") == [line_of(d + "conda_list.txt", "transformers")]
    assert values(run, "version:llamafactory") == ["==0.9.0"]
    assert values(run, "is_openrlhf") == [False, False]


def test_wandb_config_and_requirements():
    run = audit("wandb_hf_trainer_affected")
    f = "wandb_hf_trainer_affected/wandb/run-20241002_101500-3k9x2abc/files/"
    assert values(run, "version:transformers") == ["==4.45.1", "==4.45.1"]
    assert sorted(where(run, "version:transformers")) == sorted([line_of(f + "config.yaml", "huggingface_version"),
                                                                line_of(f + "requirements.txt", "transformers==")])
    assert values(run, "effective_k") == [16]
    k_line = int(line_of(f + "config.yaml", "gradient_accumulation_steps:").rsplit(":", 1)[1]) + 2  # its `value:`
    assert where(run, "effective_k") == [f"{f.split('/', 1)[1]}config.yaml:{k_line}"]
    assert verdict(run, DS).reason == "The run did not use DeepSpeed."


def test_wandb_metadata_args_without_world_size_judged_for_every_world_size():
    run = audit("wandb_openrlhf_metadata_no_world_size")
    f = "wandb_openrlhf_metadata_no_world_size/wandb/run-20250310_081122-p0q9z8yy/files/"
    assert values(run, "framework") == ["openrlhf"]
    assert values(run, "zero_stage") == [2]
    assert where(run, "zero_stage") == [line_of(f + "wandb-metadata.json", '"--zero_stage"')]
    assert values(run, "offload_optimizer") == ["cpu"]
    assert values(run, "world_size") == [] and values(run, "effective_k") == []
    assert values(run, "version:openrlhf") == ["==0.6.1.post1"]
    ds = verdict(run, DS)  # K = 64 / (1 x N) >= 3 iff N <= 21
    assert ds.status is Status.CONDITIONAL and ds.condition == "run on <= 21 GPUs"
    assert "N is one of 1, 2, 4, 8, 16, 32, 64" in ds.reason
    assert "On N = 16: With deepspeed 0.16.2" in ds.reason and "On N = 32: K = 2 is accidentally right" in ds.reason
    assert ds.action.startswith("Find how many GPUs the run used; if it was <= 21 GPUs: Upgrade to deepspeed")
    orlhf = verdict(run, ORLHF)  # SFT: K > 1 or N > 1 whatever N is
    assert orlhf.status is Status.AFFECTED and "Every one gives AFFECTED" in orlhf.reason


def test_deepspeed_json_only():
    run = audit("deepspeed_json_only_unknown_version")
    assert values(run, "effective_k") == [8]
    (w,) = run.facts["world_size"]
    assert w.value == 8 and w.note == "derived: 256 / (4 x 8)"
    ds = verdict(run, DS)
    assert ds.reason.startswith("Not enough evidence, missing: deepspeed version")
    assert ds.action.startswith("Provide deepspeed version")


def test_auto_values_nothing_resolves_are_reported():
    run = audit("deepspeed_auto_unresolved")
    unresolved = {p.fact: p.evidence[0].at for p in run.problems if p.kind == "unresolved"}
    assert unresolved == {"global_batch_size": "ds_z2_offload.json:2", "micro_batch_size": "ds_z2_offload.json:3",
                          "gradient_accumulation_steps": "ds_z2_offload.json:4"}
    assert 'gradient_accumulation_steps is "auto" at ds_z2_offload.json:4' in verdict(run, DS).reason


def test_pickle_is_reported_and_never_loaded(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the audit must not unpickle")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    run = audit("pickle_only")
    (problem,) = run.problems
    assert problem.kind == "unreadable" and problem.evidence[0].file == "training_args.bin"
    assert "a pickle (protocol 4): not read (unpickling runs code)" in problem.message
    assert "training_args.json" in problem.message
    assert run.facts == {}
    assert all("training_args.bin is a pickle" in v.reason for v in run.verdicts)


def test_missing_referenced_config():
    run = audit("missing_evidence")
    (problem,) = run.problems
    assert problem.kind == "missing" and "configs/ds_zero2.json" in problem.message
    assert problem.evidence[0].at == line_of("missing_evidence/training_args.json", '"deepspeed"')
    ds = verdict(run, DS)
    assert "Not enough evidence, missing: ZeRO stage" in ds.reason and "configs/ds_zero2.json" in ds.reason
    assert values(run, "uses_deepspeed") == [True]


def test_contradictory_stages_make_the_verdict_unknown():
    run = audit("contradictory")
    contradictions = {p.fact for p in run.problems if p.kind == "contradiction"}
    assert contradictions == {"zero_stage", "version:transformers"}
    ds = verdict(run, DS)
    assert "The readings of zero_stage disagree: 2 (ds_stage2.json:6) vs 3 (ds_stage3.json:6)" in ds.reason
    assert "With zero_stage = 2: AFFECTED" in ds.reason and "with zero_stage = 3: NOT AFFECTED" in ds.reason
    assert ds.action == "Resolve zero_stage: keep only the files the run used."
    tf = verdict(run, TF)
    assert "transformers==4.46.0 (pip_freeze.txt:3) vs transformers==4.45.2 (requirements.txt:2)" in tf.reason


def test_contradictions_that_agree_on_the_verdict_say_so():
    run = audit("contradictory_same_verdict")
    assert sorted(values(run, "effective_k")) == [4, 8]  # given 4, but 64 / (2 x 4 GPUs) = 8
    assert {p.fact for p in run.problems if p.kind == "contradiction"} == {"effective_k", "version:deepspeed"}
    ds = verdict(run, DS)
    assert ds.reason.startswith("Every reading gives AFFECTED, e.g.")
    assert "The readings of effective_k disagree: 4 (ds_config.json:4) vs 8" in ds.reason
    assert "deepspeed==0.17.1 (pip_freeze.txt:1) vs deepspeed==0.15.4 (requirements.txt:1)" in ds.reason


# ---------------------------------------------------------------- single files, ignored configs, launchers


def test_a_single_file_follows_its_references():
    run = audit_runs([RUNS / "hf_trainer_json_affected" / "training_args.json"])[0]
    assert where(run, "zero_stage") == ["ds_config_zero2.json:9"]
    assert verdict(run, DS).status is Status.UNKNOWN  # pip_freeze.txt was not given
    assert "deepspeed version" in verdict(run, DS).reason


def test_missing_path(tmp_path):
    run = audit_runs([tmp_path / "nope"])[0]
    assert [p.kind for p in run.problems] == ["missing"]
    assert {v.status for v in run.verdicts} == {Status.UNKNOWN}
    assert exit_code([run]) == 2


def test_unnamed_deepspeed_configs_are_ignored_when_one_is_named(tmp_path):
    (tmp_path / "args.json").write_text(json.dumps(
        {"output_dir": "o", "per_device_train_batch_size": 1, "gradient_accumulation_steps": 4, "deepspeed": "a.json"}))
    for name, stage in (("a.json", 3), ("b.json", 2)):
        (tmp_path / name).write_text(json.dumps({"zero_optimization": {"stage": stage}}))
    run = audit_runs([tmp_path])[0]
    assert values(run, "zero_stage") == [3]
    assert [(p.kind, p.message) for p in run.problems] == [
        ("ignored", "b.json: a DeepSpeed config the run's arguments do not name; ignored")]


@pytest.mark.parametrize("command, world", [
    ("torchrun --nproc_per_node=4 --nnodes 2 train.py --gradient_accumulation_steps 2", [8]),
    ("python -m torch.distributed.run --nproc-per-node 2 train.py --gradient_accumulation_steps 2", [2]),
    ("deepspeed --include localhost:0,1,2 train.py --deepspeed ds.json", [3]),
    ("accelerate launch --num_processes 6 train.py --per_device_train_batch_size 2", [6]),
    ("python train.py --gradient_accumulation_steps 2", [1]),
    ("python convert_checkpoint.py --out x", []),  # not a training command
    ("deepspeed train.py --deepspeed ds.json", []),  # every visible GPU: unknown
])
def test_launchers(tmp_path, command, world):
    (tmp_path / "run.sh").write_text(command + "\n")
    run = audit_runs([tmp_path])[0]
    assert values(run, "world_size") == world
    if command.startswith("deepspeed train.py"):
        assert any(p.kind == "unresolved" and p.fact == "world_size" for p in run.problems)


def test_saved_openrlhf_args_nested_dotted(tmp_path):
    (tmp_path / "args.yaml").write_text("ds:\n  zero_stage: 1\n  adam_offload: true\ntrain:\n"
                                        "  micro_batch_size: 1\n  batch_size: 32\n")
    run = audit_runs([tmp_path])[0]
    assert values(run, "framework") == ["openrlhf"]
    assert values(run, "zero_stage") == [1] and where(run, "zero_stage") == ["args.yaml:2"]
    assert values(run, "offload_optimizer") == ["cpu"]
    assert verdict(run, DS).reason.startswith("ZeRO stage 1 + offload reduces only at the accumulation boundary")


def test_openrlhf_ring_attention_divides_the_world(tmp_path):
    # OpenRLHF: K = train_batch_size x ring_attn_size / (micro x world), i.e. the world counts data-parallel ranks
    (tmp_path / "run.sh").write_text("deepspeed --num_gpus 8 --module openrlhf.cli.train_sft --ring_attn_size 2 "
                                     "--micro_train_batch_size 1 --train_batch_size 32 --adam_offload\n")
    run = audit_runs([tmp_path])[0]
    assert values(run, "parallel_divisor") == [2]
    (k,) = run.facts["effective_k"]
    assert (k.value, k.note) == (8, "derived: 32 / (1 x 4)")


def test_wandb_requirements_is_a_whole_environment(tmp_path):
    (tmp_path / "wandb-metadata.json").write_text('{"program": "train.py", "args": []}')
    (tmp_path / "requirements.txt").write_text("torch==2.4.0\ndeepspeed==0.16.0\n")  # W&B's pip freeze
    run = audit_runs([tmp_path])[0]
    assert [(r.value, r.note) for r in run.facts["is_openrlhf"]] == [(False, "openrlhf is not installed")]
    assert [(r.value, r.note) for r in run.facts["uses_hf_trainer"]] == [(False, "transformers is not installed")]
    (tmp_path / "wandb-metadata.json").unlink()  # a hand-written requirements.txt may be partial: no such claim
    assert "is_openrlhf" not in audit_runs([tmp_path])[0].facts


# ---------------------------------------------------------------- outputs


def test_json_output():
    audits = audit_runs([RUNS / "hf_trainer_json_affected", RUNS / "trl_yaml_accelerate_zero3"])
    out = json.loads(json.dumps(to_json(audits)))
    assert out["exit_code"] == 1
    first = out["runs"][0]
    assert first["path"].endswith("hf_trainer_json_affected")
    (stage,) = first["facts"]["zero_stage"]
    assert stage["value"] == 2 and stage["evidence"][0]["at"] == "ds_config_zero2.json:9"
    assert stage["evidence"][0]["text"] == '"stage": 2,'
    assert first["facts"]["version:deepspeed"][0]["value"] == "deepspeed==0.15.4+cu121"
    assert [v["status"] for v in first["verdicts"]] == [A, N, A]
    assert {e["at"] for e in first["verdicts"][0]["evidence"]} >= {"ds_config_zero2.json:9", "pip_freeze.txt:3"}
    assert [v["status"] for v in out["runs"][1]["verdicts"]] == [N, N, N]


@pytest.mark.parametrize("names, code", [
    (["trl_yaml_accelerate_zero3", "openrlhf_new_flags_fixed"], 0),
    (["trl_yaml_accelerate_zero3", "openrlhf_old_flags_affected"], 1),
    (["trl_yaml_accelerate_zero3", "deepspeed_json_only_unknown_version"], 2),
    (["deepspeed_json_only_unknown_version", "openrlhf_old_flags_affected"], 1),
])
def test_exit_code(names, code):
    assert exit_code(audit_runs([RUNS / n for n in names])) == code


def test_table_output():
    console = Console(record=True, width=200)
    console.print(format_table(audit_runs([RUNS / "openrlhf_old_flags_affected", RUNS / "pickle_only"])))
    text = console.export_text()
    assert "summary" in text and "deepspeed-offload-accumulation" in text
    assert "run: " + str(RUNS / "openrlhf_old_flags_affected") in text
    assert "AFFECTED" in text and "train_sft.sh:20" in text and "derived: 128 / (2 x 8)" in text
    assert "unreadable: training_args.bin is a pickle" in text
