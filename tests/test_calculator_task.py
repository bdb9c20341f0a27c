"""The calculator task: its problems are 3-digit x 2-digit products, split disjointly; its tool episodes show the
tool's true result and the product, its one-turn rows the product alone, the die calls the tool at its stated rate
blind to the problem; a tool episode fits the agent example's budgets; the tool module offers one described tool that
refuses anything but + - * of integers; and the build writes chat rows under a key of its own."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml
from transformers.utils import get_json_schema

from exactrl.config.schema_task import TaskConfig
from exactrl.data.encode import encode_prompts, encode_sft
from exactrl.data.jsonl import Row
from exactrl.tasks import arithmetic, calculator, calculator_tools
from exactrl.tasks.builtin import BuiltinSpec, ensure_builtin
from exactrl.tasks.calculator_tools import calc
from exactrl.tasks.multiplication import Problem

ROOT = Path(__file__).resolve().parents[1]
CALL = '<tool_call>{"name": "calc", "arguments": {"expr": "347*28"}}</tool_call>'


def test_the_docstrings_episode():
    p = Problem(347, 28)
    assert calculator.tool_call(p) == CALL
    rows = calculator.sft_rows([p] * 40, seed=0)
    tool = next(r for r in rows if len(r["messages"]) == 4)
    assert tool["messages"] == [{"role": "user", "content": "347*28="}, {"role": "assistant", "content": CALL},
                                {"role": "tool", "content": "9716"}, {"role": "assistant", "content": "#### 9716"}]
    assert next(r for r in rows if len(r["messages"]) == 2)["messages"][1:] == [
        {"role": "assistant", "content": "#### 9716"}]


def test_problems_are_three_by_two_digit_products_split_disjointly():
    train, held = calculator.generate("train", 20000, seed=3), calculator.generate("eval", 2000, seed=3)
    assert train == calculator.generate("train", 20000, seed=3) != calculator.generate("train", 20000, seed=4)
    for p in train + held:
        assert 100 <= p.a <= 999 and 10 <= p.b <= 99 and p.prompt == f"{p.a}*{p.b}=" and int(p.answer) == p.a * p.b
    assert len(set(train)) == len(train) and len(set(held)) == len(held) and not set(train) & set(held)
    assert len({p.b for p in train}) == 90  # every two-digit multiplier occurs
    with pytest.raises(ValueError, match="2-digit multiplication has only"):
        calculator.generate("eval", 8000, seed=0)


def test_tool_episodes_show_the_tools_result_and_end_with_the_product():
    problems = calculator.generate("train", 4000, seed=1)
    rows = calculator.sft_rows(problems, seed=1)
    die = random.Random("1-calc-tool")  # the die, drawn here: one draw a problem, whatever the problem
    tools = 0
    for p, r in zip(problems, rows):
        m = r["messages"]
        assert m[0] == {"role": "user", "content": f"{p.a}*{p.b}="}
        assert len(m) == (4 if die.random() < calculator.TOOL_FRACTION else 2)
        if len(m) == 4:
            tools += 1
            call = json.loads(m[1]["content"].removeprefix("<tool_call>").removesuffix("</tool_call>"))
            assert call == {"name": "calc", "arguments": {"expr": f"{p.a}*{p.b}"}}
            assert m[2] == {"role": "tool", "content": calc(**call["arguments"])} and int(m[2]["content"]) == p.a * p.b
        # the final turn is the product, which the task's verifier reads, and a wrong product it does not
        assert m[-1]["role"] == "assistant" and m[-1]["content"] == f"#### {p.a * p.b}"
        assert arithmetic.reward([p.prompt] * 2, [m[-1]["content"], f"#### {p.a * p.b + 1}"],
                                 [p.answer] * 2) == [1.0, 0.0]
    assert tools / len(problems) == pytest.approx(calculator.TOOL_FRACTION, abs=0.025)
    other = calculator.sft_rows(problems[::-1], seed=1)  # blind to the problem: the same turns at the same places
    assert [len(r["messages"]) for r in other] == [len(r["messages"]) for r in rows]


def test_a_tool_episode_fits_the_agent_examples_budgets(tokenizer):
    """The longest episode (the largest product) against the tiny model's context and examples/agent_tools.yaml's
    per-turn and per-episode budgets, counted in the built-in tokenizer's tokens as the environment counts them:
    after the prompt, the policy's turns with their <eos>, the observation and the template's tokens."""
    example = yaml.safe_load(open(ROOT / "examples" / "agent_tools.yaml"))
    p = Problem(999, 99)
    episode = calculator.sft_rows([p] * 10, seed=0)[next(i for i, t in enumerate(calculator.calls_tool([p] * 10, 0))
                                                         if t)]["messages"]
    render = lambda messages, **kw: tokenizer.apply_chat_template(messages, tokenize=False, **kw)  # noqa: E731
    prompt = len(tokenizer(render(episode[:1], add_generation_prompt=True), add_special_tokens=False).input_ids)
    whole = len(tokenizer(render(episode), add_special_tokens=False).input_ids)
    turn = max(len(tokenizer(m["content"], add_special_tokens=False).input_ids) + 1 for m in episode[1::2])
    assert turn == 73 and whole - prompt == 98 and whole == 107
    assert turn <= min(example["rollout"]["max_new_tokens"], example["eval"]["max_new_tokens"])
    assert whole - prompt <= example["env"]["max_tokens"] and example["env"]["max_turns"] >= 2
    assert whole <= 256  # the tiny model's max_position_embeddings (checked on the built model below)


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
    # the operation is in the key: the first calculator task's cached files (addition, "calc-seed0-...") are not read
    assert spec.key() == "calc-mul-seed0-digits3-n_sft300-n_rl20-n_eval10"
    assert BuiltinSpec(n_sft=300, n_rl=20, n_eval=10).key() == (
        "arith-seed0-digits3-direct_fraction0.5-skip_prob0.75-n_sft300-n_rl20-n_eval10")
    with pytest.raises(ValueError, match="calculator task has none"):
        BuiltinSpec(name="calculator", slip_prob=0.5)
    with pytest.raises(ValueError, match="calculator task's teacher has none"):
        BuiltinSpec(name="calculator", skip_prob=0.5)
    with pytest.raises(ValueError, match=r"task.direct_fraction=0.2: the calculator task's teacher has no habit"):
        TaskConfig(name="calculator", direct_fraction=0.2)
    paths = ensure_builtin(spec, cache=tmp_path)
    read = lambda path: [json.loads(line) for line in open(path)]  # noqa: E731
    sft, rl, held, mixed = read(paths.sft_train), read(paths.rl_train), read(paths.eval), read(paths.mixed_train)
    train = calculator.generate("train", 320, seed=0)
    assert sft == calculator.sft_rows(train[:300], seed=0)
    assert [(r["prompt"], r["answer"]) for r in rl + held] == [
        ([{"role": "user", "content": f"{p.a}*{p.b}="}], str(p.a * p.b))
        for p in train[300:] + calculator.generate("eval", 10, seed=0)]
    assert [(r["prompt"], r["demonstration"]) for r in mixed] == [(r["messages"][:1], r["messages"][1]["content"])
                                                                 for r in sft if len(r["messages"]) == 2]
    assert [r["messages"][0] for r in read(paths.pretrain)] == [r["prompt"][0] for r in rl]
    # every row loads: a tool episode fits the tiny model's context, a held-out prompt opens an assistant turn
    examples = encode_sft([Row(f"sft:{i}", r) for i, r in enumerate(sft)], tokenizer, max_length=128)
    longest = max(len(e.input_ids) for e in examples)
    assert longest <= 110 and json.loads((paths.model / "config.json").read_text())["max_position_embeddings"] >= 256
    prompt = encode_prompts([Row("eval:1", held[0])], tokenizer, max_length=64)[0]
    assert prompt.text == f"<|user|>{held[0]['prompt'][0]['content']}<|assistant|>"
