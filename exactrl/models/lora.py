"""LoRA adapters through peft (model.lora.*): the base weights stay frozen, only the adapters
train, are checkpointed and saved.

* ``apply_lora`` wraps a loaded causal LM in a peft model (fresh adapters, or a checkpoint's
  for resume) before the packing self-check, so the check runs on the model that trains.
* ``reference_mode`` is the frozen reference of RL's KL term: the same model with its
  adapters switched off (peft's ``disable_adapter``), so no second copy is held in memory.
* ``write_adapter`` / ``write_merged``: the adapter in peft's format (adapter_config.json,
  adapter_model.safetensors), and optionally the base with the adapters merged in, built
  from the saved weights on a fresh copy so the live training model is never altered.
* ``load_adapted`` / ``merge_adapter``: a saved adapter on its base model, for `exactrl eval`
  and `exactrl merge` (which writes what merge_on_save writes, after the run).
* A value model (load_value_model's *ForTokenClassification: `exactrl rm`'s reward model) gets adapters on its
  body and its scalar head trained whole (peft's modules_to_save, as TRL's RewardTrainer under task_type SEQ_CLS):
  a new head has nothing to adapt. Its final model is saved merged (``merged_only``), a plain reward model.

peft is an optional extra (``pip install exactrl[lora]``); it is imported only when asked for.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import torch

from exactrl.config.loader import ConfigError
from exactrl.models.loading import ModelLoadError, load_causal_lm

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


class LoraError(ModelLoadError):
    """A model.lora.* setting that does not fit the model, or an adapter checkpoint that does not fit the run."""


def is_peft(model) -> bool:
    """Whether ``model`` is a peft model (a model built before peft was ever imported is not)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def _peft():
    try:
        import peft
    except ImportError:
        raise LoraError("model.lora.rank > 0 needs peft: pip install 'exactrl[lora]' "
                        "(or peft from requirements.txt)") from None
    return peft


def base_model(model):
    """The Hugging Face model inside a peft model (``model`` itself otherwise)."""
    return model.get_base_model() if is_peft(model) else model


def value_head(model) -> str | None:
    """The name of a value model's scalar head (load_value_model's *ForTokenClassification: 'score'), trained whole
    beside the adapters; None for a causal LM (its head is the output embeddings)."""
    if model.get_output_embeddings() is None and isinstance(getattr(model, "score", None), torch.nn.Module):
        return "score"
    return None


def _head(model):
    head = model.get_output_embeddings()
    return head if head is not None else getattr(model, value_head(model) or "", None)


def linear_names(model) -> list[str]:
    """Dotted names of the linear layers an adapter could go on: every nn.Linear (and GPT-2's
    Conv1D, a linear layer with transposed weights) but the output head (a value model's scalar head)."""
    from transformers.pytorch_utils import Conv1D

    head = _head(model)
    return [n for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, Conv1D)) and m is not head]


def check_targets(model, targets: str | list[str]) -> None:
    """Refuse target module names that match no linear layer of ``model`` (peft would skip them silently)."""
    if targets == "all-linear":
        return
    names = linear_names(model)
    head = next((n for n, m in model.named_modules() if m is _head(model)), None)
    for t in [targets] if isinstance(targets, str) else targets:
        if head is not None and (head == t or head.endswith("." + t)):
            raise LoraError(f"model.lora.target_modules: '{t}' is the output head ({head}), "
                            "which cannot take an adapter" + (" (a value model's head trains whole)"
                                                              if value_head(model) else ""))
        if not any(n == t or n.endswith("." + t) for n in names):
            known = sorted({n.rsplit(".", 1)[-1] for n in names})
            raise LoraError(f"model.lora.target_modules: '{t}' matches no linear layer of the model; "
                            f"it has {', '.join(known)}")


def apply_lora(model, lora, checkpoint: str | Path | None = None):
    """``model`` with adapters per ``lora`` (a LoraConfig) on its target layers, base weights
    frozen; ``checkpoint``: a directory whose adapter weights replace the fresh ones (resume)."""
    peft = _peft()
    check_targets(model, lora.target_modules)
    head = value_head(model)
    # A value model's head is new (or a reward model's own): trained whole, never adapted (peft's all-linear would
    # adapt it, as it leaves out only the output embeddings and a SEQ_CLS head).
    kind = {"task_type": "CAUSAL_LM"} if head is None else {"modules_to_save": [head], "exclude_modules": [head]}
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none",
                             target_modules=lora.target_modules, **kind)
    trainable = model.training
    with warnings.catch_warnings():  # peft 0.21 asks transformers 5 a deprecated question; nothing for the user to do
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        model = peft.get_peft_model(model, config)
    model.train(trainable)
    if checkpoint is not None:
        load_adapter(model, Path(checkpoint))
    return model


def load_adapter(model, directory: Path) -> None:
    """Load a checkpoint's adapter weights into ``model``; every adapter tensor must be there, with its shape."""
    from safetensors.torch import load_file

    peft = _peft()
    path = directory / ADAPTER_WEIGHTS
    if not path.is_file():
        raise LoraError(f"train.resume_from: '{directory}' holds no {ADAPTER_WEIGHTS}: not a checkpoint of a LoRA "
                        "run (model.lora.rank must be what the resumed run used)")
    saved = load_file(str(path))
    want = peft.get_peft_model_state_dict(model)
    if saved.keys() != want.keys() or any(saved[k].shape != want[k].shape for k in want):
        raise LoraError(f"train.resume_from: the adapter in '{path}' does not fit model.lora.* of this run "
                        f"({len(saved)} tensors saved, {len(want)} expected); resume with the run's own LoRA settings")
    peft.set_peft_model_state_dict(model, saved)


def reference_mode(model):
    """The context in which ``model``'s forward is the frozen base model's: adapters off (a
    plain model has no adapters, so nothing changes)."""
    return model.disable_adapter() if is_peft(model) else contextlib.nullcontext()


def write_adapter(directory: Path, model, state_dict: dict | None = None) -> None:
    """The adapter in peft's format. ``state_dict``: the model's weights gathered from shards
    (the adapter tensors are picked from it); None = the model's own."""
    model.save_pretrained(directory, state_dict=state_dict, safe_serialization=True, save_embedding_layers=False)


def merged_only(model) -> bool:
    """Whether ``model``'s final save is its merged model alone: a LoRA value model (`exactrl rm`), whose adapter
    without its trained head and merged body would be of no use to a scorer (reward.model=, the reward server)."""
    return is_peft(model) and value_head(base_model(model)) is not None


def write_merged(directory: Path, model, state_dict: dict | None = None) -> None:
    """The base model with the adapters merged in (W + alpha/r B A; a value model's head: its trained copy), in
    Hugging Face format. Built on a fresh copy of the architecture loaded with ``state_dict`` (the full weights,
    base and adapters; None = the model's own), so the training model keeps its adapters."""
    peft = _peft()
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    base = base_model(model)
    auto = AutoModelForTokenClassification if value_head(base) else AutoModelForCausalLM
    with torch.random.fork_rng():  # initialising the copy must not move the run's random streams
        fresh = auto.from_config(copy.deepcopy(base.config), dtype=torch.float32)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            fresh = peft.get_peft_model(fresh, copy.deepcopy(model.peft_config[model.active_adapter]))
    fresh.load_state_dict(model.state_dict() if state_dict is None else state_dict, strict=True)
    fresh.merge_and_unload().save_pretrained(directory, safe_serialization=True)


def is_adapter_dir(directory: str | Path) -> bool:
    """A saved adapter without a model of its own (a LoRA run's final/ or checkpoint-N/)."""
    p = Path(directory)
    return (p / ADAPTER_CONFIG).is_file() and not (p / "config.json").is_file()


def adapter_base(directory: Path, base: str | Path | None, how: str) -> Path:
    """The base model directory of the adapter in ``directory``: ``base``, else the one its
    adapter_config.json records (peft's base_model_name_or_path: the directory the run loaded).
    ``how``: how the user gives another base (a flag or a key), for the messages."""
    config = directory / ADAPTER_CONFIG
    if not config.is_file() or not (directory / ADAPTER_WEIGHTS).is_file():
        raise LoraError(f"'{directory}' is not a LoRA adapter directory (it needs {ADAPTER_CONFIG} and "
                        f"{ADAPTER_WEIGHTS}): give the final/ or checkpoint-N/ of a run with model.lora.rank > 0")
    where = f"given with {how}"
    if base is None:
        try:
            base = json.loads(config.read_text()).get("base_model_name_or_path")
        except (OSError, ValueError, AttributeError) as e:
            raise LoraError(f"'{config}' cannot be read ({e}); give the base model with {how}") from None
        if not base:
            raise LoraError(f"'{config}' records no base model (base_model_name_or_path); give it with {how}")
        where = f"recorded in {config}"
    if not (Path(base) / "config.json").is_file():
        raise LoraError(f"the adapter's base model '{base}' ({where}) is not a Hugging Face model directory here; "
                        f"give the base it was trained on with {how}")
    return Path(base)


def load_adapted(directory: str | Path, base: str | Path | None = None, how: str = "--base PATH", device=None,
                 trust_remote_code: bool = False):
    """The adapter saved in ``directory`` on its base model (see adapter_base), frozen, as a peft model."""
    peft = _peft()
    directory = Path(directory)
    base_dir = adapter_base(directory, base, how)
    model = load_causal_lm(base_dir, trainable=False, device=device, trust_remote_code=trust_remote_code)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            warnings.filterwarnings("ignore", message=".*base_model_name_or_path.*was renamed")  # the base asked for
            model = peft.PeftModel.from_pretrained(model, str(directory), is_trainable=False)
    except (RuntimeError, ValueError, KeyError) as e:  # shapes or module names of another base
        lines = [line.strip() for line in str(e).strip().splitlines()] or [type(e).__name__]
        reason = next((line for line in lines if "mismatch" in line), lines[0])[:300]
        raise LoraError(f"the adapter in '{directory}' does not fit the base model '{base_dir}' ({reason}); "
                        f"give the base it was trained on with {how}") from None
    # peft loads non-strictly: an adapter for layers the base lacks would be dropped without a word.
    from safetensors import safe_open

    with safe_open(str(directory / ADAPTER_WEIGHTS), "pt") as f:
        saved = set(f.keys())
    loaded = set(peft.get_peft_model_state_dict(model, save_embedding_layers=False))
    if saved != loaded:
        raise LoraError(f"the adapter in '{directory}' does not fit the base model '{base_dir}' "
                        f"({len(saved - loaded)} of its {len(saved)} tensors have no place in it, "
                        f"{len(loaded - saved)} adapter tensors would stay untrained); give the base it was trained "
                        f"on with {how}")
    return model


def merge_adapter(directory: str | Path, output: str | Path, base: str | Path | None = None) -> Path:
    """Write the base model with the adapter in ``directory`` merged in (write_merged, as
    model.lora.merge_on_save) and the adapter's tokenizer to ``output``, which must not hold
    anything yet; written under a temporary name and renamed into place when complete."""
    from transformers import AutoTokenizer

    directory, output = Path(directory), Path(output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ConfigError(f"output '{output}' already exists and is not empty; choose another (nothing was "
                          "overwritten)")
    model = load_adapted(directory, base)
    has_tokenizer = (directory / "tokenizer_config.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(str(directory if has_tokenizer else adapter_base(
        directory, base, "--base PATH")))
    tmp = output.with_name(f".{output.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_merged(tmp, model)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, output)  # onto a missing or empty directory
    return output
