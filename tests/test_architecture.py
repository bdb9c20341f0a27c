"""The structure DESIGN.md asks for, checked on the source: imports point down (algorithms ->
workers and generators -> engines -> losses/advantages), the task package never needs the
trainer, engines are found through a registry (each method's single declaration: tests/test_methods.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from exactrl.data.batch import SEQUENCE_FIELDS, TOKEN_FIELDS, Sample, collate
from exactrl.distributed.step_plan import plan_samples
from exactrl.registry import Registry

PACKAGE = Path(__file__).resolve().parents[1] / "exactrl"

# package -> packages it must never import (directly, at any depth of its modules)
FORBIDDEN = {
    "tasks": {"algorithms", "workers", "run", "pipelines", "distributed", "rollout"},
    "losses": {"algorithms", "workers", "run", "pipelines", "distributed", "rollout", "models"},
    "advantages": {"algorithms", "workers", "run", "pipelines", "distributed", "rollout", "models"},
    "distributed": {"algorithms", "workers", "run", "pipelines", "rollout"},
    "models": {"algorithms", "workers", "run", "pipelines", "rollout"},
    # the engines import checks/ (the canary): a check that drives the decoders lives in rollout/
    "checks": {"algorithms", "workers", "run", "pipelines", "audit", "distributed", "rollout"},
    "rollout": {"algorithms", "workers", "pipelines"},
    "workers": {"algorithms", "pipelines", "run"},
    "run": {"algorithms", "workers", "pipelines"},
    "algorithms": {"pipelines"},
    "data": {"algorithms", "workers", "run", "pipelines", "distributed", "rollout"},
    "config": {"algorithms", "workers", "run", "pipelines", "distributed", "rollout", "models"},
}


def imported_packages(path: Path) -> set[str]:
    """The exactrl sub-packages (or top-level modules) a module imports, lazily imported ones included."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "exactrl" and len(parts) > 1:
                out.add(parts[1])
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_down(package):
    wrong = {f"{path.relative_to(PACKAGE.parent)} imports exactrl.{p}"
             for path in (PACKAGE / package).rglob("*.py") for p in imported_packages(path) & FORBIDDEN[package]}
    assert not wrong, sorted(wrong)


def test_the_import_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from exactrl.algorithms.sft import train_sft\n")
    assert "algorithms" in imported_packages(bad)


def test_build_engine_imports_no_engine_subclass():
    """distributed.backend names an engine through ENGINES: DeepSpeed stays optional."""
    assert imported_packages(PACKAGE / "distributed" / "engine.py") <= {"checks", "config", "device", "distributed",
                                                                         "dtypes"}
    src = (PACKAGE / "distributed" / "engine.py").read_text()
    assert "import fsdp2" not in src and "deepspeed_engine import" not in src


def test_a_registry_refuses_a_name_twice():
    r = Registry("thing")
    r.add("a", 1)
    with pytest.raises(ValueError, match="thing 'a' is registered twice"):
        r.add("a", 2)


def test_the_typed_batch_refuses_undeclared_fields_and_collates_declared_ones():
    s = Sample([1, 2], [3, 4, 5], 1.0, advantages=torch.ones(4))
    with pytest.raises(AttributeError):
        s.advantage = torch.ones(4)  # a typo: not a declared field
    assert TOKEN_FIELDS == ("advantages", "old_logprobs", "gen_logprobs", "old_kept_logprobs", "ref_logprobs",
                            "old_values", "returns", "teacher_logprobs", "teacher_logits", "teacher_topk_logprobs",
                            "teacher_topk_ids", "step_labels")
    t = Sample([1], [3, 4], 0.0, source="demonstration", advantages=torch.tensor([2.0, 3.0]))
    b = collate([s, t], pad_id=0)
    assert SEQUENCE_FIELDS == ("reward", "finished", "penalty", "margin", "kto_z")  # declared as per-token
    # only fields every sample holds
    assert set(b) == {"input_ids", "attention_mask", "loss_mask", "origin", "advantages", *SEQUENCE_FIELDS}
    assert b["origin"].tolist() == [[0, 0, 0, 0], [1, 1, 0, 0]]  # each row's source's origin: policy, demonstration
    assert b["advantages"].tolist() == [[1.0, 1.0, 1.0, 1.0], [2.0, 3.0, 0.0, 0.0]]
    assert b["loss_mask"].tolist() == [[0, 1, 1, 1], [1, 1, 0, 0]]
    assert b["reward"].tolist() == [1.0, 0.0]
    assert t.source == "demonstration" and s.source == "on_policy"


def test_the_one_loss_mask_is_what_the_plan_counts_and_collate_pads():
    s = Sample([1, 2], [3, 4, 5])  # default: every response target
    t = Sample([], [1, 2, 3, 4], source="demonstration", mask=(0, 1, 0))  # a mask of its own (SFT's)
    plan = plan_samples([s, t], 1, "token-mean")
    assert [c.tokens for c in plan.counts] == [3, 1] and plan.normalizer.num_tokens == 4
    assert collate([s, t], 0)["loss_mask"].tolist() == [list(s.loss_mask), [0, 1, 0, 0]]


def test_collate_refuses_a_per_token_field_set_on_only_some_samples():
    """Before: collate dropped the field, and the loss read the missing old_logprobs as the
    forward's own (ratio 1) for the whole micro-batch, without a word."""
    s = Sample([1, 2], [3, 4, 5], old_logprobs=torch.zeros(4))
    t = Sample([1, 2], [3, 4])
    with pytest.raises(ValueError, match=r"per-token field 'old_logprobs' is set on 1 of the 2 samples .*rows \[1\]"):
        collate([s, t], 0)


def test_an_algorithms_own_section_and_its_old_flat_keys(tmp_path):
    from exactrl.config import ConfigError, DemoConfig, RLConfig, load_config

    old = tmp_path / "old.yaml"  # a config (or checkpoint) written before algo.gae / algo.dapo existed
    old.write_text("algo:\n  name: ppo\n  lam: 0.8\n  whiten_advantages: false\n")
    with pytest.warns(FutureWarning, match="'algo.lam' is now 'algo.gae.lam'"):
        cfg = load_config(RLConfig, old)
    assert (cfg.algo.gae.lam, cfg.algo.gae.whiten_advantages) == (0.8, False)
    with pytest.warns(FutureWarning, match="'algo.max_refill_rounds' is now 'algo.dapo.max_refill_rounds'"):
        cfg = load_config(DemoConfig, None, ["rl.algo.name=dapo", "rl.algo.max_refill_rounds=4"])
    assert cfg.rl.algo.dapo.max_refill_rounds == 4
    assert load_config(RLConfig, None, ["algo.name=ppo", "algo.gae.lam=0.5"]).algo.gae.lam == 0.5
    with pytest.raises(ConfigError, match=r"algo.gae.lam=0.5 has no effect: only ppo .*\(algo.name=grpo\)"):
        load_config(RLConfig, None, ["algo.name=grpo", "algo.gae.lam=0.5"])
    with pytest.raises(ConfigError, match=r"algo.dapo.max_refill_rounds=2 has no effect: .*dapo's \(algo.name=ppo\)"):
        load_config(RLConfig, None, ["algo.name=ppo", "algo.dapo.max_refill_rounds=2"])


def module_imports(path: Path) -> set[str]:
    """The exactrl modules a module imports (``from exactrl.x import y`` names module x.y when y is one)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("exactrl") and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if (PACKAGE.parent / (sub.replace(".", "/") + ".py")).is_file() else node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("exactrl.")}
    return out


def test_no_two_modules_import_each_other():
    """Not even lazily: a cycle means two modules that are one, or one that sits on the wrong floor."""
    graph = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts): module_imports(p)
             for p in PACKAGE.rglob("*.py")}
    graph = {k.removesuffix(".__init__"): v for k, v in graph.items()}
    cycles, done = [], set()

    def visit(node, stack):
        if node in stack:
            cycles.append(stack[stack.index(node):] + [node])
            return
        if node in done or node not in graph:
            return
        for nxt in graph[node]:
            visit(nxt, stack + [node])
        done.add(node)

    for node in graph:
        visit(node, [])
    assert not cycles, cycles[:3]
