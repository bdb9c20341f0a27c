"""The run audit's pieces without fixtures: each bug rule as a pure function of the facts, the
version ranges evidence admits, and the readers of JSON lines, package lists and shell scripts.
(Verdicts on whole fixture runs: tests/test_audit_runs.py.)"""

from __future__ import annotations

import pytest
from packaging.version import Version

from exactrl.audit.evidence import Doc, Reading, package_list_kind, package_pins, shell_commands
from exactrl.audit.judging import candidates
from exactrl.audit.rules import RULES, Status, deepspeed_offload, openrlhf_mean_of_means, transformers_ga

A, N, U = Status.AFFECTED, Status.NOT_AFFECTED, Status.UNKNOWN
DS, ORLHF, TF = "deepspeed-offload-accumulation", "openrlhf-mean-of-means", "transformers-ga-normalisation"


# ---------------------------------------------------------------- the rules as pure functions


def ds_facts(**over):
    base = {"uses_deepspeed": True, "zero_stage": 2, "offload_optimizer": "cpu", "effective_k": 4,
            "version:deepspeed": Version("0.16.0")}
    return {**base, **{k.replace("version_", "version:"): v for k, v in over.items()}}


@pytest.mark.parametrize("over, status", [
    ({}, A),
    ({"version_deepspeed": Version("0.15.1")}, N),
    ({"version_deepspeed": Version("0.15.2")}, A),
    ({"version_deepspeed": Version("0.18.9")}, A),
    ({"version_deepspeed": Version("0.19.0")}, N),
    ({"version_deepspeed": Version("0.18.5+cu124")}, A),
    ({"zero_stage": 0}, N), ({"zero_stage": 1}, N), ({"zero_stage": 3}, N),
    ({"offload_optimizer": "none"}, N), ({"offload_optimizer": "nvme"}, N),
    ({"effective_k": 1}, N), ({"effective_k": 2}, N), ({"effective_k": 3}, A),
    ({"version_deepspeed": None}, U),
    ({"effective_k": None}, U),
    ({"version_deepspeed": None, "zero_stage": 3}, N),  # one known-false condition decides
    ({"version_deepspeed": None, "effective_k": None, "offload_optimizer": "none"}, N),
    ({"uses_deepspeed": False, "zero_stage": None}, N),
    ({"uses_deepspeed": False, "zero_stage": None, "fsdp": "FSDP (verl)"}, N),
    ({"dynamic_batch": True}, N),  # OpenRLHF --use_dynamic_batch: DeepSpeed's K is 1
    ({"dynamic_batch": True, "effective_k": None}, N),
    ({"dynamic_batch": False}, A),
])
def test_deepspeed_rule(over, status):
    assert deepspeed_offload(ds_facts(**over)).status.value == status


@pytest.mark.parametrize("version, k, world, status", [
    ("0.5.4", 4, 1, A), ("0.9.10", 1, 8, A), ("0.10.1.post2", 4, 8, A), ("0.10.2", 1, 2, A),
    ("0.10.3", 1, 8, N),  # df78645e: token counts summed across ranks, one micro-batch per step
    ("0.10.3", 4, 8, A),  # ... but still a mean over the accumulation window until PR #1249
    ("0.10.4", 4, 8, N), ("0.11.0", 16, 64, N),
    ("0.9.0", 1, 1, N), (None, 4, 8, U), (None, 1, 1, N), ("0.9.0", 1, None, U), ("0.10.3", 1, None, N),
])
def test_openrlhf_rule(version, k, world, status):
    facts = {"is_openrlhf": True, "version:openrlhf": version and Version(version), "effective_k": k,
             "world_size": world, "trainer": "sft", "packing_samples": False}  # SFT: a token mean in every release
    assert openrlhf_mean_of_means(facts).status.value == status
    assert openrlhf_mean_of_means({**facts, "is_openrlhf": False}).status.value == N


@pytest.mark.parametrize("trainer, version, packing, status", [
    ("sft", "0.6.1", False, A), ("dpo", "0.6.1", False, N), ("rm", "0.9.0", True, N), ("kto", "0.9.0", False, N),
    ("dpo + NLL term", "0.6.1", False, A),
    ("ppo", "0.6.4", False, N), ("ppo", "0.6.4", True, A), ("ppo", "0.6.4", None, U),  # per sequence unless packed
    ("ppo", "0.7.0", False, A), ("ppo", None, False, U), (None, "0.9.0", False, U), ("ppo", "0.10.4", True, N),
])
def test_openrlhf_rule_models_the_loss(trainer, version, packing, status):
    facts = {"is_openrlhf": True, "version:openrlhf": version and Version(version), "effective_k": 4,
             "world_size": 8, "trainer": trainer, "packing_samples": packing}
    assert openrlhf_mean_of_means(facts).status.value == status


@pytest.mark.parametrize("trainer, status", [(None, A), ("sft", A), ("pt", A), ("dpo", N), ("rm", N), ("kto", N),
                                             ("reward_modeling", N), ("dpo + pref_ftx 1", A)])
def test_transformers_rule_models_the_loss(trainer, status):
    facts = {"uses_hf_trainer": True, "version:transformers": Version("4.45.2"), "effective_k": 8, "trainer": trainer}
    assert transformers_ga(facts).status.value == status


@pytest.mark.parametrize("hf, version, k, status", [
    (True, "4.45.2", 4, A), (True, "4.46.0", 4, N), (True, "4.46.1", 4, N), (True, "4.40.0", 1, N),
    (False, "4.40.0", 8, N), (None, "4.40.0", 8, U), (True, None, 8, U), (None, None, 1, N),
])
def test_transformers_rule(hf, version, k, status):
    facts = {"uses_hf_trainer": hf, "version:transformers": version and Version(version), "effective_k": k}
    assert transformers_ga(facts).status.value == status


def test_rules_registry():
    assert list(RULES) == [DS, ORLHF, TF]
    assert all(set(r.needs) and r.fix for r in RULES.values())


def test_version_candidates():
    def pins(*specs):
        return [Reading(s, ()) for s in specs]

    got, conflict = candidates("version:deepspeed", pins(">=0.19.0"))
    assert not conflict and min(got) == Version("0.19.0")
    assert candidates("version:deepspeed", pins(">=0.15", "==0.16.1")) == ([Version("0.16.1")], False)
    got, conflict = candidates("version:deepspeed", pins("==0.15.4", "==0.17.1"))
    assert conflict and got == [Version("0.15.4"), Version("0.17.1")]
    got, _ = candidates("version:deepspeed", pins("~=0.15.0"))
    assert Version("0.15.1") in got and Version("0.15.2") in got and Version("0.16.0") not in got


# ---------------------------------------------------------------- formats


def test_json_line_numbers_for_nested_keys_and_arrays():
    doc = Doc.parse("x.json", '{\n  "a": {\n    "b": [\n      1,\n      {"c": 2}\n    ]\n  },\n  "d": "e"\n}', "json")
    assert doc.lines[("a",)] == 2 and doc.lines[("a", "b")] == 3 and doc.lines[("a", "b", 0)] == 4
    assert doc.lines[("a", "b", 1, "c")] == 5 and doc.lines[("d",)] == 8
    assert doc.get("d")[1].at == "x.json:8"


def test_package_lists():
    export = "# This file may be used to create an environment using:\ndeepspeed=0.15.4=pypi_0\ntorch=2.4.0=py3.11\n"
    assert package_list_kind("env.txt", export) == "table"
    assert [(p.name, p.spec, p.line) for p in package_pins(export, "table")] == [
        ("deepspeed", "==0.15.4", 2), ("torch", "==2.4.0", 3)]
    pip_list = "Package      Version\n------------ -------\nDeepSpeed    0.16.2\n"
    assert package_list_kind("pip_list.txt", pip_list) == "table"
    assert ("deepspeed", "==0.16.2", 3) in [(p.name, p.spec, p.line) for p in package_pins(pip_list, "table")]
    freeze = "-e git+https://github.com/OpenRLHF/OpenRLHF@0a1b2c#egg=openrlhf\nTransformers @ file:///w/t.whl\n"
    assert [(p.name, p.spec) for p in package_pins(freeze, "freeze")] == [("openrlhf", ""), ("transformers", "")]
    assert package_list_kind("notes.txt", "we trained for 3 days\nloss went down\n") is None


def test_shell_commands_continuations_and_variables():
    script = 'GPUS=4\nexport LR="1e-5"\ntorchrun --nproc_per_node $GPUS \\\n  train.py --lr ${LR} # comment\n'
    (command,) = shell_commands(script)
    # a word that is one variable keeps the line where the variable was set
    assert [(t.text, t.line) for t in command] == [("torchrun", 3), ("--nproc_per_node", 3), ("4", 1),
                                                   ("train.py", 4), ("--lr", 4), ("1e-5", 2)]
