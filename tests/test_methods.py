"""Each method is declared once (exactrl/config/methods.py): no other file lists method names by
hand, the registry takes its facts from the rows, and the facts the rows derive from an estimator's
name are what the estimators do."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from exactrl.advantages.estimators import ADVANTAGES, AdvantageInput
from exactrl.algorithms.registry import ALGORITHMS
from exactrl.config import RLConfig, SFTConfig, load_config
from exactrl.config.aggregation import norm_len
from exactrl.config.methods import DISCOUNT_ESTIMATORS, METHODS, STD_ESTIMATORS, names
from exactrl.config.schema_rl import AlgoConfig
from exactrl.losses.policy import POLICY_LOSSES

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("exactrl", "tests", "scripts", "benchmarks")
DECLARATION = Path("exactrl/config/methods.py")
# Lists of method names that are not a method's declaration, each with its reason: (file, the name the
# literal is assigned to).
ALLOWED = {
    ("exactrl/config/schema_study.py", "PAPER_GRID"): "the seed paper's table 2, in its order (a study's grid)",
    ("tests/test_ray.py", "ALGOS"): "per-method settings of a Ray run (ppo's critic keys)",
    ("tests/test_rl_layout.py", "ALGOS"): "per-method settings (each one's reward, dapo's refills, prefix_rft's "
                                          "prefixed prompts)",
    ("tests/test_rl_reward_model.py", "ALGOS"): "the two paths a reward is scored on (a plain rollout, DAPO's refills)",
    ("tests/dist/rl_reward_model.py", "ALGOS"): "the two paths a reward is scored on (a plain rollout, DAPO's refills)",
}


def _owner(node: ast.AST, parents: dict) -> str:
    """The name a literal is assigned to (or the function it sits in)."""
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            return node.targets[0].id
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            return node.name
    return ""


def _a_list_of_methods(found: list[str]) -> bool:
    """Names that are all advantage estimators' or all policy losses' (some are methods' too) name those."""
    return not (set(found) <= set(ADVANTAGES) or set(found) <= set(POLICY_LOSSES))


def hand_written_method_lists(path: Path, rel: str) -> list[str]:
    """A literal list, tuple, set or dict's keys of 2+ method names, a string naming 3+, an ``in`` test or
    an ==/!= of some ``.name`` against a method's name."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    out = []

    def strings(nodes):
        return [n.value for n in nodes if isinstance(n, ast.Constant) and n.value in METHODS]

    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple, ast.Set, ast.Dict)):
            found = strings(node.keys if isinstance(node, ast.Dict) else node.elts)
            if len(found) >= 2 and _a_list_of_methods(found) and (rel, _owner(node, parents)) not in ALLOWED:
                out.append(f"{rel}:{node.lineno}: {', '.join(found)}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found = sorted(set(re.findall(r"\w+", node.value)) & set(METHODS))
            if len(found) >= 3 and _a_list_of_methods(found):
                out.append(f"{rel}:{node.lineno}: a text listing {', '.join(found)}")
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            on_name = any(isinstance(s, ast.Attribute) and s.attr == "name" for s in sides)
            named = strings(sides) + [n for s in sides if isinstance(s, (ast.Tuple, ast.List, ast.Set))
                                      for n in strings(s.elts)]
            if on_name and named:
                out.append(f"{rel}:{node.lineno}: compares a .name with {', '.join(named)}")
    return out


def test_no_hand_written_list_of_method_names():
    """Any list of methods is a query on METHODS (``names(hinted=True)``), so a new method joins every one."""
    found = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel != DECLARATION:
                found += hand_written_method_lists(path, rel.as_posix())
    assert not found, "\n".join(found)


def test_the_rule_finds_each_kind_of_hand_written_list(tmp_path):
    luffy = "luffy"  # one name at a time: a tuple of them here would be the list the rule refuses
    srft = "srft"
    dapo = "dapo"
    ppo = "ppo"
    grpo = "grpo"
    bad = tmp_path / "bad.py"
    bad.write_text(f'GROUPED = ("{luffy}", "{srft}")\n'
                   f'OWN = {{"{dapo}": 1, "{luffy}": 2}}\n'
                   f'HELP = "{ppo}, {grpo} and {dapo}"\n'
                   'def f(c):\n'
                   f'    return c.algo.name == "{srft}" or c.algo.name in ("{luffy}",)\n'
                   f'ESTIMATORS = ("{grpo}", "gae")\n'  # names of estimators, not of methods
                   f'LOSSES = ("{ppo}", "reinforce")\n')
    found = hand_written_method_lists(bad, "bad.py")
    assert [f.split(":")[1] for f in found] == ["1", "2", "3", "5", "5"], found


def test_the_registry_takes_every_fact_from_the_rows():
    assert list(ALGORITHMS) == list(METHODS)
    for name, algorithm in ALGORITHMS.items():
        m = METHODS[name]
        assert algorithm.method is m
        assert (algorithm.advantage, algorithm.policy_loss, algorithm.critic, algorithm.loss_agg) == (
            m.advantage, m.policy_loss, m.critic, m.loss_agg)
        assert m.advantage in ADVANTAGES and m.policy_loss in POLICY_LOSSES, name
        assert m.config is None or m.config in AlgoConfig.model_fields, name
        assert bool(m.config) == bool(m.section_refusal), name  # a section's keys are refused in its words
    # every method's name is algo.name's choice; the critic is GAE's (its section algo.gae)
    assert AlgoConfig.model_fields["name"].annotation.__args__ == tuple(METHODS)
    assert names(critic=True) == names(config="gae")


def _advantages(name: str, **kw) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(8, 5, dtype=torch.float64)
    mask[:, 0] = 0
    x = AdvantageInput(torch.rand(8, generator=g, dtype=torch.float64), mask, group_size=4,
                       values=torch.rand(8, 5, generator=g, dtype=torch.float64), lam=0.9, **kw)
    return ADVANTAGES[name](x)[0]


def test_what_the_rows_say_an_estimator_reads_is_what_it_reads():
    """algo.std_normalize and algo.gamma are refused where they do nothing (config/used.py) from the rows'
    std_normalize and discount, which come from the estimator's name: each estimator, run, must agree."""
    reads_std = {n for n in ADVANTAGES if not torch.equal(_advantages(n, std_normalize=True),
                                                          _advantages(n, std_normalize=False))}
    reads_gamma = {n for n in ADVANTAGES if not torch.equal(_advantages(n, gamma=1.0), _advantages(n, gamma=0.8))}
    assert reads_std == set(STD_ESTIMATORS)
    assert reads_gamma == set(DISCOUNT_ESTIMATORS)


def test_the_aggregation_normaliser_falls_back_to_the_runs_length_limit():
    assert norm_len(load_config(RLConfig, None, ["rollout.max_new_tokens=37"])) == 37
    assert norm_len(load_config(RLConfig, None, ["train.loss_agg=seq-mean-token-sum-norm",
                                                 "train.loss_agg_norm=5"])) == 5
    assert norm_len(load_config(SFTConfig, None, ["data.max_length=99"])) == 99
    cfg = load_config(RLConfig, None, ["algo.name=prefix_rft", "rollout.max_new_tokens=21"])
    assert {t.norm_len for t in ALGORITHMS.lookup("prefix_rft").objective(cfg).terms if hasattr(t, "norm_len")} \
        == {21}


def test_the_aggregation_fallback_is_written_once():
    """``train.loss_agg_norm or <a length>`` only in exactrl/config/aggregation.py."""
    found = []
    for path in sorted((ROOT / "exactrl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and any(
                    isinstance(v, ast.Attribute) and v.attr == "loss_agg_norm" for v in node.values):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found


@pytest.mark.parametrize("name", names(demonstrations=True))
def test_a_mixed_policy_method_is_its_own_family(name):
    assert METHODS[name].family == "mixed-policy" and METHODS["grpo"].family == "policy-gradient"


@pytest.mark.parametrize("name", list(METHODS))
def test_each_method_has_its_row_on_its_family_page(name):
    """The docs row a new method adds (docs/algorithms/<family>.md) exists on the page its row's family
    names, and cites the row's paper as the row states it: the docs cannot drift from the declaration."""
    m = METHODS[name]
    page = ROOT / "docs" / "algorithms" / f"{m.family}.md"
    rows = [line for line in page.read_text().splitlines() if line.startswith(f"| `{name}` |")]
    assert rows, f"{page.relative_to(ROOT)} has no table row for {name} (its family: {m.family})"
    assert any(m.paper in row for row in rows), f"{page.relative_to(ROOT)}: {name}'s row does not cite '{m.paper}'"
