"""The multiplication task: worked solutions checked digit by digit against integer arithmetic, the
teacher's two flaws at their stated rates, disjoint splits, the cached build (with the mixed file
holding exactly the SFT rows), and the addition task's cache key left as it was."""

from __future__ import annotations

import json
import re

import pytest

from exactrl.config import DemoConfig, load_config
from exactrl.config.loader import ConfigError
from exactrl.tasks.arithmetic import reward
from exactrl.tasks.builtin import BuiltinSpec, ensure_builtin
from exactrl.tasks.multiplication import SLIP_CARRY, Problem, carries, demonstrations, generate, worked_solution

STEP_RE = re.compile(r"(\d)\*(\d)\+(\d)=(\d\d)")


def steps_of(text: str) -> tuple[list[tuple[int, ...]], int]:
    body, answer = text.split(" #### ")
    return [tuple(map(int, STEP_RE.fullmatch(s).groups())) for s in body.split(" ")], int(answer)


def test_the_docstrings_example():
    assert worked_solution(Problem(4736, 7)) == "6*7+0=42 3*7+4=25 7*7+2=51 4*7+5=33 #### 33152"


def test_worked_solutions_multiply_digit_by_digit_and_are_verified():
    problems = generate("train", 3000, 1)
    for p in problems:
        steps, answer = steps_of(worked_solution(p))
        carry = 0
        for i, (d, b, c, s) in enumerate(steps):
            assert (d, b, c) == ((p.a // 10**i) % 10, p.b, carry) and s == d * b + c
            carry = s // 10
        assert answer == p.a * p.b  # independent of the steps' own answer assembly
    assert reward([p.prompt for p in problems], [worked_solution(p) for p in problems],
                  [p.answer for p in problems]) == [1.0] * len(problems)


def test_a_slip_forgets_one_carry_and_carries_on_consistently():
    p = Problem(4736, 7)
    steps, answer = steps_of(worked_solution(p, frozenset({1})))
    assert steps[1] == (3, 7, 0, 21) and all(s == d * b + c for d, b, c, s in steps)
    assert answer == 33112 != p.a * p.b  # 4736*7 computed with the tens step's carry of 4 dropped


def test_the_teachers_flaws_come_at_their_rates():
    problems = generate("train", 20000, 0)
    shown = demonstrations(problems, direct_fraction=0.5, skip_prob=0.75, slip_prob=0.6, seed=0)
    habit = [p.a % 10 < 5 for p in problems]
    direct = [s.startswith("####") for s in shown]
    assert not any(d for d, h in zip(direct, habit) if not h)
    assert sum(direct) / sum(habit) == pytest.approx(0.75, abs=0.02)
    big = forgot = 0
    for p, s, d in zip(problems, shown, direct):
        if d:
            assert int(s.split("#### ")[1]) == p.a * p.b  # a skipped working still writes the right answer
            continue
        for (_, _, c, _), true_carry in zip(steps_of(s)[0], carries(p)):
            if true_carry >= SLIP_CARRY:
                big, forgot = big + 1, forgot + (c == 0)
            if c != true_carry:  # after a slip the teacher's carries are its own
                break
    assert forgot / big == pytest.approx(0.6, abs=0.03)
    assert demonstrations(problems[:50], 0.5, 0.75, 0.0, 0) == [
        worked_solution(p) if not d else s for p, s, d in zip(problems, shown, direct)][:50]


def test_splits_are_disjoint_and_deterministic():
    train, held = generate("train", 5000, 0), generate("eval", 500, 0)
    assert not set(train) & set(held) and train == generate("train", 5000, 0)
    with pytest.raises(ValueError, match="has only"):
        generate("eval", 800, 0, digits=2)


def test_the_build_writes_the_task_and_its_mixed_file(tmp_path):
    spec = BuiltinSpec(name="multiplication", n_sft=40, n_rl=20, n_eval=10)
    assert (spec.digits, spec.slip_prob) == (4, 0.6) and spec.key().startswith("mul-seed0-digits4")
    paths = ensure_builtin(spec, cache=tmp_path)
    sft = [json.loads(line) for line in open(paths.sft_train)]
    mixed = [json.loads(line) for line in open(paths.mixed_train)]
    assert len(sft) == 40 and [(r["prompt"], r["demonstration"]) for r in mixed] == [(r["prompt"], r["completion"])
                                                                                   for r in sft]
    assert all(int(r["answer"]) == int(r["prompt"][:-1].split("*")[0]) * int(r["prompt"][-2]) for r in mixed)
    pretrain = [json.loads(line) for line in open(paths.pretrain)]  # the RL problems, every carry forgotten
    assert [r["prompt"] for r in pretrain] == [json.loads(line)["prompt"] for line in open(paths.rl_train)]
    assert all("+0=" in step for r in pretrain for step in r["completion"].split(" #### ")[0].split())
    held = {json.loads(line)["prompt"] for line in open(paths.eval)}
    trained = {r["prompt"] for r in sft} | {json.loads(line)["prompt"] for line in open(paths.rl_train)}
    assert len(held) == 10 and not held & trained


def test_the_addition_tasks_cache_key_is_unchanged():
    assert BuiltinSpec().key() == "arith-seed0-digits3-direct_fraction0.5-skip_prob0.75-n_sft20000-n_rl20000-n_eval2000"


def test_slips_belong_to_multiplication():
    with pytest.raises(ConfigError, match="task.slip_prob=0.3 is the multiplication teacher's"):
        load_config(DemoConfig, None, ["task.slip_prob=0.3"])
    assert BuiltinSpec(**load_config(DemoConfig, None, ["task.name=multiplication"]).task.model_dump()).digits == 4


def test_the_demo_runs_the_multiplication_task(tmp_path):
    from test_cli_failures import exactrl

    out = tmp_path / "demo"
    proc = exactrl(["demo", "task.name=multiplication", f"output_dir={out}", "task.n_sft=128", "task.n_rl=32",
                    "task.n_eval=8", "sft.train.max_steps=1", "sft.data.eval_size=8", "rl.train.max_steps=1",
                    "rl.data.eval_size=8", "rl.train.global_batch_size=16", "rl.train.micro_batch_size=8"],
                   tmp_path, tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "built-in task: 4-digit multiplication, 128 SFT demonstrations" in proc.stderr
    assert "mul-seed0-digits4" in json.loads((out / "manifest.json").read_text())["task"]
    assert "Task: 4-digit multiplication (built-in), 8 held-out problems." in (out / "report.md").read_text()
