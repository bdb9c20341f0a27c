"""The calculator task: its tool episodes show the tool's true result and the right final answer, its one-turn rows
are the addition teacher's, the die calls the tool at its stated rate, the tool module offers one described tool
that refuses anything but + - * of integers, and the build writes chat rows under a key of its own."""

from __future__ import annotations

import json
import random

import pytest
from transformers.utils import get_json_schema

from exactrl.data.encode import encode_prompts, encode_sft
from exactrl.data.jsonl import Row
from exactrl.tasks import arithmetic, calculator, calculator_tools
from exactrl.tasks.arithmetic import Problem, is_correct
from exactrl.tasks.builtin import BuiltinSpec, ensure_builtin
from exactrl.tasks.calculator_tools import calc

CALL = '<tool_call>{"name": "calc", "arguments": {"expr": "347+285"}}</tool_call>'


def test_the_docstrings_episode():
    p = Problem(347, 285)
    assert calculator.tool_call(p) == CALL
    rows = calculator.sft_rows([p] * 40, 0.5, 0.75, seed=0)
    tool = next(r for r in rows if len(r["messages"]) == 4)
    assert tool["messages"] == [{"role": "user", "content": "347+285="}, {"role": "assistant", "content": CALL},
                                {"role": "tool", "content": "632"}, {"role": "assistant", "content": "#### 0632"}]


def test_tool_episodes_show_the_tools_result_and_end_with_the_sum():
    problems = arithmetic.generate("train", 4000, seed=1)
    rows = calculator.sft_rows(problems, 0.5, 0.75, seed=1)
    one_turn = arithmetic.sft_rows(problems, 0.5, 0.75, seed=1)
    tools = 0
    for p, r, plain in zip(problems, rows, one_turn):
        m = r["messages"]
        assert m[0] == {"role": "user", "content": f"{p.a}+{p.b}="}
        if len(m) == 4:
            tools += 1
            call = json.loads(m[1]["content"].removeprefix("<tool_call>").removesuffix("</tool_call>"))
            assert call == {"name": "calc", "arguments": {"expr": f"{p.a}+{p.b}"}}
            assert m[2] == {"role": "tool", "content": calc(**call["arguments"])} and int(m[2]["content"]) == p.a + p.b
            assert m[3]["role"] == "assistant" and is_correct(m[3]["content"], str(p.a + p.b))
        else:  # the addition teacher's own turn, draw for draw
            assert m[1:] == [{"role": "assistant", "content": plain["completion"]}]
    assert tools / len(problems) == pytest.approx(calculator.TOOL_FRACTION, abs=0.025)


def test_the_tool_module_offers_only_calc_described():
    public = [n for n in dir(calculator_tools) if not n.startswith("_")]
    assert public == ["calc"] and calculator_tools.__all__ == ["calc"]
    fn = get_json_schema(calc)["function"]
    assert fn["name"] == "calc" and fn["parameters"]["required"] == ["expr"]
    assert fn["parameters"]["properties"]["expr"]["type"] == "string" and fn["parameters"]["properties"]["expr"][
        "description"]


def test_calc_evaluates_integer_arithmetic_with_precedence():
    rng = random.Random(0)
    for _ in range(500):  # against Python's own arithmetic on expressions written here
        nums = [rng.randint(0, 10**rng.randint(1, 5)) for _ in range(rng.randint(1, 5))]
        ops = [rng.choice("+-*") for _ in nums[1:]]
        expr = str(nums[0]) + "".join(f"{o}{n}" for o, n in zip(ops, nums[1:]))
        terms, signs = [nums[0]], [1]  # * first: fold products, then sum them signed
        for o, n in zip(ops, nums[1:]):
            if o == "*":
                terms[-1] *= n
            else:
                terms.append(n)
                signs.append(1 if o == "+" else -1)
        value = sum(s * t for s, t in zip(signs, terms))
        assert calc(expr) == str(value), expr
    assert calc(" 12 * 3 - 4 ") == "32" and calc("7") == "7" and calc("2-10") == "-8"


@pytest.mark.parametrize("expr, fragment", [
    ("__import__('os')", "only integers"), ("2**10", "expected a number"), ("3/4", "only integers"),
    ("1+", "ends with an operator"), ("", "empty"), ("3 4", "expected an operator"), ("-3", "expected a number"),
    ("1.5+2", "only integers"), ("9" * 201, "at most 200"), (12, "must be a string"),
])
def test_calc_refuses_anything_else(expr, fragment):
    with pytest.raises(ValueError, match="calc: ") as e:
        calc(expr)
    assert fragment in str(e.value)


def test_the_build_writes_chat_rows_under_its_own_key(tmp_path, tokenizer):
    spec = BuiltinSpec(name="calculator", n_sft=300, n_rl=20, n_eval=10)
    assert spec.key() == "calc-seed0-digits3-direct_fraction0.5-skip_prob0.75-n_sft300-n_rl20-n_eval10"
    assert BuiltinSpec(n_sft=300, n_rl=20, n_eval=10).key() == "arith" + spec.key().removeprefix("calc")
    with pytest.raises(ValueError, match="calculator task has none"):
        BuiltinSpec(name="calculator", slip_prob=0.5)
    paths = ensure_builtin(spec, cache=tmp_path)
    read = lambda path: [json.loads(line) for line in open(path)]  # noqa: E731
    sft, rl, held, mixed = read(paths.sft_train), read(paths.rl_train), read(paths.eval), read(paths.mixed_train)
    # the addition task's problems, split the same way
    addition = ensure_builtin(BuiltinSpec(n_sft=300, n_rl=20, n_eval=10), cache=tmp_path)
    assert [r["messages"][0]["content"] for r in sft] == [json.loads(line)["prompt"] for line in open(
        addition.sft_train)]
    plain = read(addition.rl_train) + read(addition.eval)
    assert [(r["prompt"], r["answer"]) for r in rl + held] == [([{"role": "user", "content": r["prompt"]}], r["answer"])
                                                               for r in plain]
    assert [(r["prompt"], r["demonstration"]) for r in mixed] == [(r["messages"][:1], r["messages"][1]["content"])
                                                                 for r in sft if len(r["messages"]) == 2]
    # every row loads: a tool episode fits the tiny model's context, a held-out prompt opens an assistant turn
    examples = encode_sft([Row(f"sft:{i}", r) for i, r in enumerate(sft)], tokenizer, max_length=128)
    longest = max(len(e.input_ids) for e in examples)
    assert longest <= 110 and json.loads((paths.model / "config.json").read_text())["max_position_embeddings"] >= 256
    prompt = encode_prompts([Row("eval:1", held[0])], tokenizer, max_length=64)[0]
    assert prompt.text == f"<|user|>{held[0]['prompt'][0]['content']}<|assistant|>"
