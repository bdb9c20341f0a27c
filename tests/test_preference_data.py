"""Preference data: pairs, unpaired and step-labelled rows are refused with file:line when malformed;
a pair's two sequences share the prompt's ids exactly and each is trained on its answer alone (the
rejected side's prompt included: OpenRLHF #294); the built-in sets are disjoint, deterministic, and
say what the task's verifier says."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from exactrl.data.batch import collate
from exactrl.data.encode import OverLength
from exactrl.data.jsonl import DataError
from exactrl.data.preference import load_pairs, load_unpaired
from exactrl.data.steps import load_steps
from exactrl.tasks import arithmetic, builtin, preference
from exactrl.tasks.arithmetic import Problem
from exactrl.tasks.builtin import BuiltinSpec
from exactrl.tasks.tokenizer import build_tokenizer


def data(max_length=256, max_prompt_length=None, over_length="error"):
    return SimpleNamespace(max_length=max_length, max_prompt_length=max_prompt_length, over_length=over_length)


def write(tmp_path, rows, name="data.jsonl"):
    p = tmp_path / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return p


def chars(tok, tokens) -> list[int]:
    """Independent tokenisation for the character tokenizer: one id per character or named special."""
    return tok.convert_tokens_to_ids(list(tokens))


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


PAIR = {"prompt": "1+1=", "chosen": "#### 2", "rejected": "#### 3"}
UNPAIRED = {"prompt": "1+1=", "completion": "#### 2", "label": True}
STEPS = {"prompt": "1+1=", "completions": ["1+1+0=02", "#### 02"], "labels": [True, True]}


# ---------------------------------------------------------------- malformed rows: file:line and the key

@pytest.mark.parametrize("row,fragment", [
    ({"prompt": "1+1=", "rejected": "#### 3"}, "missing 'chosen'"),
    ({"prompt": "1+1=", "chosen": "#### 2"}, "missing 'rejected'"),
    ({"chosen": "#### 2", "rejected": "#### 3"}, "missing 'prompt'"),
    ({"prompt": 11, "chosen": "#### 2", "rejected": "#### 3"}, "'prompt' must be a string"),
    ({"prompt": "1+1=", "chosen": 2, "rejected": "#### 3"}, "'chosen' must be a string or a list of messages"),
    ({"prompt": "1+1=", "chosen": "#### 2", "rejected": None}, "'rejected' must be a string or a list"),
    ({"prompt": "1+1=", "chosen": "#### 2", "rejected": "#### 2"}, "'chosen' and 'rejected' are the same"),
    ({"prompt": "1+1=", "chosen": "#### 2", "rejected": ""}, "'rejected' is empty"),
    ({"prompt": "1+1=", "chosen": "  ", "rejected": "#### 3"}, "'chosen' is empty"),
    ({**PAIR, "margin": "big"}, "'margin' must be a finite number"),
    ({**PAIR, "margin": True}, "'margin' must be a finite number"),
    ('{"prompt": "1+1=", "chosen": "#### 2", "rejected": "#### 3", "margin": NaN}', "'margin' must be a finite"),
    ({"prompt": "1+1=", "chosen": "#### 2", "rejected": [assistant("#### 3")]}, "all be text or all message lists"),
    ({"chosen": [user("1+1="), assistant("#### 2")], "rejected": [user("1+2="), assistant("#### 3")]},
     "differ at messages[0]"),
    ({"chosen": [user("1+1="), assistant("#### 2")], "rejected": [user("1+1=")]}, "'rejected' must end with the "
                                                                                   "assistant's answer"),
    ({"chosen": [user("1+1="), assistant("#### 2")], "rejected": [assistant("#### 3")]}, "'rejected' must end with"),
    ({"chosen": [user("1+1="), assistant("#### 2")], "rejected": [user("x"), user("1+1="), assistant("#### 3")]},
     "'chosen' has 2 messages and 'rejected' 3"),
    ({"chosen": [user("1+1="), assistant("#### 2")], "rejected": [user("1+1="), assistant("#### 2")]},
     "are the same answer"),
    ({"chosen": [user("1+1="), assistant("")], "rejected": [user("1+1="), assistant("#### 3")]}, "'chosen' is empty"),
    ({"chosen": [{"role": "bot", "content": "hi"}, assistant("#### 2")], "rejected": [user("1+1="), assistant("3")]},
     "chosen[0] must be"),
    ({"prompt": [user("1+1=")], "chosen": [assistant("#### 2"), assistant("x")], "rejected": [assistant("#### 3")]},
     "'chosen' must be a list of one assistant message"),
    ({"prompt": [user("1+1=")], "chosen": [assistant("#### 2")], "rejected": [user("#### 3")]},
     "'rejected' must be the assistant's message"),
    ({"prompt": "1+1=", "chosen": [assistant("#### 2")], "rejected": [assistant("#### 3")]},
     "'prompt' must be a list of messages"),
    ({"prompt": [], "chosen": [assistant("#### 2")], "rejected": [assistant("#### 3")]}, "'prompt' is an empty list"),
])
def test_a_malformed_pair_is_refused_naming_its_line_and_key(tmp_path, row, fragment):
    p = write(tmp_path, [PAIR, PAIR, row, PAIR])
    with pytest.raises(DataError) as info:
        load_pairs(p, build_tokenizer(), data())
    message = str(info.value)
    assert message.startswith(f"{p}:3: ") and fragment in message and "\n" not in message, message


@pytest.mark.parametrize("row,fragment", [
    ({"prompt": "1+1=", "completion": "#### 2"}, "missing 'label'"),
    ({"prompt": "1+1=", "completion": "#### 2", "label": 1}, "'label' must be true or false"),
    ({"prompt": "1+1=", "completion": "#### 2", "label": "true"}, "'label' must be true or false"),
    ({"prompt": "1+1=", "label": False}, "missing 'completion'"),
    ({"prompt": "1+1=", "completion": " ", "label": False}, "'completion' is empty"),
    ({"completion": "#### 2", "label": False}, "missing 'prompt'"),
    ({"prompt": [user("1+1=")], "completion": "#### 2", "label": False}, "'prompt' must be a string"),
])
def test_a_malformed_unpaired_row_is_refused_naming_its_line_and_key(tmp_path, row, fragment):
    p = write(tmp_path, [UNPAIRED, row])
    with pytest.raises(DataError) as info:
        load_unpaired(p, build_tokenizer(), data())
    assert str(info.value).startswith(f"{p}:2: ") and fragment in str(info.value), str(info.value)


@pytest.mark.parametrize("row,fragment", [
    ({"prompt": "1+1=", "labels": [True]}, "missing 'completions'"),
    ({"prompt": "1+1=", "completions": ["a"]}, "missing 'labels'"),
    ({"completions": ["a"], "labels": [True]}, "missing 'prompt'"),
    ({"prompt": "1+1=", "completions": "a b", "labels": [True]}, "'completions' must be a non-empty list"),
    ({"prompt": "1+1=", "completions": [], "labels": []}, "'completions' must be a non-empty list"),
    ({"prompt": "1+1=", "completions": ["a", ""], "labels": [True, True]}, "completions[1] must be a step's text"),
    ({"prompt": "1+1=", "completions": ["a", "b", "c"], "labels": [True, False]}, "'labels' has 2 entries for 3 steps"),
    ({"prompt": "1+1=", "completions": ["a", "b"], "labels": [True, "yes"]}, "labels[1] must be true or false"),
    ({"prompt": "1+1=", "completions": ["a"], "labels": True}, "'labels' must be a list"),
])
def test_a_malformed_step_row_is_refused_naming_its_line_and_key(tmp_path, row, fragment):
    p = write(tmp_path, [STEPS, STEPS, STEPS, row])
    with pytest.raises(DataError) as info:
        load_steps(p, build_tokenizer(), data())
    assert str(info.value).startswith(f"{p}:4: ") and fragment in str(info.value), str(info.value)


# ---------------------------------------------------------------- a pair: one prompt, each side trained on its answer

def test_a_pair_shares_the_prompt_ids_and_trains_each_side_on_its_answer_alone(tmp_path):
    tok = build_tokenizer()
    rows = [{"prompt": "12+3=", "chosen": "#### 15", "rejected": "1+1=2 #### 16", "margin": 0.5}, PAIR]
    (e, _), note = load_pairs(write(tmp_path, rows), tok, data())
    assert note is None and e.margin == 0.5
    prompt = chars(tok, "12+3=")
    answers = {"chosen": chars(tok, [*"#### 15", "<eos>"]), "rejected": chars(tok, [*"1+1=2 #### 16", "<eos>"])}
    chosen, rejected = e.samples()
    assert (chosen.source, rejected.source) == ("chosen", "rejected")
    for s in (chosen, rejected):
        assert s.prompt_ids == prompt and s.response_ids == answers[s.source]
        # one mask entry per next-token target: 0 on every target inside the prompt, 1 on every answer token
        assert s.loss_mask == (0,) * (len(prompt) - 1) + (1,) * len(answers[s.source])
    batch = collate([chosen, rejected], tok.pad_token_id)
    for b, s in enumerate((chosen, rejected)):
        ids, mask = batch["input_ids"][b].tolist(), batch["loss_mask"][b].tolist()
        assert ids[: len(prompt)] == prompt  # identical prompt ids on both sides
        learned = [ids[t + 1] for t in range(len(mask)) if mask[t]]
        assert learned == answers[s.source], (s.source, tok.convert_ids_to_tokens(learned))


def test_chat_pairs_in_either_form_render_the_prompt_once_and_learn_the_assistant_turn(tmp_path):
    tok = build_tokenizer()
    system = {"role": "system", "content": "add"}
    rows = [{"chosen": [system, user("1+1="), assistant("#### 2")], "rejected": [system, user("1+1="),
                                                                                 assistant("#### 3")]},
            {"prompt": [system, user("1+1=")], "chosen": [assistant("#### 2")], "rejected": [assistant("#### 3")]}]
    implicit, explicit = load_pairs(write(tmp_path, rows), tok, data())[0]
    prompt = chars(tok, ["<|system|>", *"add", "<|user|>", *"1+1=", "<|assistant|>"])
    for e in (implicit, explicit):
        assert e.prompt_ids == prompt
        assert e.chosen_ids == chars(tok, [*"#### 2", "<eos>"]) and e.rejected_ids == chars(tok, [*"#### 3", "<eos>"])
        for side in ("chosen", "rejected"):
            ids, mask = e.sequence(side)
            assert ids[: len(prompt)] == prompt and mask == [0] * len(prompt) + [1] * (len(ids) - len(prompt))


def test_a_chat_template_that_does_not_extend_the_prompt_is_refused(tmp_path):
    tok = build_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}>{% endif %}")
    p = write(tmp_path, [{"prompt": [user("1+1=")], "chosen": [assistant("#### 2")], "rejected": [assistant("3")]}])
    with pytest.raises(DataError, match=re.escape(f"{p}:1: the chat template does not render 'chosen'")):
        load_pairs(p, tok, data())


def pad_is_eos_tokenizer():
    """The built-in tokenizer with pad = eos (as SmolLM2's, Qwen's) and a template that ends every
    turn, the user's too, with eos: eos then stands inside the prompt, beside the padding."""
    tok = build_tokenizer()
    tok.pad_token = tok.eos_token
    tok.chat_template = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + eos_token }}{% endfor %}"
                         "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
    return tok


def test_pad_equal_to_eos_leaves_the_masks_and_the_last_real_token_where_they_belong(tmp_path):
    tok = pad_is_eos_tokenizer()
    assert tok.pad_token_id == tok.eos_token_id
    rows = [{"prompt": [user("1+1=")], "chosen": [assistant("#### 2")], "rejected": [assistant("1+1+0=02 #### 02")]}]
    e = load_pairs(write(tmp_path, rows), tok, data())[0][0]
    prompt = chars(tok, ["<|user|>", *"1+1=", "<eos>", "<|assistant|>"])
    assert e.prompt_ids == prompt
    batch = collate(list(e.samples()), tok.pad_token_id)
    for b, answer in enumerate(([*"#### 2", "<eos>"], [*"1+1+0=02 #### 02", "<eos>"])):
        ids, mask = batch["input_ids"][b].tolist(), batch["loss_mask"][b].tolist()
        assert [ids[t + 1] for t in range(len(mask)) if mask[t]] == chars(tok, answer)  # the final eos is learned
        last = int(batch["attention_mask"][b].sum()) - 1  # the last real token: the answer's eos, where an RM scores
        assert last == len(prompt) + len(answer) - 1 and ids[last] == tok.eos_token_id
        # a scorer that looked for the first pad (= eos) would read the prompt's end of turn instead
        assert ids.index(tok.pad_token_id) == prompt.index(tok.eos_token_id) < len(prompt)


# ---------------------------------------------------------------- lengths: error, drop, or cut answers (never prompts)

def test_over_length_pairs_error_drop_or_have_their_answers_cut(tmp_path):
    tok = build_tokenizer()
    long = {"prompt": "1+1=", "chosen": "1+1+0=02 #### 02", "rejected": "#### 03"}  # 4 + 17 tokens chosen
    p = write(tmp_path, [PAIR, long])
    with pytest.raises(OverLength, match=re.escape(f"{p}:2: prompt and 'chosen' of 21 tokens exceed "
                                                   "data.max_length=12")):
        load_pairs(p, tok, data(12))
    kept, note = load_pairs(p, tok, data(12, over_length="drop"))
    assert [e.source for e in kept] == [f"{p}:1"] and "dropped 1 of 2 rows" in note and f"{p}:2" in note
    (short, cut), note = load_pairs(p, tok, data(12, over_length="truncate"))
    assert not short.truncated and cut.truncated and "cut the answers of 1 of 2 rows" in note
    assert cut.prompt_ids == chars(tok, "1+1=")  # whole, the same on both sides
    assert cut.chosen_ids == chars(tok, "1+1+0=02") and cut.rejected_ids == chars(tok, [*"#### 03", "<eos>"])


@pytest.mark.parametrize("row,limit,fragment", [
    ({"prompt": "123456789+1=", "chosen": "#### 2", "rejected": "#### 3"}, 12, "leaves no room for an answer"),
    ({"prompt": "1+1=", "chosen": "#### 20", "rejected": "#### 21"}, 9, "are the same 5 tokens"),
])
def test_truncation_refuses_a_pair_it_cannot_save(tmp_path, row, limit, fragment):
    p = write(tmp_path, [row])
    with pytest.raises(OverLength, match=re.escape(fragment)) as info:
        load_pairs(p, build_tokenizer(), data(limit, over_length="truncate"))
    assert str(info.value).startswith(f"{p}:1: ")
    with pytest.raises(OverLength, match="left none"):  # dropped instead, and nothing left
        load_pairs(p, build_tokenizer(), data(limit, over_length="drop"))


def test_max_prompt_length_bounds_the_shared_prompt(tmp_path):
    p = write(tmp_path, [PAIR])
    with pytest.raises(OverLength, match=re.escape(f"{p}:1: prompt of 4 tokens exceeds data.max_prompt_length=3")):
        load_pairs(p, build_tokenizer(), data(max_prompt_length=3, over_length="truncate"))


# ---------------------------------------------------------------- unpaired and step-labelled rows

def test_unpaired_rows_learn_the_completion_and_say_their_label(tmp_path):
    tok = build_tokenizer()
    rows = [UNPAIRED, {"prompt": [user("1+1=")], "completion": [assistant("#### 3")], "label": False}]
    good, bad = load_unpaired(write(tmp_path, rows), tok, data())[0]
    assert (good.label, bad.label) == (True, False)
    assert (good.sample().source, bad.sample().source) == ("chosen", "rejected")
    assert bad.prompt_ids == chars(tok, ["<|user|>", *"1+1=", "<|assistant|>"])
    for e, answer in ((good, [*"#### 2", "<eos>"]), (bad, [*"#### 3", "<eos>"])):
        s = e.sample()
        assert s.ids == e.prompt_ids + chars(tok, answer)
        assert s.loss_mask == (0,) * (len(e.prompt_ids) - 1) + (1,) * len(answer)


def test_step_rows_score_at_each_steps_separator(tmp_path):
    tok = build_tokenizer()
    row = {"prompt": "47+85=", "completions": ["7+5+0=12", "4+8+1=13", "#### 132"], "labels": [True, False, True]}
    e = load_steps(write(tmp_path, [row]), tok, data(), separator=" ")[0][0]
    assert e.input_ids == chars(tok, "47+85=7+5+0=12 4+8+1=13 #### 132 ") and e.prompt_len == 6
    assert e.positions == [14, 23, 32] and all(e.input_ids[i] == chars(tok, " ")[0] for i in e.positions)
    assert e.labels == [True, False, True]
    # the default separator is TRL's, a newline
    e = load_steps(write(tmp_path, [row]), tok, data())[0][0]
    assert e.input_ids == chars(tok, "47+85=7+5+0=12\n4+8+1=13\n#### 132\n")
    # truncate keeps the whole steps that fit, with their labels; error names the row
    p = write(tmp_path, [row])
    with pytest.raises(OverLength, match=re.escape(f"{p}:1: 33 tokens exceed data.max_length=30")):
        load_steps(p, tok, data(30))
    (e,), note = load_steps(p, tok, data(30, over_length="truncate"))
    assert e.positions == [14, 23] and e.labels == [True, False] and e.truncated and "cut the answers" in note


# ---------------------------------------------------------------- Parquet

def test_parquet_rows_read_as_their_jsonl(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    tok = build_tokenizer()
    pairs = [{"prompt": [user("1+1=")], "chosen": [assistant("#### 2")], "rejected": [assistant("#### 3")],
              "margin": 1.5},
             {"prompt": [user("2+2=")], "chosen": [assistant("#### 4")], "rejected": [assistant("#### 5")]}]
    steps = [STEPS, {"prompt": "2+2=", "completions": ["2+2+0=04", "#### 05"], "labels": [True, False]}]
    for rows, load in ((pairs, load_pairs), (steps, load_steps)):
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
        from_parquet = load(tmp_path / "rows.parquet", tok, data())[0]
        from_jsonl = load(write(tmp_path, rows), tok, data())[0]
        assert [e.source for e in from_parquet] == [f"{tmp_path / 'rows.parquet'}:row {i}" for i in range(2)]
        strip = [{k: v for k, v in vars(e).items() if k != "source"} for e in from_parquet]
        assert strip == [{k: v for k, v in vars(e).items() if k != "source"} for e in from_jsonl]
    bad = [*pairs, {"prompt": [user("3+3=")], "chosen": [assistant("#### 6")], "rejected": [user("#### 6")]}]
    pq.write_table(pa.Table.from_pylist(bad), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'bad.parquet'}:row 2: 'rejected' must be the "
                                                  "assistant's")):
        load_pairs(tmp_path / "bad.parquet", tok, data())


# ---------------------------------------------------------------- the built-in sets

SPEC = BuiltinSpec(n_sft=40, n_rl=300, n_eval=120)


def expected_step(p: Problem, i: int, carry: int) -> str:
    """The step right arithmetic writes at column i after a written carry (an independent re-statement of the check)."""
    x, y = int(str(p.a)[::-1][i]), int(str(p.b)[::-1][i])
    return f"{x}+{y}+{carry}={x + y + carry:02d}"


def problem(prompt: str) -> Problem:
    a, b = prompt.rstrip("=").split("+")
    return Problem(int(a), int(b))


def test_builtin_sets_are_disjoint_deterministic_and_verified(tmp_path, monkeypatch):
    monkeypatch.setenv("EXACTRL_CACHE", str(tmp_path / "a"))
    paths = {kind: builtin.resolve("builtin", kind, SPEC) for kind in preference.KINDS}
    assert builtin.resolve("mine.jsonl", "pairs_train", SPEC) == "mine.jsonl"
    again = builtin.ensure_builtin_preference(SPEC, tmp_path / "b")
    for kind, path in paths.items():  # a second build elsewhere writes the same bytes
        assert open(path, "rb").read() == getattr(again, kind).read_bytes(), kind
    rows = {kind: [json.loads(line) for line in open(path)] for kind, path in paths.items()}
    assert {k: len(v) for k, v in rows.items()} == {f"{s}_{split}": {"train": 300, "eval": 120}[split]
                                                     for s in preference.SETS for split in ("train", "eval")}
    # held out: no eval prompt in any training set, nor in the built-in SFT set
    sft = [r["prompt"] for r in arithmetic.sft_rows(arithmetic.generate("train", 340, 0)[:40], 0.5, 0.75, 0)]
    for s in preference.SETS:
        train, held = {r["prompt"] for r in rows[f"{s}_train"]}, {r["prompt"] for r in rows[f"{s}_eval"]}
        assert len(train) == 300 and len(held) == 120 and not train & held and not (train | held) & set(sft)
    kinds = set()
    for r in rows["pairs_train"] + rows["pairs_eval"]:
        answer = problem(r["prompt"]).answer
        assert r["chosen"] == arithmetic.worked_solution(problem(r["prompt"]))
        assert arithmetic.is_correct(r["chosen"], answer) and not arithmetic.is_correct(r["rejected"], answer)
        kinds.add(r["rejected_kind"])
        assert r["rejected"].startswith("####") == (r["rejected_kind"] == "direct")
        if r["rejected_kind"] == "answer":  # the columns as the chosen's, the answer line alone miscopied
            assert r["rejected"].split("####")[0] == r["chosen"].split("####")[0]
            assert len(r["rejected"]) == len(r["chosen"])
        elif r["rejected_kind"] == "working":  # a slip in the columns: their text differs
            assert r["rejected"].split("####")[0] != r["chosen"].split("####")[0]
    assert kinds == {"direct", "working", "answer"}
    for r in rows["unpaired_train"] + rows["unpaired_eval"]:
        assert r["label"] == arithmetic.is_correct(r["completion"], problem(r["prompt"]).answer)
    assert {r["label"] for r in rows["unpaired_train"]} == {True, False}
    wrong_steps = 0
    for r in rows["steps_train"] + rows["steps_eval"]:
        p, steps = problem(r["prompt"]), r["completions"]
        assert len(steps) == 5 and steps[-2] == "####"  # the answer line cut at the separator, as a run cuts it
        carry, labels = 0, []
        for i, step in enumerate(steps[:-2]):
            labels.append(step == expected_step(p, i, carry))
            carry = int(step[-2:]) // 10
        labels += [True, int(steps[-1]) == p.a + p.b]
        assert r["labels"] == labels, r
        wrong_steps += labels.count(False)
        if all(labels):
            assert preference.STEP_SEPARATOR.join(steps) == arithmetic.worked_solution(p)
    assert wrong_steps > 100
    # every set reads and encodes with the built-in tokenizer
    tok = build_tokenizer()
    assert len(load_pairs(paths["pairs_eval"], tok, data())[0]) == 120
    assert len(load_unpaired(paths["unpaired_eval"], tok, data())[0]) == 120
    assert len(load_steps(paths["steps_eval"], tok, data(), separator=preference.STEP_SEPARATOR)[0]) == 120


def test_the_preference_sets_refuse_the_multiplication_task(tmp_path):
    with pytest.raises(ValueError, match="come from the addition task"):
        builtin.ensure_builtin_preference(BuiltinSpec(name="multiplication"), tmp_path)
