"""Step-labelled rows for a process reward model, in TRL's stepwise-supervision format:
``{"prompt": str, "completions": [step, ...], "labels": [bool per step]}``.

As TRL's PRMTrainer does, the prompt is tokenised (with the tokenizer's special tokens), then each
step alone followed by the separator's tokens (``separator``, TRL's ``step_separator``, "\\n" by
default); a step's score is read at the last token of its separator, so the PRM sees the whole step
before it scores it. A row past data.max_length is an error naming file:row, or left out
(over_length=drop), or (over_length=truncate) keeps the whole steps that fit and their labels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exactrl.data.batch import Sample
from exactrl.data.encode import FIX, OverLength, _char_limit, _ids, _keep
from exactrl.data.files import read_rows
from exactrl.data.jsonl import DataError, Row, require_str
from exactrl.data.preference import OVER_LENGTH, _check_chars, _prompt_ids, loaded_note


@dataclass(frozen=True)
class StepExample:
    input_ids: list[int]  # the prompt, then each step and its separator
    prompt_len: int  # the prompt's tokens at the start of input_ids
    positions: list[int]  # for each step, the index in input_ids of its separator's last token: where a PRM scores
    labels: list[bool]  # each step's label, aligned with positions
    source: str
    truncated: bool = False  # steps that did not fit data.max_length were left out (over_length=truncate)

    @property
    def targets(self) -> list[int]:
        """Each step's next-token target: a sample's target t predicts token t + 1, and a reward model's per-token
        field "scores" holds at target t the head at token t + 1 (workers/reward_model.py), so the head at the
        separator's last token (position p) sits at target p - 1."""
        return [p - 1 for p in self.positions]

    def sample(self) -> Sample:
        """The row as a Sample whose loss targets are exactly its steps' (one per step, the plan counts steps), each
        carrying its label in ``step_labels``; a text shown to the model, so a demonstration's."""
        mask, labels = [0] * (len(self.input_ids) - 1), torch.zeros(len(self.input_ids) - 1, dtype=torch.float32)
        for t, label in zip(self.targets, self.labels):
            mask[t], labels[t] = 1, float(label)
        return Sample(list(self.input_ids[: self.prompt_len]), list(self.input_ids[self.prompt_len :]),
                      source="demonstration", mask=tuple(mask), step_labels=labels)


def _steps(row: Row) -> tuple[list[str], list[bool]]:
    data = row.data
    for key in ("completions", "labels"):
        if key not in data:
            raise DataError(f"{row.source}: missing '{key}': a step-labelled row needs 'prompt', 'completions' (the "
                            f"steps) and 'labels' (true/false per step); it has {sorted(data)}")
    steps, labels = data["completions"], data["labels"]
    if not isinstance(steps, list) or not steps:
        raise DataError(f"{row.source}: 'completions' must be a non-empty list of step strings, got "
                        f"{type(steps).__name__ if not isinstance(steps, list) else 'an empty list'}")
    for i, s in enumerate(steps):
        if not isinstance(s, str) or not s.strip():
            raise DataError(f"{row.source}: completions[{i}] must be a step's text, got {s!r}")
    if not isinstance(labels, list):
        raise DataError(f"{row.source}: 'labels' must be a list of true/false, one per step, got "
                        f"{type(labels).__name__}")
    if len(labels) != len(steps):
        raise DataError(f"{row.source}: 'labels' has {len(labels)} entries for {len(steps)} steps in 'completions': "
                        "give one label per step")
    for i, x in enumerate(labels):
        if not isinstance(x, bool):
            raise DataError(f"{row.source}: labels[{i}] must be true or false, got {x!r}")
    return steps, labels


def encode_steps(rows: list[Row], tokenizer, max_length: int, max_prompt_length: int | None = None,
                 over_length: str = "error", dropped: list[str] | None = None, truncated: list[str] | None = None,
                 separator: str = "\n") -> list[StepExample]:
    if over_length not in OVER_LENGTH:
        raise ValueError(f"over_length must be one of {OVER_LENGTH}, got {over_length!r}")
    sep = _ids(tokenizer, separator, first=False)
    if not sep:
        raise DataError(f"the step separator {separator!r} tokenises to nothing: choose one the tokenizer spells")
    limit = _char_limit(tokenizer, max_length)

    def encode(row: Row) -> StepExample:
        _check_chars(row, limit, max_length, over_length)
        if "prompt" not in row.data:
            raise DataError(f"{row.source}: missing 'prompt': a step-labelled row needs 'prompt', 'completions' and "
                            f"'labels'; it has {sorted(row.data)}")
        prompt = _prompt_ids(row, tokenizer, require_str(row, "prompt", allow_empty=True))
        steps, labels = _steps(row)
        if max_prompt_length is not None and len(prompt) > max_prompt_length:
            raise OverLength(f"{row.source}: prompt of {len(prompt)} tokens exceeds data.max_prompt_length="
                             f"{max_prompt_length}; {FIX}")
        ids, positions = list(prompt), []
        for step in steps:
            piece = _ids(tokenizer, step, first=False) + sep
            if len(ids) + len(piece) > max_length:
                break
            ids += piece
            positions.append(len(ids) - 1)
        cut = len(positions) < len(steps)
        if cut and over_length != "truncate":
            total = len(prompt) + sum(len(_ids(tokenizer, s, first=False)) + len(sep) for s in steps)
            raise OverLength(f"{row.source}: {total} tokens exceed data.max_length={max_length}; raise the limit, "
                             "shorten the row, or set data.over_length=drop or truncate")
        if not positions:
            raise OverLength(f"{row.source}: not even the first step fits data.max_length={max_length} after a prompt "
                             f"of {len(prompt)} tokens; raise the limit or set data.over_length=drop")
        if cut and truncated is not None:
            truncated.append(row.source)
        return StepExample(ids, len(prompt), positions, labels[: len(positions)], row.source, cut)

    return _keep(rows, encode, "drop" if over_length == "drop" else "error", dropped)


def load_steps(path, tokenizer, data, separator: str = "\n") -> tuple[list[StepExample], str | None]:
    """The step-labelled rows of the file at ``path`` as the ``data`` config section limits them,
    and a note of the rows dropped or cut (None: none)."""
    rows, dropped, truncated = read_rows(path), [], []
    examples = encode_steps(rows, tokenizer, data.max_length, data.max_prompt_length, data.over_length, dropped,
                            truncated, separator)
    return examples, loaded_note(path, data, len(rows), dropped, truncated)
