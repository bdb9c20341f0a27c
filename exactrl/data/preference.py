"""Preference data: pairs (reward models, the DPO family) and unpaired labelled rows (KTO), read
and encoded with every problem reported as file:row before training starts.

Pairs, in TRL's preference formats (https://huggingface.co/docs/trl/dataset_formats):

* text: ``{"prompt": str, "chosen": str, "rejected": str}``, each answer ends with EOS;
* chat, explicit prompt: ``{"prompt": [messages], "chosen": [assistant message], "rejected": [...]}``;
* chat, implicit prompt: ``{"chosen": [messages], "rejected": [messages]}``, the two sharing every
  message but the last, the assistant's answer.

Any of them may carry ``"margin"``: a number (Bradley-Terry with margin, Llama 2's RM). Unpaired
rows (TRL's unpaired preference type): ``{"prompt", "completion", "label": true|false}``, text or
chat (``completion`` one assistant message). Other keys (ids, scores) are ignored.

The prompt is tokenised once and each answer after it (chat: the template's rendering of the
prompt with the assistant turn opened, then the rest of each whole conversation's rendering), so
both sides of a pair hold exactly the same prompt ids, and each side's loss mask is 1 on its
answer's tokens only: the rejected side's prompt is never trained on (OpenRLHF #294 did).

A row past data.max_length or data.max_prompt_length is an error naming file:row, or left out
(over_length=drop), or (over_length=truncate) has its answers cut at the end to fit, the prompt kept
whole and shared; a pair the cut cannot save (a prompt that leaves no room for an answer, answers
that become identical) is still an error, or dropped under drop. Truncated rows are counted in
the note a loader returns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from exactrl.data.batch import Sample
from exactrl.data.encode import FIX, ROLES, OverLength, _char_limit, _ids, _keep, _render
from exactrl.data.files import read_rows
from exactrl.data.jsonl import DataError, Row

SIDES = ("chosen", "rejected")
OVER_LENGTH = ("error", "drop", "truncate")


@dataclass(frozen=True)
class PairExample:
    """A pair as token ids: one prompt, two answers (EOS or the template's end of turn included)."""
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    source: str  # "file:line"
    margin: float | None = None  # the row's "margin" (None: it has none)
    truncated: bool = False  # an answer was cut to fit data.max_length (over_length=truncate)
    kind: str | None = None  # the row's "rejected_kind" (the built-in pairs': direct, working, answer): evaluation
    # reports the pairwise accuracy of each kind beside the whole

    def sequence(self, side: str) -> tuple[list[int], list[int]]:
        """``side``'s ids, prompt then answer, and its loss mask aligned with them (1 on the answer)."""
        answer = {"chosen": self.chosen_ids, "rejected": self.rejected_ids}[side]
        return self.prompt_ids + answer, [0] * len(self.prompt_ids) + [1] * len(answer)

    def samples(self) -> tuple[Sample, Sample]:
        """The pair as two samples of the typed batch, chosen first (the unit the step plan never splits)."""
        return _sample(self, "chosen"), _sample(self, "rejected")


@dataclass(frozen=True)
class UnpairedExample:
    """A prompt and one completion labelled desirable (True) or undesirable (False), as KTO trains on."""
    prompt_ids: list[int]
    completion_ids: list[int]
    label: bool
    source: str
    truncated: bool = False

    def sequence(self) -> tuple[list[int], list[int]]:
        return self.prompt_ids + self.completion_ids, [0] * len(self.prompt_ids) + [1] * len(self.completion_ids)

    def sample(self) -> Sample:
        """A sample whose source says its label: "chosen" for a desirable completion, else "rejected"."""
        mask = self.sequence()[1]
        return Sample(list(self.prompt_ids), list(self.completion_ids), source="chosen" if self.label else "rejected",
                      mask=tuple(mask[1:]))


def _sample(e: PairExample, side: str) -> Sample:
    ids, mask = e.sequence(side)
    # the mask on next-token targets: target t is token t + 1, so the prompt's last token predicts the answer's first
    return Sample(list(e.prompt_ids), ids[len(e.prompt_ids):], source=side, mask=tuple(mask[1:]),
                  margin=e.margin or 0.0)


def _prompt_ids(row: Row, tokenizer, text: str) -> list[int]:
    ids = _ids(tokenizer, text, first=True)
    if not ids:  # nothing would predict the answer's first token: start from BOS, as SFT does
        if tokenizer.bos_token_id is None:
            raise DataError(f"{row.source}: empty 'prompt' and the tokenizer has no BOS token to start from")
        ids = [tokenizer.bos_token_id]
    return ids


def _answer_message(row: Row, key: str, value) -> dict:
    """``value`` of an explicit-prompt chat row: a list holding the one assistant message."""
    if not isinstance(value, list) or len(value) != 1:
        raise DataError(f"{row.source}: '{key}' must be a list of one assistant message (the prompt is 'prompt'), "
                        f"got {_kind(value)}")
    message = _messages(row, key, value)[0]
    if message["role"] != "assistant":
        raise DataError(f"{row.source}: '{key}' must be the assistant's message, got role '{message['role']}'")
    return message


def _messages(row: Row, key: str, value: list) -> list[dict]:
    """``value``, a non-empty list of {role, content} messages; an error names the key and the message."""
    if not value:
        raise DataError(f"{row.source}: '{key}' is an empty list of messages")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DataError(f"{row.source}: {key}[{i}] must be {{'role': one of {ROLES}, 'content': str}}, got {m!r}")
    return value


def _kind(value) -> str:
    return f"a list of {len(value)}" if isinstance(value, list) else type(value).__name__


def _encode_answers(row: Row, tokenizer, keys: tuple[str, ...]) -> tuple[list[int], list[list[int]], list[str]]:
    """The prompt's ids (tokenised once), each answer's ids after them, and each answer's text."""
    data = row.data
    missing = [k for k in keys if k not in data]
    if missing:
        raise DataError(f"{row.source}: missing '{missing[0]}': a row needs {', '.join(repr(k) for k in keys)} "
                        f"(and 'prompt' unless the answers are whole conversations); it has {sorted(data)}")
    values = [data[k] for k in keys]
    if all(isinstance(v, str) for v in values):
        if "prompt" not in data:
            raise DataError(f"{row.source}: missing 'prompt': text answers need it (exactrl does not guess a prompt "
                            "from the texts' common start); give 'prompt', or the answers as message lists")
        prompt = data["prompt"]
        if not isinstance(prompt, str):
            raise DataError(f"{row.source}: 'prompt' must be a string when the answers are, got {_kind(prompt)}")
        for k, v in zip(keys, values):
            if not v.strip():
                raise DataError(f"{row.source}: '{k}' is empty: an answer needs its text")
        answers = [_ids(tokenizer, v, first=False) + [tokenizer.eos_token_id] for v in values]
        return _prompt_ids(row, tokenizer, prompt), answers, values
    for k, v in zip(keys, values):
        if not isinstance(v, (str, list)):
            raise DataError(f"{row.source}: '{k}' must be a string or a list of messages, got {type(v).__name__}")
    if not all(isinstance(v, list) for v in values):
        raise DataError(f"{row.source}: {' and '.join(repr(k) for k in keys)} must all be text or all message lists")
    if "prompt" in data:
        prompt = _messages(row, "prompt", data["prompt"]) if isinstance(data["prompt"], list) else None
        if prompt is None:
            raise DataError(f"{row.source}: 'prompt' must be a list of messages when the answers are, got "
                            f"{type(data['prompt']).__name__}")
        messages = [_answer_message(row, k, v) for k, v in zip(keys, values)]
    else:
        prompt, messages = _shared_prompt(row, keys, values)
    for k, m in zip(keys, messages):
        if not m["content"].strip():
            raise DataError(f"{row.source}: '{k}' is empty: the assistant's answer needs its text")
    head = _render(tokenizer, prompt, row, add_generation_prompt=True)
    answers = []
    for k, m in zip(keys, messages):
        whole = _render(tokenizer, prompt + [m], row)
        if not whole.startswith(head):  # the shared prompt ids below would not be what the template renders
            raise DataError(f"{row.source}: the chat template does not render '{k}' as an extension of the prompt "
                            "with the assistant's turn opened")
        answers.append(_ids(tokenizer, whole[len(head):], first=False))
    return _ids(tokenizer, head, first=True), answers, [m["content"] for m in messages]


def _shared_prompt(row: Row, keys: tuple[str, ...], values: list) -> tuple[list[dict], list[dict]]:
    """An implicit-prompt chat row: every conversation ends with the assistant's answer, and all
    share the messages before it, which are the prompt."""
    conversations = []
    for k, v in zip(keys, values):
        messages = _messages(row, k, v)
        if len(messages) < 2 or messages[-1]["role"] != "assistant":
            raise DataError(f"{row.source}: '{k}' must end with the assistant's answer after at least one message "
                            "of prompt (or give the prompt as 'prompt')")
        conversations.append(messages)
    first = conversations[0]
    for k, messages in zip(keys[1:], conversations[1:]):
        if len(messages) != len(first):
            raise DataError(f"{row.source}: '{keys[0]}' has {len(first)} messages and '{k}' {len(messages)}: a pair "
                            "shares every message but the last")
        for i, (a, b) in enumerate(zip(first[:-1], messages[:-1])):
            if (a["role"], a["content"]) != (b["role"], b["content"]):
                raise DataError(f"{row.source}: '{keys[0]}' and '{k}' differ at messages[{i}]: a pair shares every "
                                "message but the last (the prompt)")
    return first[:-1], [c[-1] for c in conversations]


def _margin(row: Row) -> float | None:
    value = row.data.get("margin")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DataError(f"{row.source}: 'margin' must be a finite number, got {value!r}")
    return float(value)


def _check_chars(row: Row, limit: int, max_length: int, over_length: str) -> None:
    """Refuse a row whose text cannot fit before tokenising it (a 100 MB row would exhaust memory).
    Under truncate a long answer is cut after tokenising, so answers may run 64 times as long."""
    def chars(value) -> int:
        if isinstance(value, str):
            return len(value)
        if isinstance(value, list):
            return sum(chars(m.get("content")) if isinstance(m, dict) else chars(m) for m in value)
        return 0

    answers = sum(chars(row.data.get(k)) for k in ("chosen", "rejected", "completion", "completions"))
    n = chars(row.data.get("prompt")) + (0 if over_length == "truncate" else answers)
    if n > limit or answers > 64 * limit:
        raise OverLength(f"{row.source}: {max(n, answers):,} characters cannot fit in data.max_length={max_length} "
                         f"tokens (at most {limit:,} for this tokenizer); {FIX}")


def _fit(row: Row, prompt: list[int], answers: list[list[int]], keys: tuple[str, ...], max_length: int,
         max_prompt_length: int | None, over_length: str) -> tuple[list[list[int]], bool]:
    """The answers within max_length beside the whole prompt (cut at the end under truncate), and
    whether any was cut."""
    if max_prompt_length is not None and len(prompt) > max_prompt_length:
        raise OverLength(f"{row.source}: prompt of {len(prompt)} tokens exceeds data.max_prompt_length="
                         f"{max_prompt_length}; {FIX}")
    room = max_length - len(prompt)
    longest = max(range(len(keys)), key=lambda i: len(answers[i]))
    if len(answers[longest]) <= room:
        return answers, False
    if over_length != "truncate":
        raise OverLength(f"{row.source}: prompt and '{keys[longest]}' of {len(prompt) + len(answers[longest])} tokens "
                         f"exceed data.max_length={max_length}; raise the limit, shorten the row, or set "
                         "data.over_length=drop or truncate")
    if room < 1:  # the prompt is never cut: both sides must keep the same one
        raise OverLength(f"{row.source}: prompt of {len(prompt)} tokens leaves no room for an answer under "
                         f"data.max_length={max_length}; raise the limit, shorten the prompt, or set "
                         "data.over_length=drop")
    cut = [a[:room] for a in answers]
    if len(cut) == 2 and cut[0] == cut[1]:
        raise OverLength(f"{row.source}: cut to data.max_length={max_length}, '{keys[0]}' and '{keys[1]}' are the same "
                         f"{room} tokens, so the pair says nothing; raise the limit or set data.over_length=drop")
    return cut, True


def encode_pairs(rows: list[Row], tokenizer, max_length: int, max_prompt_length: int | None = None,
                 over_length: str = "error", dropped: list[str] | None = None,
                 truncated: list[str] | None = None) -> list[PairExample]:
    """The pairs of ``rows``; the file:row of each dropped pair is appended to ``dropped``, of each
    truncated one to ``truncated``."""
    if over_length not in OVER_LENGTH:
        raise ValueError(f"over_length must be one of {OVER_LENGTH}, got {over_length!r}")
    limit = _char_limit(tokenizer, max_length)

    def encode(row: Row) -> PairExample:
        _check_chars(row, limit, max_length, over_length)
        margin = _margin(row)
        prompt, answers, texts = _encode_answers(row, tokenizer, SIDES)
        if texts[0] == texts[1] or answers[0] == answers[1]:
            raise DataError(f"{row.source}: 'chosen' and 'rejected' are the same answer: a pair must differ")
        answers, cut = _fit(row, prompt, answers, SIDES, max_length, max_prompt_length, over_length)
        if cut and truncated is not None:
            truncated.append(row.source)
        kind = row.data.get("rejected_kind")
        return PairExample(prompt, answers[0], answers[1], row.source, margin, cut, None if kind is None else str(kind))

    return _keep(rows, encode, "drop" if over_length == "drop" else "error", dropped)


def encode_unpaired(rows: list[Row], tokenizer, max_length: int, max_prompt_length: int | None = None,
                    over_length: str = "error", dropped: list[str] | None = None,
                    truncated: list[str] | None = None) -> list[UnpairedExample]:
    if over_length not in OVER_LENGTH:
        raise ValueError(f"over_length must be one of {OVER_LENGTH}, got {over_length!r}")
    limit = _char_limit(tokenizer, max_length)

    def encode(row: Row) -> UnpairedExample:
        _check_chars(row, limit, max_length, over_length)
        if "label" not in row.data:
            raise DataError(f"{row.source}: missing 'label': an unpaired row needs 'prompt', 'completion' and 'label' "
                            f"(true: desirable, false: undesirable); it has {sorted(row.data)}")
        label = row.data["label"]
        if not isinstance(label, bool):
            raise DataError(f"{row.source}: 'label' must be true or false, got {label!r}")
        prompt, answers, _ = _encode_answers(row, tokenizer, ("completion",))
        answers, cut = _fit(row, prompt, answers, ("completion",), max_length, max_prompt_length, over_length)
        if cut and truncated is not None:
            truncated.append(row.source)
        return UnpairedExample(prompt, answers[0], label, row.source, cut)

    return _keep(rows, encode, "drop" if over_length == "drop" else "error", dropped)


def loaded_note(path, data, total: int, dropped: list[str], truncated: list[str]) -> str | None:
    """What a loader left out or cut, in one line (None: nothing); every row left out is an error."""
    limits = f"data.max_length={data.max_length}" + (f" or data.max_prompt_length={data.max_prompt_length}"
                                                      if data.max_prompt_length is not None else "")
    if dropped and len(dropped) == total:
        raise OverLength(f"every row of '{path}' ({total}) is longer than {limits} tokens, so data.over_length=drop "
                         "left none; raise the limit")
    notes = []
    if dropped:
        notes.append(f"dropped {len(dropped)} of {total} rows of '{path}' longer than {limits} tokens "
                     f"(data.over_length=drop; the first: {dropped[0]})")
    if truncated:
        notes.append(f"cut the answers of {len(truncated)} of {total} rows of '{path}' at the end to fit "
                     f"data.max_length={data.max_length} (data.over_length=truncate; the first: {truncated[0]})")
    return "note: " + "; ".join(notes) if notes else None


def load_pairs(path, tokenizer, data) -> tuple[list[PairExample], str | None]:
    """The pairs of the file at ``path`` (JSONL, Parquet, Arrow, a save_to_disk directory) as the
    ``data`` config section limits them, and a note of the rows dropped or cut (None: none)."""
    rows, dropped, truncated = read_rows(path), [], []
    examples = encode_pairs(rows, tokenizer, data.max_length, data.max_prompt_length, data.over_length, dropped,
                            truncated)
    return examples, loaded_note(path, data, len(rows), dropped, truncated)


def load_unpaired(path, tokenizer, data) -> tuple[list[UnpairedExample], str | None]:
    """``load_pairs`` for unpaired labelled rows (KTO)."""
    rows, dropped, truncated = read_rows(path), [], []
    examples = encode_unpaired(rows, tokenizer, data.max_length, data.max_prompt_length, data.over_length, dropped,
                               truncated)
    return examples, loaded_note(path, data, len(rows), dropped, truncated)


def sampled_sets(prompt: str, answer, samples: list[tuple[str, bool]]) -> tuple[list[dict], list[dict]]:
    """A prompt's sampled answers ``samples`` ((text, right), in sample order) as preference rows: pairs of its
    i-th right answer against its i-th wrong one (as many as the scarcer side; an identical text is skipped),
    and every answer as an unpaired row labelled right or wrong."""
    right = [t for t, ok in samples if ok]
    wrong = [t for t, ok in samples if not ok]
    pairs = [{"prompt": prompt, "chosen": c, "rejected": r, "answer": answer, "rejected_kind": "sampled"}
             for c, r in zip(right, wrong) if c != r]
    return pairs, [{"prompt": prompt, "completion": t, "label": ok, "answer": answer} for t, ok in samples]
