"""Data: bad rows are reported as file:line, loss masks cover exactly the completion, batches
are aligned with next-token targets, and the step sampler depends only on (seed, step)."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from exactrl.algorithms.sft import demonstration
from exactrl.data.batch import collate
from exactrl.data.batching import StepSampler
from exactrl.data.encode import encode_prompts, encode_sft
from exactrl.data.jsonl import DataError, Row, read_jsonl

GOOD = json.dumps({"prompt": "1+1=", "completion": "#### 2"})


def write_lines(tmp_path, lines: list[str]):
    p = tmp_path / "data.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def assert_located(err: DataError, path, line: int) -> None:
    # "path:3:" rather than "path:3", which would also match "path:30".
    assert re.search(rf"{re.escape(str(path))}:{line}:", str(err)), str(err)


# ---------------------------------------------------------------- malformed rows


@pytest.mark.parametrize("bad,fragment", [
    ('{"prompt": "1+1=", "completion": "2"', "not valid JSON"),
    ('["prompt", "completion"]', "JSON object, got list"),
    ('"just a string"', "JSON object, got str"),
])
def test_unreadable_line_is_reported_with_its_line(tmp_path, bad, fragment):
    p = write_lines(tmp_path, [GOOD, GOOD, bad, GOOD])
    with pytest.raises(DataError, match=fragment) as info:
        read_jsonl(p)
    assert_located(info.value, p, 3)


def test_blank_lines_are_skipped_but_counted(tmp_path):
    p = write_lines(tmp_path, [GOOD, "", "   ", "{oops", GOOD])
    with pytest.raises(DataError) as info:
        read_jsonl(p)
    assert_located(info.value, p, 4)
    rows = read_jsonl(write_lines(tmp_path, [GOOD, "", GOOD]))
    assert [r.source for r in rows] == [f"{tmp_path / 'data.jsonl'}:1", f"{tmp_path / 'data.jsonl'}:3"]


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_jsonl(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="no rows"):
        read_jsonl(tmp_path / "empty.jsonl")


@pytest.mark.parametrize("bad,fragment", [
    ({"prompt": "2+2="}, "needs 'prompt' and 'completion'"),
    ({"prompt": "2+2=", "completion": ""}, "'completion' is empty"),
    ({"prompt": "2+2=", "completion": 4}, "'completion' must be a string"),
    ({"prompt": "2+2=", "completion": "4" * 40}, "exceed data.max_length=32"),
    ({"messages": [{"role": "user", "content": "2+2="}, {"role": "bot", "content": "4"}]}, "messages[1]"),
    ({"messages": [{"role": "user", "content": "2+2="}]}, "last message must be the assistant's"),
    ({"messages": []}, "non-empty list"),
])
def test_bad_sft_row_is_reported_with_its_line(tmp_path, tokenizer, bad, fragment):
    p = write_lines(tmp_path, [GOOD, GOOD, GOOD, GOOD, json.dumps(bad), GOOD])
    with pytest.raises(DataError) as info:
        encode_sft(read_jsonl(p), tokenizer, max_length=32)
    assert fragment in str(info.value)
    assert_located(info.value, p, 5)


def test_row_of_exactly_max_length_is_accepted(tokenizer):
    # "1+1=" (4 tokens) + 27 completion characters + EOS = 32 tokens.
    row = Row("x:1", {"prompt": "1+1=", "completion": "2" * 27})
    assert len(encode_sft([row], tokenizer, max_length=32)[0].input_ids) == 32
    with pytest.raises(DataError, match="33 tokens exceed data.max_length=32"):
        encode_sft([Row("x:1", {"prompt": "1+1=", "completion": "2" * 28})], tokenizer, max_length=32)


def test_bad_rl_prompt_rows(tmp_path, tokenizer):
    p = write_lines(tmp_path, [json.dumps({"prompt": "1+1=", "answer": "2"}), json.dumps({"prompt": "1+1=", "answer": [
        2]})])
    with pytest.raises(DataError, match="'answer' must be a string or number") as info:
        encode_prompts(read_jsonl(p), tokenizer, max_length=32)
    assert_located(info.value, p, 2)
    p = write_lines(tmp_path, [json.dumps({"prompt": "9" * 40})])
    with pytest.raises(DataError, match="leaves no room") as info:
        encode_prompts(read_jsonl(p), tokenizer, max_length=32)
    assert_located(info.value, p, 1)


# ---------------------------------------------------------------- loss masks


def test_prompt_tokens_are_masked_out(tokenizer):
    ex = encode_sft([Row("x:1", {"prompt": "12+3=", "completion": "#### 15"})], tokenizer, max_length=64)[0]
    # One token per character; the completion is followed by EOS.
    assert tokenizer.convert_ids_to_tokens(ex.input_ids) == list("12+3=") + list("#### 15") + ["<eos>"]
    assert ex.loss_mask == [0] * 5 + [1] * 8
    assert ex.loss_tokens == 8


def test_empty_prompt_learns_every_completion_token_or_is_rejected(tokenizer):
    """An empty prompt is accepted (require_str(..., allow_empty=True)), but the built-in
    tokenizer adds no BOS, so the completion's first token has no position predicting it and
    is silently left out of the loss. Either every completion token (and EOS) is a target, or
    the row is rejected with a DataError naming it. Fails today (data/encode.py encode_sft)."""
    row = Row("x:7", {"prompt": "", "completion": "hello"})
    try:
        ex = encode_sft([row], tokenizer, max_length=64)[0]
    except DataError as e:
        assert "x:7" in str(e)
        return
    assert ex.loss_tokens == len("hello") + 1


def test_messages_row_learns_only_assistant_turns(tokenizer):
    messages = [{"role": "system", "content": "add"}, {"role": "user", "content": "1+1="},
                {"role": "assistant", "content": "#### 2"}, {"role": "user", "content": "2+2="},
                {"role": "assistant", "content": "#### 4"}]
    ex = encode_sft([Row("x:1", {"messages": messages})], tokenizer, max_length=128)[0]
    assert tokenizer.decode(ex.input_ids) == tokenizer.apply_chat_template(messages, tokenize=False)
    tokens = tokenizer.convert_ids_to_tokens(ex.input_ids)
    learned = "".join(t if m else "|" for t, m in zip(tokens, ex.loss_mask))
    # Learned: each assistant reply and its <eos>; not the role markers, system or user text.
    assert learned == "|" * len(["<|system|>", *"add", "<|user|>", *"1+1=", "<|assistant|>"]) + "#### 2<eos>" + \
        "|" * len(["<|user|>", *"2+2=", "<|assistant|>"]) + "#### 4<eos>"


def test_a_tool_message_is_context_not_a_target(tokenizer):
    """A tool episode (the calculator task's): the call and the final answer are learnt, each with its <eos>; the
    tool's result, rendered by the template as <|tool|>632, carries no loss."""
    call = '<tool_call>{"name": "calc", "arguments": {"expr": "347+285"}}</tool_call>'
    messages = [{"role": "user", "content": "347+285="}, {"role": "assistant", "content": call},
                {"role": "tool", "content": "632"}, {"role": "assistant", "content": "#### 0632"}]
    ex = encode_sft([Row("x:1", {"messages": messages})], tokenizer, max_length=128)[0]
    assert tokenizer.decode(ex.input_ids) == tokenizer.apply_chat_template(messages, tokenize=False)
    tokens = tokenizer.convert_ids_to_tokens(ex.input_ids)
    learned = "".join(t if m else "|" for t, m in zip(tokens, ex.loss_mask))
    assert learned == "|" * len(["<|user|>", *"347+285=", "<|assistant|>"]) + call + "<eos>" + \
        "|" * len([*"<|tool|>632", "<|assistant|>"]) + "#### 0632<eos>"


def test_rl_prompt_from_messages_opens_an_assistant_turn(tmp_path, tokenizer):
    p = write_lines(tmp_path, [json.dumps({"prompt": [{"role": "user", "content": "1+1="}], "answer": 2})])
    prompt = encode_prompts(read_jsonl(p), tokenizer, max_length=32)[0]
    assert prompt.text == "<|user|>1+1=<|assistant|>" and prompt.answer == "2"
    assert tokenizer.decode(prompt.input_ids) == prompt.text


def test_collate_of_sft_examples_shapes_and_target_alignment(tokenizer):
    rows = [Row("x:1", {"prompt": "12+3=", "completion": "#### 15"}), Row("x:2", {"prompt": "1+1=", "completion": "2"}),
            Row("x:3", {"prompt": "?", "completion": "hello world"})]
    examples = encode_sft(rows, tokenizer, max_length=64)
    batch = collate([demonstration(e) for e in examples], tokenizer.pad_token_id)
    width = max(len(e.input_ids) for e in examples)
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (3, width)
    assert batch["loss_mask"].shape == (3, width - 1)
    for b, e in enumerate(examples):
        n = len(e.input_ids)
        assert batch["input_ids"][b, :n].tolist() == e.input_ids
        assert batch["input_ids"][b, n:].eq(tokenizer.pad_token_id).all()
        assert batch["attention_mask"][b].tolist() == [1] * n + [0] * (width - n)
        # loss_mask[t] marks target input_ids[t + 1]: it must be 1 exactly on completion tokens.
        targets = [tokenizer.convert_ids_to_tokens(int(batch["input_ids"][b, t + 1]))
                   for t in range(width - 1) if batch["loss_mask"][b, t]]
        completion = rows[b].data["completion"]
        assert targets == list(completion) + ["<eos>"]
        assert int(batch["loss_mask"][b].sum()) == e.loss_tokens


# ---------------------------------------------------------------- step sampler


def test_each_epoch_is_a_permutation():
    n, g = 10, 5
    s = StepSampler(n, g, seed=0)
    for epoch in range(3):
        items = s.batch(2 * epoch) + s.batch(2 * epoch + 1)
        assert sorted(items) == list(range(n))
    assert s.batch(0) + s.batch(1) != s.batch(2) + s.batch(3)  # reshuffled each epoch


def test_batches_depend_only_on_seed_and_step():
    a = StepSampler(37, 8, seed=5)
    b = StepSampler(37, 8, seed=5)
    forward = [a.batch(k) for k in range(12)]
    backward = [b.batch(k) for k in reversed(range(12))][::-1]  # any query order
    assert forward == backward
    assert StepSampler(37, 8, seed=5).batch(9) == forward[9]  # a fresh sampler (resume at step 9)
    assert StepSampler(37, 8, seed=6).batch(0) != forward[0]


def test_batch_straddling_an_epoch_boundary():
    n, g = 10, 4
    s = StepSampler(n, g, seed=1)
    stream = [i for k in range(5) for i in s.batch(k)]  # 20 positions = exactly 2 epochs
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:]) == list(range(10))
    # Step 2 covers stream positions 8..11: the last two of epoch 0, the first two of epoch 1.
    assert s.batch(2) == stream[8:12]
    assert StepSampler(n, g, seed=1).batch(2) == stream[8:12]


def test_global_batch_larger_than_dataset():
    s = StepSampler(3, 7, seed=0)
    counts = Counter(s.batch(0) + s.batch(1) + s.batch(2))  # 21 positions = 7 epochs
    assert counts == {0: 7, 1: 7, 2: 7}
    assert s.epoch_of(3) == 7.0


# ---------------------------------------------------------------- bytes that are not text, rows too big to tokenise


def test_non_utf8_line_is_reported_with_its_line(tmp_path):
    p = tmp_path / "data.jsonl"
    p.write_bytes((GOOD + "\n").encode() * 2 + b'{"prompt": "1+1=", "completion": "\xff"}\n')
    with pytest.raises(DataError, match="not UTF-8 text") as info:
        read_jsonl(p)
    assert_located(info.value, p, 3)


def test_lone_surrogate_is_reported_with_its_line(tmp_path, tokenizer):
    p = write_lines(tmp_path, [GOOD, '{"prompt": "1+1=", "completion": "\\ud800"}',
                               '{"prompt": "ok \\u00e9", "completion": "2"}'])
    with pytest.raises(DataError, match="lone surrogate") as info:
        read_jsonl(p)
    assert_located(info.value, p, 2)
    p = write_lines(tmp_path, [GOOD, '{"prompt": "ok \\u00e9", "completion": "2"}'])  # a real escaped character is fine
    assert read_jsonl(p)[1].data["prompt"] == "ok é"


def test_deeply_nested_json_is_reported_with_its_line(tmp_path):
    p = write_lines(tmp_path, [GOOD, "[" * 100_000 + "]" * 100_000])
    with pytest.raises(DataError, match="nested too deeply") as info:
        read_jsonl(p)
    assert_located(info.value, p, 2)


@pytest.mark.parametrize("row", [{"prompt": "1+1=", "completion": "9" * 2_000_000},
                                 {"messages": [{"role": "user", "content": "x" * 2_000_000}, {
                                     "role": "assistant", "content": "2"}]}])
def test_huge_row_is_refused_before_tokenising(tokenizer, monkeypatch, row):
    def no_tokenising(*args, **kwargs):
        raise AssertionError("the row was tokenised")

    rows = [Row("d.jsonl:2", row)]
    monkeypatch.setattr(type(tokenizer), "__call__", no_tokenising)
    monkeypatch.setattr(type(tokenizer), "apply_chat_template", no_tokenising)
    with pytest.raises(DataError, match=r"d.jsonl:2: 2,000,00\d characters cannot fit in data.max_length=64"):
        encode_sft(rows, tokenizer, 64)
    with pytest.raises(DataError, match=r"d.jsonl:2: .* characters cannot fit"):
        encode_prompts([Row("d.jsonl:2", {"prompt": row.get("messages", "y" * 2_000_000)})], tokenizer, 64)


def test_size_bound_never_refuses_a_row_that_fits(tokenizer):
    # The longest text of max_length tokens: every token the vocabulary's longest string.
    longest = max(tokenizer.get_vocab(), key=len)
    text = longest * 10
    assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) <= 10
    encode_prompts([Row("d.jsonl:1", {"prompt": text})], tokenizer, 64)


# ---------------------------------------------------------------- demonstrations (mixed-policy methods)


def test_a_demonstration_is_tokenised_as_sft_learns_its_completion(tmp_path, tokenizer):
    """A prompt's demonstration is the token sequence SFT would learn from the same row: the
    completion's targets of the {prompt, completion} row, or a messages row's last assistant turn."""
    row = {"prompt": "12+3=", "answer": 15, "demonstration": "#### 15"}
    p = write_lines(tmp_path, [json.dumps(row)])
    prompt = encode_prompts(read_jsonl(p), tokenizer, max_length=32)[0]
    sft = encode_sft([Row("x:1", {"prompt": "12+3=", "completion": "#### 15"})], tokenizer, max_length=32)[0]
    first = sft.loss_mask.index(1)
    assert prompt.input_ids == sft.input_ids[:first] and prompt.demonstration == sft.input_ids[first:]
    assert prompt.answer == "15"
    messages = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "#### 2"}]
    p = write_lines(tmp_path, [json.dumps({"messages": messages, "answer": "2"})])
    prompt = encode_prompts(read_jsonl(p), tokenizer, max_length=64)[0]
    sft = encode_sft([Row("x:1", {"messages": messages})], tokenizer, max_length=64)[0]
    first = sft.loss_mask.index(1)
    assert prompt.text == "<|user|>1+1=<|assistant|>"
    assert prompt.input_ids == sft.input_ids[:first] and prompt.demonstration == sft.input_ids[first:]
    plain = encode_prompts([Row("x:1", {"prompt": "1+1=", "answer": 2})], tokenizer, max_length=32)[0]
    assert plain.demonstration is None


@pytest.mark.parametrize("row, fragment", [
    ({"prompt": "1+1=", "demonstration": 2}, "'demonstration' must be a string"),
    ({"prompt": "1+1=", "demonstration": "  "}, "'demonstration' is blank"),
    ({"messages": [{"role": "user", "content": "1+1="}]}, "ends with the assistant's demonstration"),
    ({"messages": [{"role": "assistant", "content": "#### 2"}]}, "after at least one turn of prompt"),
    ({"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": ""}]},
     "the demonstration, is empty"),
    ({"prompt": "1+1=", "messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]},
     "'prompt' or 'messages', not both"),
    ({"prompt": "1+1=", "demonstration": "9" * 40}, "prompt and demonstration of 45 tokens exceed"),
])
def test_a_malformed_demonstration_row_is_refused_with_its_line(tmp_path, tokenizer, row, fragment):
    p = write_lines(tmp_path, [json.dumps({"prompt": "1+1=", "answer": 2, "demonstration": "#### 2"}),
                               json.dumps(row)])
    with pytest.raises(DataError, match=re.escape(fragment)) as info:
        encode_prompts(read_jsonl(p), tokenizer, max_length=32)
    assert_located(info.value, p, 2)


def test_a_mixed_method_refuses_a_prompt_without_a_demonstration(tmp_path, tokenizer):
    from exactrl.algorithms.rl import require_demonstrations

    p = write_lines(tmp_path, [json.dumps({"prompt": "1+1=", "answer": 2, "demonstration": "#### 2"}),
                               json.dumps({"prompt": "2+2=", "answer": 4})])
    prompts = encode_prompts(read_jsonl(p), tokenizer, max_length=32)
    with pytest.raises(DataError, match="algo.name=luffy learns from a demonstration") as info:
        require_demonstrations(prompts, "luffy")
    assert_located(info.value, p, 2)
    require_demonstrations(prompts[:1], "luffy")


def test_the_builtin_mixed_file_holds_the_sft_problems_with_their_demonstrations(tmp_path):
    """Equal data: the mixed-policy methods see exactly the prompts and demonstrations SFT sees."""
    from exactrl.tasks.arithmetic import is_correct
    from exactrl.tasks.builtin import BuiltinSpec, ensure_builtin

    paths = ensure_builtin(BuiltinSpec(n_sft=50, n_rl=20, n_eval=10), cache=tmp_path)
    sft = [r.data for r in read_jsonl(paths.sft_train)]
    mixed = [r.data for r in read_jsonl(paths.mixed_train)]
    assert [(r["prompt"], r["demonstration"]) for r in mixed] == [(r["prompt"], r["completion"]) for r in sft]
    assert all(is_correct(r["demonstration"], r["answer"]) for r in mixed)
    paths.mixed_train.unlink()  # a cache built before the mixed file existed gets it, the same
    assert [r.data for r in read_jsonl(ensure_builtin(BuiltinSpec(n_sft=50, n_rl=20, n_eval=10),
                                                      cache=tmp_path).mixed_train)] == mixed
