"""A trained model's weights for a generator, one full tensor at a time, named as its saved
Hugging Face checkpoint names them, whatever holds them (exactrl/workers/worker.py export_weights).

Each engine supplies ``full(tensor)``: the whole tensor from what this rank holds (FSDP2 gathers
a DTensor's shards, ZeRO-3 its partitions; a plain tensor is already whole). Every rank must then
walk the same names in the same order, as the gathers are collectives. A LoRA model comes out
merged (W + scaling B A, as peft's merge_and_unload computes it, so the tensors equal
model.lora.merge_on_save's merged/), or as its adapters in peft's saved names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from exactrl.models import lora

Full = Callable[[torch.Tensor], torch.Tensor]
PEFT_PREFIX = "base_model.model."  # what peft puts before the wrapped model's own names


def hf_tensors(model: torch.nn.Module, full: Full, adapters: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of ``model`` one at a time; ``adapters``: a LoRA model's adapters only."""
    state = model.state_dict(keep_vars=True)  # the live tensors (shards, partitions): nothing gathered yet
    if not lora.is_peft(model):
        yield from _deduplicated(state, full)
    elif adapters:
        adapter = f".{model.active_adapter}"
        for name, t in state.items():
            if "lora_" in name:  # peft's saved name drops the adapter's own (get_peft_model_state_dict)
                yield name.replace(adapter, ""), full(t).detach()
    else:
        yield from _merged(model, state, full)


def tied_copies(model: torch.nn.Module) -> set[str]:
    """The names under which a tied weight (lm_head tied to the embeddings) appears again after
    its first: save_pretrained keeps it once, under its first name."""
    seen, copies = set(), set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            copies.add(name)
        seen.add(id(t))
    return copies


def _deduplicated(state: dict, full: Full) -> Iterator[tuple[str, torch.Tensor]]:
    seen = set()
    for name, t in state.items():
        if id(t) not in seen:  # a tied weight once, under its first name
            seen.add(id(t))
            yield name, full(t).detach()


def _merged(model, state: dict, full: Full) -> Iterator[tuple[str, torch.Tensor]]:
    adapter = model.active_adapter
    seen = set()
    for name, t in state.items():
        if "lora_" in name or id(t) in seen:
            continue  # an adapter is merged into its base weight below; a tied weight goes once
        seen.add(id(t))
        module_name, adapted, leaf = name.rpartition(".base_layer.")
        if not adapted:
            yield name.removeprefix(PEFT_PREFIX), full(t).detach()
            continue
        layer = model.get_submodule(module_name)
        w = full(t).detach()
        if leaf == "weight" and adapter in layer.lora_A:
            a, b = full(layer.lora_A[adapter].weight).detach(), full(layer.lora_B[adapter].weight).detach()
            delta = b @ a
            w = w + (delta.T if layer.fan_in_fan_out else delta) * layer.scaling[adapter]
        yield f"{module_name}.{leaf}".removeprefix(PEFT_PREFIX), w
