"""A character-level tokenizer for the built-in task, built locally with `tokenizers`.

Saved with ``save_pretrained`` as a Hugging Face fast tokenizer (tokenizer.json plus a
chat template) so that every later load goes through ``AutoTokenizer.from_pretrained``,
the same path a hub checkpoint's tokenizer takes.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

if TYPE_CHECKING:  # imported where used: the config's help reads VOCAB_SIZE without transformers
    from transformers import PreTrainedTokenizerFast

SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
CHARS = list(string.digits + string.ascii_lowercase + string.ascii_uppercase + " +-*/=#,.:;!?()[]{}'\"\n\\^_<>|$%&@~`")
VOCAB_SIZE = len(SPECIAL) + len(CHARS)

# Messages render as <|role|>content; an assistant turn ends with <eos> so a model trained on
# rendered conversations learns to stop. add_generation_prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + CHARS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # Special tokens are matched whole before this split runs; every other character is a token.
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|user|>", "<|assistant|>", "<|system|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def save_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    from transformers import AutoTokenizer

    build_tokenizer().save_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path))
