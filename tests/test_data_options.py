"""Data options beyond JSONL rows: a prompt-length limit that refuses or drops (never truncates),
and the formats the datasets library reads (Parquet, Arrow, save_to_disk directories) giving
exactly what the same rows in JSONL give, with file:row errors."""

from __future__ import annotations

import copy
import hashlib
import json
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import SMALL
from exactrl.algorithms.sft import demonstration
from exactrl.audit.manifest import file_sha256
from exactrl.data.batch import collate
from exactrl.data.encode import encode_prompts, encode_sft, load_prompts, load_sft, use_chat_template
from exactrl.data.files import read_rows
from exactrl.data.jsonl import DataError, Row
from exactrl.models.loading import load_tokenizer
from exactrl.tasks.tiny_model import save_tiny_model
from exactrl.tasks.tokenizer import save_tokenizer
from test_cli_failures import TINY, exactrl, one_line_error

SFT_ROWS = [{"prompt": "1+1=", "completion": "2"}, {"prompt": "12+345=", "completion": "357"},
            {"messages": [{"role": "user", "content": "9+9="}, {"role": "assistant", "content": "18"}]},
            {"prompt": "7=", "completion": "7"}]


def data(max_length=64, max_prompt_length=None, over_length="error"):
    return SimpleNamespace(max_length=max_length, max_prompt_length=max_prompt_length, over_length=over_length)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------- data.max_prompt_length


def test_a_prompt_past_max_prompt_length_is_an_error_naming_the_row_and_its_length(tmp_path, tokenizer):
    p = write_jsonl(tmp_path / "rl.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "123+456=", "answer": "579"}])
    with pytest.raises(DataError,
                       match=rf"{p}:2: prompt of 8 tokens exceeds data.max_prompt_length=6; .*data.over_length=drop"):
        load_prompts(p, tokenizer, data(max_prompt_length=6))
    assert [x.text for x in load_prompts(p, tokenizer, data(max_prompt_length=8))[0]] == ["1+1=", "123+456="]


def test_sft_prompts_count_the_tokens_before_the_first_one_learnt(tokenizer):
    """{prompt, completion}: the prompt; {messages}: everything up to the assistant's content
    (the rendered user turn and the generation prompt)."""
    rows = [Row(f"x:{i + 1}", r) for i, r in enumerate(SFT_ROWS)]
    lengths = [e.loss_mask.index(1) for e in encode_sft(rows, tokenizer, 64)]
    assert lengths == [4, 7, 1 + 4 + 1, 2]  # <|user|> 9+9= <|assistant|>
    with pytest.raises(DataError, match="x:3: prompt of 6 tokens exceeds data.max_prompt_length=5"):
        encode_sft(rows[2:], tokenizer, 64, max_prompt_length=5)


def test_drop_leaves_out_over_length_rows_and_counts_them(tmp_path, tokenizer):
    rows = [*SFT_ROWS, {"prompt": "1+1=", "completion": "2" * 80}]
    p = write_jsonl(tmp_path / "sft.jsonl", rows)
    examples, note = load_sft(p, tokenizer, data(max_prompt_length=6, over_length="drop"))
    assert [e.source for e in examples] == [f"{p}:1", f"{p}:3", f"{p}:4"]
    assert note == (f"note: dropped 2 of 5 rows of '{p}' longer than data.max_length=64 or data.max_prompt_length=6 "
                    f"tokens (data.over_length=drop; the first: {p}:2)")
    assert load_sft(p, tokenizer, data(max_length=128))[1] is None
    p = write_jsonl(tmp_path / "rl.jsonl", [{"prompt": t} for t in ("1+1=", "123+4567=", "7=", "123+4567=")])
    prompts, note = load_prompts(p, tokenizer, data(max_length=8, over_length="drop"), first=3)
    assert [x.source for x in prompts] == [f"{p}:1", f"{p}:3"] and note.startswith("note: dropped 1 of 3 rows")
    with pytest.raises(DataError, match=rf"every row of '{p}' \(4\) is longer than data.max_length=2 tokens"):
        load_prompts(p, tokenizer, data(max_length=2, over_length="drop"))


def test_the_cli_refuses_or_drops_long_prompts(tmp_path):
    save_tiny_model(tmp_path / "model", save_tokenizer(tmp_path / "model"), **SMALL)
    p = write_jsonl(tmp_path / "rl.jsonl", [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(8)]
                    + [{"prompt": "1" * 30 + "+1=", "answer": "2"}])
    base = ["rl", *TINY, "algo.group_size=4", f"model.path={tmp_path / 'model'}", f"data.train={p}",
            "data.max_prompt_length=16"]
    err = one_line_error(exactrl([*base, f"output_dir={tmp_path / 'a'}"], tmp_path, tmp_path / "cache"), 2)
    assert f"{p}:9: prompt of 33 tokens exceeds data.max_prompt_length=16" in err
    run = exactrl([*base, "data.over_length=drop", "train.max_steps=1", "rollout.max_new_tokens=4",
                   f"output_dir={tmp_path / 'b'}"], tmp_path, tmp_path / "cache")
    assert run.returncode == 0, run.stderr[-2000:]
    assert (f"note: dropped 1 of 9 rows of '{p}' longer than data.max_length=256 or data.max_prompt_length=16"
            in run.stderr)
    assert (tmp_path / "b" / "final").is_dir()


# ---------------------------------------------------------------- data.chat_template

TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}"
            "[{{ m['role'] }}]{{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.mark.parametrize("as_file", [True, False])
def test_a_chat_template_override_renders_chat_rows(tmp_path, tokenizer, as_file):
    tok = copy.deepcopy(tokenizer)
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    use_chat_template(tok, str(tmp_path / "chat.jinja") if as_file else TEMPLATE)
    (sft,) = encode_sft([Row("x:1", SFT_ROWS[2])], tok, 64)
    assert tok.decode(sft.input_ids) == "[user]9+9=[assistant]18<eos>"
    assert tok.decode([t for t, m in zip(sft.input_ids, sft.loss_mask) if m]) == "18<eos>"
    (rl,) = encode_prompts([Row("x:1", {"prompt": [{"role": "user", "content": "1+1="}]})], tok, 64)
    assert rl.text == "[user]1+1=[assistant]"
    assert encode_prompts([Row("x:1", {"prompt": "1+1="})], tok, 64)[0].text == "1+1="  # plain prompts stay plain


def test_a_chat_template_that_fails_names_the_row_and_the_template(tmp_path, tokenizer):
    tok = copy.deepcopy(tokenizer)
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    use_chat_template(tok, str(tmp_path / "chat.jinja"))
    system = {"messages": [{"role": "system", "content": "be brief"}, *SFT_ROWS[2]["messages"]]}
    with pytest.raises(DataError, match=rf"^x:2: the chat template \({tmp_path}/chat.jinja\) fails on this row: "
                                        "no system turns$"):
        encode_sft([Row("x:1", SFT_ROWS[2]), Row("x:2", system)], tok, 64)
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
    use_chat_template(tok, str(tmp_path / "bad.jinja"))
    with pytest.raises(DataError, match=rf"^x:1: the chat template \({tmp_path}/bad.jinja:2\) fails on this row: "
                                        "unexpected '}'$"):
        encode_sft([Row("x:1", SFT_ROWS[2])], tok, 64)
    with pytest.raises(DataError, match="data.chat_template=missing.jinja: no such file, and not a Jinja template"):
        use_chat_template(tok, "missing.jinja")


def test_the_cli_trains_with_the_template_and_saves_it(tmp_path):
    save_tiny_model(tmp_path / "model", save_tokenizer(tmp_path / "model"), **SMALL)
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    p = write_jsonl(tmp_path / "chat.jsonl", [SFT_ROWS[2]] * 8)
    run = exactrl(["sft", *TINY, f"model.path={tmp_path / 'model'}", f"data.train={p}", "train.max_steps=1",
                   f"data.chat_template={tmp_path / 'chat.jinja'}", f"output_dir={tmp_path / 'run'}"],
                  tmp_path, tmp_path / "cache")
    assert run.returncode == 0, run.stderr[-2000:]
    assert load_tokenizer(tmp_path / "run" / "final").chat_template == TEMPLATE


# ---------------------------------------------------------------- Parquet, Arrow, save_to_disk


def write_formats(tmp_path, rows) -> dict:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = dict.fromkeys(k for r in rows for k in r)  # pa.Table.from_pylist would take the first row's keys only
    table = pa.table({c: [r.get(c) for r in rows] for c in columns})
    pq.write_table(table, tmp_path / "rows.parquet")
    # A given fingerprint: datasets 5.2's own (dill hashing of the table) fails on this Python with
    # "Can't pickle <class 'MonthDayNano'>"; reading a saved directory does not hash.
    datasets.Dataset(table, fingerprint="test-rows").save_to_disk(str(tmp_path / "saved"))
    with pa.OSFile(str(tmp_path / "rows.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)  # Feather v2 / IPC file format; save_to_disk's shards are the stream format
    shard = next((tmp_path / "saved").glob("*.arrow"))
    return {"jsonl": write_jsonl(tmp_path / "rows.jsonl", rows), "parquet": tmp_path / "rows.parquet",
            "arrow": tmp_path / "rows.arrow", "arrow stream": shard, "save_to_disk": tmp_path / "saved"}


def test_every_format_gives_the_batches_jsonl_gives(tmp_path, tokenizer):
    files = write_formats(tmp_path, SFT_ROWS)
    batches = {}
    for kind, path in files.items():
        examples = encode_sft(read_rows(path), tokenizer, 64)
        batches[kind] = collate([demonstration(e) for e in examples], tokenizer.pad_token_id)
    for kind, batch in batches.items():
        assert batch.keys() == batches["jsonl"].keys()
        assert all(torch.equal(batch[k], batches["jsonl"][k]) for k in batch), kind
    # A column holds one type: chat prompts in one file, plain ones in another.
    for name, rl in {"plain": [{"prompt": "1+1=", "answer": "2"}, {"prompt": "3+4=", "answer": "7"}],
                     "chat": [{"prompt": [{"role": "user", "content": t}], "answer": a} for t, a in (("1+1=", "2"), (
                         "3+4=", "7"))]}.items():
        (tmp_path / name).mkdir()
        text = "{}" if name == "plain" else "<|user|>{}<|assistant|>"
        want = [(tokenizer(text.format(t))["input_ids"], a) for t, a in (("1+1=", "2"), ("3+4=", "7"))]
        for kind, path in write_formats(tmp_path / name, rl).items():
            assert [(x.input_ids, x.answer) for x in encode_prompts(read_rows(path), tokenizer, 64)] == want, (
                name, kind)


def test_a_bad_row_in_a_parquet_file_is_named_by_file_and_row(tmp_path, tokenizer):
    files = write_formats(tmp_path, [*SFT_ROWS[:2], {"prompt": "2+2=", "completion": ""}])
    for kind in ("parquet", "save_to_disk"):
        with pytest.raises(DataError, match=rf"^{files[kind]}:row 2: 'completion' is empty$"):
            encode_sft(read_rows(files[kind]), tokenizer, 64)


def test_unreadable_files_are_one_line_errors(tmp_path):
    (tmp_path / "dir").mkdir()
    with pytest.raises(DataError, match="not a save_to_disk dataset"):
        read_rows(tmp_path / "dir")
    with pytest.raises(DataError, match="does not exist"):
        read_rows(tmp_path / "missing.parquet")
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="cannot read .*junk.parquet' as Parquet"):
        read_rows(tmp_path / "junk.parquet")
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    with pytest.raises(DataError, match="empty.parquet' has no rows"):
        read_rows(tmp_path / "empty.parquet")


def test_without_pyarrow_the_error_says_what_to_install(tmp_path, monkeypatch):
    (tmp_path / "rows.parquet").write_text("")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as on an install without it
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"rows.parquet' needs pyarrow: pip install .exactrl\[data\]."):
        read_rows(tmp_path / "rows.parquet")


def test_a_saved_dataset_directory_is_hashed_by_its_files(tmp_path):
    files = write_formats(tmp_path, SFT_ROWS)
    digest = file_sha256(files["save_to_disk"])
    shard = next(files["save_to_disk"].glob("*.arrow"))
    shard.write_bytes(shard.read_bytes() + b"x")
    assert file_sha256(files["save_to_disk"]) != digest
    assert file_sha256(files["jsonl"]) == hashlib.sha256(files["jsonl"].read_bytes()).hexdigest()
