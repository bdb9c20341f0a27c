"""Turn rows into token ids with a loss mask (SFT) or prompts with answers (RL).

SFT rows: ``{"prompt", "completion"}`` (plain text, completion ends with EOS) or
``{"messages": [{"role", "content"}, ...]}`` (the tokenizer's chat template; the loss covers
assistant turns only: a "tool" message, a tool's result shown to the model, is context like a
user's). RL rows: ``{"prompt": str | messages, "answer": optional}``, and for the mixed-policy
methods a demonstration of the answer with each: ``{"prompt", "answer", "demonstration": str}`` or
``{"messages": [..., {"role": "assistant", ...}], "answer"}`` (the last message is the
demonstration, the turns before it the prompt).
Prompt and completion are tokenised separately, exactly as RL sees them (prompt alone, then
generated tokens), so SFT and RL agree on token boundaries.

A row longer than data.max_length, or whose prompt (the tokens before the first one SFT learns;
RL's whole prompt) is longer than data.max_prompt_length, is never truncated: it is an error
naming file:row and its length, or (data.over_length=drop) left out and counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from jinja2 import TemplateError, TemplateSyntaxError

from exactrl.data.files import read_rows
from exactrl.data.jsonl import DataError, Row, require_str

ROLES = ("system", "user", "assistant", "tool")


class OverLength(DataError):
    """A row past data.max_length or data.max_prompt_length (dropped under data.over_length=drop)."""


# How an over-length error tells the user out.
FIX = "raise the limit, shorten the row, or set data.over_length=drop"


@dataclass(frozen=True)
class SFTExample:
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the token is a target of the loss (aligned with input_ids)
    source: str

    @property
    def loss_tokens(self) -> int:
        return sum(self.loss_mask[1:])  # the first token is never a target


@dataclass(frozen=True)
class Prompt:
    input_ids: list[int]
    text: str
    answer: str | None
    source: str
    # a worked answer to learn from (mixed-policy methods), tokenised like an SFT completion:
    # no special tokens, then EOS; None: the row has none
    demonstration: list[int] | None = None
    # the row's other columns, for an environment's reset (envs/base.py): its task id, its documents, ...
    columns: dict | None = None


def _ids(tokenizer, text: str, first: bool) -> list[int]:
    # Only the first segment gets the tokenizer's own special tokens (e.g. Llama's BOS).
    return tokenizer(text, add_special_tokens=first)["input_ids"]


def _check_messages(row: Row, messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{row.source}: 'messages' must be a non-empty list of {{role, content}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DataError(f"{row.source}: messages[{i}] must be {{'role': one of {ROLES}, 'content': str}}, got "
                            f"{m!r}")
    return messages


def use_chat_template(tokenizer, template: str) -> None:
    """Render chat rows with ``template`` (data.chat_template: the Jinja text itself, or a file
    holding it) instead of the tokenizer's own; the run's saved tokenizer keeps it."""
    if "{{" in template or "{%" in template:
        text, origin = template, "data.chat_template"
    else:
        p = Path(template)
        if not p.is_file():
            raise DataError(f"data.chat_template={template}: no such file, and not a Jinja template (no {{{{ or {{%)")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise DataError(f"data.chat_template={template}: not UTF-8 text") from None
        origin = str(p)
    tokenizer.chat_template = text
    tokenizer.exactrl_template_origin = origin  # named in render errors


def _render(tokenizer, messages: list[dict], row: Row, add_generation_prompt: bool = False, tools=None) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{row.source}: 'messages' rows need a chat template; the tokenizer has none: set "
                        "data.chat_template to a Jinja file")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **({"tools": tools} if tools else {}))
    except TemplateError as e:  # a syntax error, an undefined name, the template's own raise_exception
        origin = getattr(tokenizer, "exactrl_template_origin", "the tokenizer's chat template")
        if isinstance(e, TemplateSyntaxError) and e.lineno:
            origin = f"{origin}:{e.lineno}"
        raise DataError(f"{row.source}: the chat template ({origin}) fails on this row: {e.message or e}") from None


def _encode_messages(row: Row, tokenizer) -> tuple[list[int], list[int]]:
    messages = _check_messages(row, row.data["messages"])
    if messages[-1]["role"] != "assistant":
        raise DataError(f"{row.source}: the last message must be the assistant's (it is what SFT learns)")
    ids, mask, done = [], [], ""
    for i, m in enumerate(messages):
        segments = []
        if m["role"] == "assistant":
            segments.append((_render(tokenizer, messages[:i], row, add_generation_prompt=True), 0))
        segments.append((_render(tokenizer, messages[: i + 1], row), int(m["role"] == "assistant")))
        for text, is_target in segments:
            if not text.startswith(done):
                raise DataError(f"{row.source}: the chat template does not render turn {i} as an extension of the "
                                "turns before it")
            piece = _ids(tokenizer, text[len(done) :], first=not ids)
            ids += piece
            mask += [is_target] * len(piece)
            done = text
    return ids, mask


def _char_limit(tokenizer, max_length: int) -> int:
    """Characters that cannot fit in ``max_length`` tokens: no token spells more characters than
    its vocabulary string has (byte-level BPE strings spell each byte, SentencePiece's a
    character), so a longer text is refused before tokenising it (a 100 MB row would OOM).
    Twice that, for normalisers that drop characters (whitespace collapsing)."""
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return 2 * max_length * max(longest, 1)


def _check_size(row: Row, limit: int, max_length: int) -> None:
    data = row.data
    texts = [data.get("prompt"), data.get("completion"), data.get("demonstration")]
    for m in (data.get("messages"), data.get("prompt")):
        if isinstance(m, list):
            texts += [x.get("content") for x in m if isinstance(x, dict)]
    chars = sum(len(t) for t in texts if isinstance(t, str))
    if chars > limit:
        raise OverLength(f"{row.source}: {chars:,} characters cannot fit in data.max_length={max_length} tokens "
                         f"(at most {limit:,} for this tokenizer); {FIX}")


def _keep(rows: list[Row], encode, over_length: str, dropped: list[str] | None) -> list:
    """``encode`` of every row; an over-length row raises, or (``over_length`` drop) is left out
    and its file:row appended to ``dropped``."""
    out = []
    for row in rows:
        try:
            out.append(encode(row))
        except OverLength:
            if over_length != "drop":
                raise
            if dropped is not None:
                dropped.append(row.source)
    return out


def encode_sft(rows: list[Row], tokenizer, max_length: int, max_prompt_length: int | None = None,
               over_length: str = "error", dropped: list[str] | None = None) -> list[SFTExample]:
    limit = _char_limit(tokenizer, max_length)

    def encode(row: Row) -> SFTExample:
        _check_size(row, limit, max_length)
        if "messages" in row.data:
            ids, mask = _encode_messages(row, tokenizer)
        elif "prompt" in row.data and "completion" in row.data:
            p = _ids(tokenizer, require_str(row, "prompt", allow_empty=True), first=True)
            if not p:  # nothing would predict the first completion token: start from BOS
                if tokenizer.bos_token_id is None:
                    raise DataError(f"{row.source}: empty prompt and the tokenizer has no BOS token to start from")
                p = [tokenizer.bos_token_id]
            c = _ids(tokenizer, require_str(row, "completion"), first=False) + [tokenizer.eos_token_id]
            ids, mask = p + c, [0] * len(p) + [1] * len(c)
        else:
            raise DataError(f"{row.source}: an SFT row needs 'prompt' and 'completion', or 'messages'; it has "
                            f"{sorted(row.data)}")
        if sum(mask[1:]) == 0:
            raise DataError(f"{row.source}: no completion tokens to learn from")
        if len(ids) > max_length:
            raise OverLength(f"{row.source}: {len(ids)} tokens exceed data.max_length={max_length}; {FIX}")
        prompt = mask.index(1)  # the tokens before the first one learnt
        if max_prompt_length is not None and prompt > max_prompt_length:
            raise OverLength(f"{row.source}: prompt of {prompt} tokens exceeds "
                             f"data.max_prompt_length={max_prompt_length}; {FIX}")
        return SFTExample(ids, mask, row.source)

    return _keep(rows, encode, over_length, dropped)


def _demonstration(row: Row, tokenizer) -> tuple[object, list[int] | None]:
    """The row's prompt (text or messages) and its demonstration's ids, if it has one: a
    ``demonstration`` string, or a ``messages`` row's last turn, the assistant's."""
    data = row.data
    if "messages" in data:
        if "prompt" in data:
            raise DataError(f"{row.source}: a row has 'prompt' or 'messages', not both")
        messages = _check_messages(row, data["messages"])
        if len(messages) < 2 or messages[-1]["role"] != "assistant":
            raise DataError(f"{row.source}: a 'messages' row of prompts ends with the assistant's demonstration, "
                            "after at least one turn of prompt")
        if not messages[-1]["content"].strip():
            raise DataError(f"{row.source}: the last message, the demonstration, is empty")
        # what SFT learns of that turn: the template's rendering of it, end-of-turn markers included
        head = _render(tokenizer, messages[:-1], row, add_generation_prompt=True)
        whole = _render(tokenizer, messages, row)
        if not whole.startswith(head):
            raise DataError(f"{row.source}: the chat template does not render the last turn as an extension of the "
                            "turns before it")
        return messages[:-1], _ids(tokenizer, whole[len(head) :], first=False)
    if "demonstration" not in data:
        return data.get("prompt"), None
    text = require_str(row, "demonstration")
    if not text.strip():
        raise DataError(f"{row.source}: 'demonstration' is blank: a demonstration needs its text")
    return data.get("prompt"), _ids(tokenizer, text, first=False) + [tokenizer.eos_token_id]


def encode_prompts(rows: list[Row], tokenizer, max_length: int, max_prompt_length: int | None = None,
                   over_length: str = "error", dropped: list[str] | None = None, tools=None) -> list[Prompt]:
    """``tools``: OpenAI-style schemas the chat template renders into message prompts (env.tools)."""
    limit = _char_limit(tokenizer, max_length)

    def encode(row: Row) -> Prompt:
        _check_size(row, limit, max_length)
        raw, demonstration = _demonstration(row, tokenizer)
        if isinstance(raw, list):
            text = _render(tokenizer, _check_messages(row, raw), row, add_generation_prompt=True, tools=tools)
        else:
            text = require_str(row, "prompt")
        answer = row.data.get("answer")
        if answer is not None and not isinstance(answer, (str, int, float)):
            raise DataError(f"{row.source}: 'answer' must be a string or number, got {type(answer).__name__}")
        ids = _ids(tokenizer, text, first=True)
        if len(ids) >= max_length:
            raise OverLength(f"{row.source}: prompt of {len(ids)} tokens leaves no room under "
                             f"data.max_length={max_length}; {FIX}")
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            raise OverLength(f"{row.source}: prompt of {len(ids)} tokens exceeds data.max_prompt_length="
                             f"{max_prompt_length}; {FIX}")
        if demonstration is not None and len(ids) + len(demonstration) > max_length:
            raise OverLength(f"{row.source}: prompt and demonstration of {len(ids) + len(demonstration)} tokens "
                             f"exceed data.max_length={max_length}; {FIX}")
        columns = {k: v for k, v in row.data.items() if k not in ("prompt", "answer", "messages", "demonstration")}
        return Prompt(ids, text, None if answer is None else str(answer), row.source, demonstration, columns or None)

    return _keep(rows, encode, over_length, dropped)


def _dropped_note(dropped: list[str], total: int, path, data) -> str | None:
    if not dropped:
        return None
    limits = f"data.max_length={data.max_length}" + (f" or data.max_prompt_length={data.max_prompt_length}"
                                                      if data.max_prompt_length is not None else "")
    if len(dropped) == total:
        raise OverLength(f"every row of '{path}' ({total}) is longer than {limits} tokens, so data.over_length=drop "
                         "left none; raise the limit")
    return (f"note: dropped {len(dropped)} of {total} rows of '{path}' longer than {limits} tokens "
            f"(data.over_length=drop; the first: {dropped[0]})")


def load_sft(path, tokenizer, data) -> tuple[list[SFTExample], str | None]:
    """The SFT examples of the file at ``path`` as the ``data`` config section limits them, and
    the note saying how many rows were dropped (None: none)."""
    rows, dropped = read_rows(path), []
    examples = encode_sft(rows, tokenizer, data.max_length, data.max_prompt_length, data.over_length, dropped)
    return examples, _dropped_note(dropped, len(rows), path, data)


def load_prompts(path, tokenizer, data, first: int | None = None, tools=None) -> tuple[list[Prompt], str | None]:
    """``load_sft`` for prompts (rl's training prompts, the eval set's ``first`` rows); ``tools`` as encode_prompts."""
    rows, dropped = read_rows(path)[:first], []
    prompts = encode_prompts(rows, tokenizer, data.max_length, data.max_prompt_length, data.over_length, dropped,
                             tools)
    return prompts, _dropped_note(dropped, len(rows), path, data)
