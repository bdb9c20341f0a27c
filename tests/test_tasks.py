"""The built-in task: arithmetic solutions and verifier, the tokenizer and tiny model through
save_pretrained / from_pretrained, and the cached on-disk build."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from exactrl.tasks import arithmetic, builtin
from exactrl.tasks.arithmetic import Problem, extract_answer, is_correct, reward, worked_solution
from exactrl.tasks.builtin import BuiltinSpec, ensure_builtin
from exactrl.tasks.tiny_model import SIZES, build_tiny_model, parameters, save_tiny_model
from exactrl.tasks.tokenizer import CHARS

STEP_RE = re.compile(r"(\d)\+(\d)\+(\d)=(\d\d)")

# ---------------------------------------------------------------- arithmetic


def test_worked_solution_example_from_the_docstring():
    assert worked_solution(Problem(347, 285)) == "7+5+0=12 4+8+1=13 3+2+1=06 #### 0632"


def test_worked_solution_is_correct_column_addition():
    rng = random.Random(0)
    for _ in range(500):
        a, b = rng.randint(0, 10 ** rng.randint(1, 6)), rng.randint(0, 10 ** rng.randint(1, 6))
        text = worked_solution(Problem(a, b))
        body, answer = text.split(" #### ")
        steps = [STEP_RE.fullmatch(s).groups() for s in body.split(" ")]
        width = max(len(str(a)), len(str(b)))
        assert len(steps) == width
        carry, digits = 0, []
        for i, (x, y, c, s) in enumerate(steps):
            assert int(x) == (a // 10**i) % 10 and int(y) == (b // 10**i) % 10 and int(c) == carry
            assert int(s) == int(x) + int(y) + carry
            carry, digits = int(s) // 10, digits + [int(s) % 10]
        # The answer is the column digits read back, and it is the sum, width + 1 digits wide.
        assert answer == "".join(map(str, [carry] + digits[::-1]))
        assert int(answer) == a + b and len(answer) == width + 1
        assert is_correct(text, str(a + b)) and not is_correct(text, str(a + b + 1))


@pytest.mark.parametrize("text,expected", [
    ("#### 15", "15"),
    ("2+3+0=05 1+0+0=01 #### 015", "015"),
    ("#### 15  \n", "15"),  # trailing whitespace is fine
    ("####15", "15"),
    ("#### -3", "-3"),
    ("#### 1 #### 2", "2"),  # the last one counts
    ("#### 15 because", None),  # trailing text breaks the format
    ("15", None),  # no ####
    ("### 15", None),
    ("#### ", None),
    ("#### 1.5", None),
    ("", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_is_correct_and_reward():
    assert is_correct("#### 0632", "632") and is_correct("#### 632", "0632")
    assert not is_correct("#### 633", "632")
    assert not is_correct("632", "632")  # missing ####
    assert not is_correct("#### 632 done", "632")  # trailing text
    assert reward(["a", "b", "c", "d"], ["#### 632", "#### 631", "632", "x #### 0632"], ["632"] * 4) == [
        1.0, 0.0, 0.0, 1.0]


def test_generate_is_deterministic_and_splits_are_disjoint():
    train = arithmetic.generate("train", 2000, seed=3)
    assert train == arithmetic.generate("train", 2000, seed=3)
    assert train != arithmetic.generate("train", 2000, seed=4)
    assert arithmetic.generate("train", 100, seed=3) == train[:100]  # a prefix of the longer stream
    eval_ = arithmetic.generate("eval", 500, seed=3)
    assert len(set(train)) == 2000 and len(set(eval_)) == 500
    assert not set(train) & set(eval_)
    # Disjoint across seeds too: a problem's split is a function of the problem.
    assert not set(arithmetic.generate("eval", 500, seed=9)) & set(train)
    assert all(100 <= p.a <= 999 and 100 <= p.b <= 999 for p in train + eval_)


def test_generate_rejects_bad_requests():
    with pytest.raises(ValueError, match="split must be"):
        arithmetic.generate("test", 10, seed=0)
    with pytest.raises(ValueError, match="only"):
        arithmetic.generate("eval", 10, seed=0, digits=1)


def test_teacher_habit():
    problems = arithmetic.generate("train", 2000, seed=0)
    rows = arithmetic.sft_rows(problems, direct_fraction=0.5, skip_prob=0.75, seed=0)
    assert [r["prompt"] for r in rows] == [p.prompt for p in problems]
    habit = [r["completion"].startswith("####") for p, r in zip(problems, rows) if p.a % 10 < 5]
    others = [r["completion"].startswith("####") for p, r in zip(problems, rows) if p.a % 10 >= 5]
    assert not any(others)  # outside the habit the teacher always works it out
    assert 0.70 < sum(habit) / len(habit) < 0.80  # ~skip_prob, 1000 draws
    assert all(is_correct(r["completion"], p.answer) for p, r in zip(problems, rows))


# ---------------------------------------------------------------- tokenizer


TEXTS = ["347+285=7+5+0=12 4+8+1=13 #### 0632", "Hello, World! (a*b)/c^2 = {x}", "two  spaces\nnew line",
         "<|user|>1+1=<|assistant|>#### 2<eos>", ""]


def test_tokenizer_round_trip_through_save_pretrained(tmp_path, tokenizer):
    tokenizer.save_pretrained(str(tmp_path))
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(loaded) == len(tokenizer)
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (
        tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert loaded(text)["input_ids"] == ids
        assert loaded.decode(ids) == tokenizer.decode(ids) == text
    assert loaded.chat_template == tokenizer.chat_template


def test_tokenizer_is_one_token_per_character(tokenizer):
    text = "".join(CHARS)
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text) and len(set(ids)) == len(text)
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.convert_ids_to_tokens(tokenizer("<|user|>ab<eos>")["input_ids"]) == ["<|user|>", "a", "b", "<eos>"]


def test_chat_template_renders_as_documented(tmp_path, tokenizer):
    tokenizer.save_pretrained(str(tmp_path))
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1="},
                {"role": "assistant", "content": "#### 2"}]
    for tok in (tokenizer, loaded):
        assert tok.apply_chat_template(messages,
                                       tokenize=False) == "<|system|>be brief<|user|>1+1=<|assistant|>#### 2<eos>"
        assert tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True) == \
            "<|system|>be brief<|user|>1+1=<|assistant|>"


# ---------------------------------------------------------------- tiny model


def test_tiny_model_round_trip_gives_identical_logits(tmp_path, tokenizer, make_model, small_overrides):
    save_tiny_model(tmp_path, tokenizer, seed=7, **small_overrides)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    fresh = make_model(seed=7)
    ids = torch.tensor([tokenizer("347+285=7+5+0=12 #### 0632")["input_ids"]])
    with torch.no_grad():
        a, b = fresh(input_ids=ids).logits, loaded.eval()(input_ids=ids).logits
    assert torch.equal(a, b)
    assert loaded.config.vocab_size == len(tokenizer) and loaded.config.eos_token_id == tokenizer.eos_token_id
    with torch.no_grad():
        other = make_model(seed=8)(input_ids=ids).logits
    assert not torch.allclose(a, other)  # the seed matters, so the equality above means something


def test_tiny_model_sizes_are_the_ones_stated(tokenizer):
    """The count the help and the docs state (tiny_model.parameters, from the shapes) is the built model's, the
    one a run's metrics record (n_params): the help once said 1.2M, the README 0.9M, the metrics 866,304."""
    from pathlib import Path

    from exactrl.compute import count_parameters
    from exactrl.config.loader import describe_keys
    from exactrl.config.schema_commands import DemoConfig

    for size in SIZES:
        model = build_tiny_model(len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id,
                                 tokenizer.eos_token_id, **SIZES[size])
        assert count_parameters(model) == parameters(size), size
    assert parameters("tiny") == 866_304 and parameters("small") == 113_408  # the shapes' counts, by hand
    (help_line,) = [ln for ln in describe_keys(DemoConfig) if ln.startswith("task.model =")]
    root = Path(__file__).resolve().parents[1]
    readme, quickstart = (root / "README.md").read_text(), (root / "docs" / "quickstart.md").read_text()
    for figure in ("0.87M parameters, 4 layers", "0.11M parameters, 2 layers"):
        assert figure in help_line and figure in quickstart
    for page in (readme, quickstart):
        assert "a 0.87M-parameter Llama" in page and not re.search(r"\b(1\.2|0\.9)M\b", page)


def test_the_forgetful_solution_adds_each_column_alone_and_is_right_exactly_without_carries():
    """The base model's corpus, against a count done another way: column i contributes
    (a_i + b_i) mod 10 at 10^i, the last column its whole sum; the steps are the worked style's with
    every carry 0."""
    assert arithmetic.forgetful_solution(Problem(729, 485)) == "9+5+0=14 2+8+0=10 7+4+0=11 #### 1104"
    rng, n_right = random.Random(1), 0
    for _ in range(2000):
        p = Problem(rng.randint(10, 999), rng.randint(10, 999))
        digits = max(len(str(p.a)), len(str(p.b)))
        cols = [(p.a // 10**i % 10, p.b // 10**i % 10) for i in range(digits)]
        expected = sum((x + y) % 10 * 10**i for i, (x, y) in enumerate(cols[:-1])) + sum(cols[-1]) * 10 ** (digits - 1)
        text = arithmetic.forgetful_solution(p)
        assert int(extract_answer(text)) == expected and len(text.split(" #### ")[1]) == digits + 1
        assert [tuple(map(int, m[:3])) for m in STEP_RE.findall(text)] == [(x, y, 0) for x, y in cols]
        carries = any(x + y >= 10 for x, y in cols[:-1])
        assert is_correct(text, p.answer) == (not carries)
        n_right += not carries
    assert 0.2 < n_right / 2000 < 0.5  # the base model's corpus is right on about a third of the problems


# ---------------------------------------------------------------- cached build


def test_ensure_builtin_builds_once_and_reuses(tmp_path, monkeypatch):
    spec = BuiltinSpec(n_sft=50, n_rl=50, n_eval=20)
    paths = ensure_builtin(spec, cache=tmp_path)
    assert paths.root.parent == tmp_path and (paths.root / "DONE").exists()
    assert json.loads((paths.root / "DONE").read_text())["n_sft"] == 50
    for p, n in ((paths.sft_train, 50), (paths.rl_train, 50), (paths.eval, 20), (paths.pretrain, 50)):
        assert len(p.read_text().splitlines()) == n
    sft = [json.loads(x) for x in paths.sft_train.read_text().splitlines()]
    rl = [json.loads(x) for x in paths.rl_train.read_text().splitlines()]
    ev = [json.loads(x) for x in paths.eval.read_text().splitlines()]
    assert set(sft[0]) == {"prompt", "completion"} and set(rl[0]) == {"prompt", "answer"}
    pretrain = [json.loads(x) for x in paths.pretrain.read_text().splitlines()]  # the RL problems, forgetful
    assert [r["prompt"] for r in pretrain] == [r["prompt"] for r in rl]
    assert all(r["completion"] == arithmetic.forgetful_solution(Problem(*map(int, r["prompt"][:-1].split("+"))))
               for r in pretrain)
    prompts = [r["prompt"] for r in sft], [r["prompt"] for r in rl], [r["prompt"] for r in ev]
    assert not set(prompts[0]) & set(prompts[1]) and not set(prompts[2]) & (set(prompts[0]) | set(prompts[1]))
    tok = AutoTokenizer.from_pretrained(str(paths.model))
    model = AutoModelForCausalLM.from_pretrained(str(paths.model))
    assert model.config.vocab_size == len(tok)

    files = sorted(p for p in paths.root.rglob("*") if p.is_file())
    mtimes = {p: p.stat().st_mtime_ns for p in files}

    def no_rebuild(*args, **kwargs):
        raise AssertionError("ensure_builtin rebuilt a cached task")

    monkeypatch.setattr(builtin, "save_tiny_model", no_rebuild)
    monkeypatch.setattr(builtin, "save_tokenizer", no_rebuild)
    assert ensure_builtin(spec, cache=tmp_path) == paths
    assert sorted(p for p in paths.root.rglob("*") if p.is_file()) == files
    assert {p: p.stat().st_mtime_ns for p in files} == mtimes


def test_ensure_builtin_key_depends_on_spec(tmp_path):
    a = BuiltinSpec(n_sft=50, n_rl=50, n_eval=20)
    assert ensure_builtin(a, cache=tmp_path).root != ensure_builtin(BuiltinSpec(n_sft=50, n_rl=50, n_eval=20, seed=1),
                                                                    cache=tmp_path).root


def test_building_the_tiny_model_leaves_the_callers_random_state_alone():
    # A run seeds, then resolves model.path=builtin, which builds the model on first use only: the build
    # must not reseed the run (it did: a fresh cache and a warm one gave different weights, issue 21).
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    first = build_tiny_model(len(CHARS) + 3, 0, 1, 2, seed=0)
    assert torch.equal(torch.rand(4), expected)
    again = build_tiny_model(len(CHARS) + 3, 0, 1, 2, seed=0)  # its own seed still decides its weights
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), again.state_dict().values()))
