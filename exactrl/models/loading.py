"""Loading models and tokenizers from local directories, the path every checkpoint takes."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer

from exactrl.data.encode import use_chat_template
from exactrl.device import place
from exactrl.models import packing


class ModelLoadError(ValueError):
    """A model directory that cannot be loaded; the message says what is missing."""


# What a tokenizer is made from: a fast tokenizer's one file, or a slow one's vocabulary (sentencepiece, BPE,
# WordPiece, tiktoken) that transformers converts.
TOKENIZER_FILES = ("tokenizer.json", "*.model", "vocab.json", "vocab.txt", "merges.txt", "*.tiktoken")


def _load_error(what: str, p: Path, e: Exception, trust_remote_code: bool) -> ModelLoadError:
    """One line for a failed from_pretrained. Custom code (an auto_map in config.json or
    tokenizer_config.json) runs only when asked: trust_remote_code=False makes transformers
    refuse at once instead of asking on the terminal, and the refusal names the key to set."""
    if not trust_remote_code and "trust_remote_code" in str(e):
        code = sorted(f.name for f in p.glob("*.py"))
        return ModelLoadError(f"'{p}' holds its own model code ({', '.join(code) or 'auto_map'}), which loading it "
                              "runs: set model.trust_remote_code=true if you trust that code")
    return ModelLoadError(f"cannot load {what} '{p}': {' '.join(str(e).split())}")


def load_tokenizer(path: str | Path, trust_remote_code: bool = False, chat_template: str | None = None):
    """The tokenizer in ``path``; ``chat_template`` (data.chat_template: Jinja text or a file) replaces its own."""
    p = Path(path)
    if not p.is_dir():
        raise ModelLoadError(f"model.path '{p}' is not a directory (exactrl loads local Hugging Face checkpoints)")
    try:
        tok = AutoTokenizer.from_pretrained(str(p), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        if not any(next(p.glob(pattern), None) for pattern in TOKENIZER_FILES):  # else transformers blames
            # sentencepiece or tiktoken, which would only convert a slow tokenizer's files
            raise ModelLoadError(f"'{p}' holds no tokenizer files (tokenizer.json, or a slow tokenizer's "
                                 "tokenizer.model / vocab.json and merges.txt / vocab.txt, with "
                                 "tokenizer_config.json): copy them from the model it was made from") from None
        raise _load_error("a tokenizer from", p, e, trust_remote_code) from None
    if tok.pad_token_id is None:
        # Common for base LLMs: padding positions are masked everywhere, so EOS serves.
        tok.pad_token = tok.eos_token
    if tok.eos_token_id is None:
        raise ModelLoadError(f"the tokenizer in '{p}' has no EOS token; set eos_token in its tokenizer_config.json")
    if chat_template:
        use_chat_template(tok, chat_template)
    return tok


def load_causal_lm(path: str | Path, trainable: bool = True, attn: str = "sdpa", dropout: bool = False,
                   device: torch.device | None = None, trust_remote_code: bool = False) -> torch.nn.Module:
    """A causal LM in fp32 whose attention takes packed rows (``attn``: the kernel, sdpa or
    eager), with its dropout off unless ``dropout`` (see packing.disable_dropout), on ``device``
    (default: the CPU; exactrl/device.py); ``trust_remote_code``: run the directory's own
    modeling code (model.trust_remote_code)."""
    p = Path(path)
    if not (p / "config.json").is_file() and (p / "adapter_config.json").is_file():
        raise ModelLoadError(f"'{p}' holds a LoRA adapter, not a model: load its merged/ directory (written with "
                             "model.lora.merge_on_save=true), or train from its base model")
    if not (p / "config.json").is_file():
        raise ModelLoadError(f"'{p}' has no config.json: not a Hugging Face model directory")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, SafetensorError) as e:  # SafetensorError: a truncated or corrupt weights file
        raise _load_error("the model in", p, e, trust_remote_code) from None
    packing.enable(model, attn)
    if not dropout:
        packing.disable_dropout(model)
    model.train(trainable)
    if not trainable:
        model.requires_grad_(False)
    return place(model, device or torch.device("cpu"))


def load_value_model(path: str | Path, init_seed: int | None = None, attn: str = "sdpa",
                     device: torch.device | None = None, trust_remote_code: bool = False) -> torch.nn.Module:
    """A critic: the model's architecture with a scalar head per position (Hugging Face's
    *ForTokenClassification, num_labels=1, dropout off), from a causal-LM or a saved critic
    directory. A new head (from a causal LM) is initialised from ``init_seed`` -- weights
    N(0, 1/(hidden+1)^2) as in OpenRLHF's value head, bias 0 -- identically on every rank."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    p = Path(path)
    if not (p / "config.json").is_file():
        raise ModelLoadError(f"'{p}' has no config.json: not a Hugging Face model directory")
    try:
        config = AutoConfig.from_pretrained(str(p), num_labels=1, trust_remote_code=trust_remote_code)
        config.classifier_dropout = 0.0
        model, info = AutoModelForTokenClassification.from_pretrained(str(p), config=config, dtype=torch.float32,
                                                                      output_loading_info=True,
                                                                      trust_remote_code=trust_remote_code)
    except (OSError, ValueError, SafetensorError) as e:
        raise _load_error("a value model from", p, e, trust_remote_code) from None
    if any(k.startswith("score.") for k in info["missing_keys"]):
        g = torch.Generator().manual_seed(init_seed or 0)
        with torch.no_grad():
            hidden = model.score.weight.shape[1]
            model.score.weight.copy_(torch.randn(model.score.weight.shape, generator=g) / (hidden + 1))
            if model.score.bias is not None:
                model.score.bias.zero_()
    packing.enable(model, attn)
    packing.disable_dropout(model)
    model.train(True)
    return place(model, device or torch.device("cpu"))  # the head is initialised on the CPU: the same on every device


def tokenizer_mismatch(student, teacher) -> str | None:
    """What differs between two tokenizers that would make the same ids mean other tokens (None: nothing): a
    worker that reads another model's token ids as they are (a teacher, a reward model) needs none."""
    if student.get_vocab() != teacher.get_vocab():
        a, b = student.get_vocab(), teacher.get_vocab()
        moved = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])[:3]
        return f"vocabularies of {len(a)} and {len(b)} tokens differ, e.g. {moved}"
    for special in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(student, special) != getattr(teacher, special):
            return f"{special} {getattr(student, special)} against {getattr(teacher, special)}"
    return None
