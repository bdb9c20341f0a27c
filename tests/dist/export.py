"""Weight export from every engine, run by tests/test_export.py (under torchrun for world size 2,
or as one process); writes one JSON result file.

usage: python export.py {single,fsdp2,deepspeed} WORLD OUT.json

For each layout of the backend, with and without LoRA: Worker.export_weights() is a generator
that gathers one tensor at a time; its names and values equal the saved Hugging Face checkpoint's
(model.safetensors; a LoRA model's merged/model.safetensors, and with adapters=True its
adapter_model.safetensors); and a generator holding a model of its own (a second copy, as a vLLM
engine would) loads from it, is verified, and then holds exactly the saved weights. Every rank
checks; the results of all ranks are written.
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from exactrl.config import SFTConfig, load_config
from exactrl.config.schema import LoraConfig
from exactrl.distributed.engine import build_engine
from exactrl.distributed.launch import end_rank, shutdown
from exactrl.models.lora import apply_lora
from exactrl.rollout.hf import HFEngine
from exactrl.tasks.tiny_model import build_tiny_model
from exactrl.tasks.tokenizer import build_tokenizer
from exactrl.workers.worker import Worker

SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 64}
LAYOUTS = {"single": [[]], "fsdp2": [[]], "deepspeed": [["deepspeed.zero_stage=2"], ["deepspeed.zero_stage=3"]]}


def tiny(tok, seed: int, lora: bool):
    model = build_tiny_model(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, seed=seed, **SMALL)
    if not lora:
        return model
    model = apply_lora(model, LoraConfig(rank=4, alpha=8.0))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # both adapter matrices random, so the merge moves every adapted weight
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model


def compare(exported: dict, saved: dict) -> dict:
    return {"names_equal": sorted(exported) == sorted(saved),
            "only_exported": sorted(set(exported) - set(saved)), "only_saved": sorted(set(saved) - set(exported)),
            "values_equal": all(k in saved and torch.equal(v, saved[k]) for k, v in exported.items())}


def case(backend: str, world: int, extra: list[str], lora: bool, tok, out: Path) -> dict:
    lora_keys = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.merge_on_save=true"] if lora else []
    cfg = load_config(SFTConfig, None, [f"distributed.backend={backend}", f"distributed.nproc_per_node={world}",
                                        "train.global_batch_size=8", "train.micro_batch_size=2", *extra, *lora_keys])
    engine = build_engine(tiny(tok, 3, lora), cfg, total_steps=1)
    worker = Worker("policy", engine.model, engine, pad_id=tok.pad_token_id)
    gathers = []
    full = engine.full_tensor
    engine.full_tensor = lambda t: gathers.append(1) or full(t)
    stream = worker.export_weights()
    is_generator = inspect.isgenerator(stream)
    first = next(stream)
    gathered_for_first = len(gathers)  # a full state dict would have gathered every tensor by now
    exported = {first[0]: first[1].detach().cpu().clone(), **{k: v.detach().cpu().clone() for k, v in stream}}
    adapters = {k: v.detach().cpu().clone() for k, v in worker.export_weights(adapters=True)} if lora else {}
    engine.full_tensor = full
    where = out / f"{backend}-{'-'.join(extra) or 'default'}-{'lora' if lora else 'full'}"
    worker.save(where, tok)
    if world > 1:
        dist.barrier()  # the main process has written it
    saved = load_file(str(where / ("merged" if lora else "") / "model.safetensors"))
    result = {"config": " ".join([backend, *extra]), "lora": lora, "rank": dist.get_rank() if world > 1 else 0,
              "is_generator": is_generator, "gathered_for_first": gathered_for_first, "tensors": len(exported),
              **compare(exported, saved)}
    if lora:
        result["adapters"] = compare(adapters, load_file(str(where / "adapter_model.safetensors")))
    # A generator with a second copy of the model (another seed: every weight differs before the load).
    generator = HFEngine(tiny(tok, 11, False), tok, batch_size=4)
    result["generator_version"] = generator.load_weights(worker.export_weights())
    result["generator_holds_saved"] = compare({k: v.detach() for k, v in generator.model.state_dict().items()
                                               if k in saved}, saved)["values_equal"]
    return result


def main(backend: str, world: int, out_path: str) -> None:
    tok = build_tokenizer()
    out = Path(out_path).parent
    results = [case(backend, world, extra, lora, tok, out) for extra in LAYOUTS[backend] for lora in (False, True)]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, results)
        results = [r for part in every for r in part]
    if world == 1 or dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results))
    shutdown()
    end_rank()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
