"""LoRA cases for FSDP2 and DeepSpeed, run by tests/test_lora_backends.py (under torchrun for world size 2, or as
one process); writes one JSON result file.

usage: python lora_equivalence.py {fsdp2,deepspeed} WORLD OUT.json

The SFT cases of equivalence.py on a model with rank-4 adapters (A and B random, so both get
gradients): two optimizer steps through the real path, compared on rank 0 with the same
independent one-pass reference (which, on a LoRA model, steps only the adapters); whether any
base weight moved; what a checkpoint holds; and the canary against a lost micro-batch.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from equivalence import COMPLETIONS, MODES, SMALL, dtype_of, exactrl_run, in_dtype, precision, reference, relative_error

from exactrl.checks.canary import CanaryError
from exactrl.config import SFTConfig, load_config
from exactrl.config.schema import LoraConfig
from exactrl.data.encode import encode_sft
from exactrl.data.jsonl import Row
from exactrl.distributed.engine import build_engine
from exactrl.distributed.launch import end_rank, shutdown
from exactrl.models.lora import apply_lora
from exactrl.tasks.tiny_model import build_tiny_model
from exactrl.tasks.tokenizer import build_tokenizer


def lora_model(tok, seed=3, dtype=torch.float32):
    model = apply_lora(build_tiny_model(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, seed=seed, **SMALL),
                       LoraConfig(rank=4, alpha=8.0))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return in_dtype(model, dtype)


def rl_cases(backend: str, world: int, tok) -> list[dict]:
    """rl_equivalence.py's policy-loss cases (PPO clip with clip-higher, KL and entropy; GSPO;
    REINFORCE) with its policy replaced by the LoRA model: two SGD steps through the real path
    against its one-pass reference written from the definitions."""
    import rl_equivalence as rle

    samples = rle.make_rollout(tok)  # old and reference log-probs from the plain model: data, as any rollout's
    rle.fresh_policy = lambda tok, seed=3, dtype=torch.float32: lora_model(tok, seed, dtype)
    out = []
    for case in [c for c in rle.cases(backend) if c["loss"] in ("ppo", "gspo", "reinforce")][:6]:
        rollout = rle.sequence_advantages(samples) if case["loss"] == "gspo" else samples
        got = rle.exactrl_run(case, rollout, tok, case["layout"])
        if dist.get_rank() == 0:
            cfg = rle.case_config(case, case["layout"])
            ref, init = rle.reference(case, rollout, tok, dtype_of(cfg))
            base_moved = [k for k in ref if "lora_" not in k and not torch.equal(got[k], init[k])]
            out.append({"loss": case["loss"], "mode": case["mode"], "config": " ".join(case["layout"]),
                        "K": 8 // (case["micro"] * world), "precision": precision(cfg),
                        "rel_err": relative_error(got, ref, init), "base_moved": base_moved})
    return out


# DeepSpeed: ZeRO-2, ZeRO-2 with the optimizer offloaded to CPU (where 0.15.2-0.18.x lost
# micro-batches), ZeRO-3; every aggregation mode on FSDP2, token-mean on DeepSpeed.
LAYOUTS = {"fsdp2": [[]], "deepspeed": [["deepspeed.zero_stage=2"], ["deepspeed.zero_stage=2", "deepspeed.offload_optimizer=cpu"],
                                        ["deepspeed.zero_stage=3"]]}


def main(backend: str, world: int, out_path: str) -> None:
    tok = build_tokenizer()
    exs = encode_sft([Row(f"t:{i}", {"prompt": f"{i}+{i}=", "completion": c}) for i, c in enumerate(COMPLETIONS)], tok, 256)
    steps = [exs, exs[::-1]]
    modes = MODES if backend == "fsdp2" else MODES[:1]
    results, checkpoints, faults = [], [], []
    for extra in LAYOUTS[backend]:
        layout = [f"distributed.backend={backend}", f"distributed.nproc_per_node={world}", *extra]
        cases = [dict(mode=m, micro=mi, optim="sgd") for m in modes for mi in (8, 4, 2, 1) if 8 % (mi * world) == 0]
        cases.append(dict(mode="token-mean", micro=2, optim="adamw"))
        for case in cases:
            lr = 0.5 if case["optim"] == "sgd" else 1e-2
            cfg = load_config(SFTConfig, None, [*layout, f"train.loss_agg={case['mode']}", "train.global_batch_size=8",
                                                f"train.micro_batch_size={case['micro']}", "train.max_grad_norm=0",
                                                f"optim.name={case['optim']}", f"optim.lr={lr}", "optim.scheduler=constant",
                                                *(["optim.eps=1e-6"] if case["optim"] == "adamw" else [])])
            dtype = dtype_of(cfg)
            got = exactrl_run(lora_model(tok, dtype=dtype), steps, tok, cfg)
            if dist.get_rank() == 0:
                ref = reference(lora_model(tok, dtype=dtype), steps, tok, case["mode"], case["optim"], 1e-6, lr)
                init = lora_model(tok, dtype=dtype).state_dict()
                base_moved = [k for k in ref if "lora_" not in k and not torch.equal(got[k], init[k])]
                results.append({**case, "config": " ".join(extra), "K": 8 // (case["micro"] * world),
                                "precision": precision(cfg), "rel_err": relative_error(got, ref, init),
                                "base_moved": base_moved})
        cfg = load_config(SFTConfig, None, [*layout, "train.global_batch_size=8", "train.micro_batch_size=2", "optim.name=sgd"])
        model = lora_model(tok, dtype=dtype_of(cfg))
        state = build_engine(model, cfg, total_steps=1).checkpoint_state()[0]
        trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
        checkpoints.append({"config": " ".join(extra), "keys": sorted(state or {}), "trainable": trainable})
        try:
            exactrl_run(lora_model(tok, dtype=dtype_of(cfg)), [exs, exs], tok, cfg, fault="drop")
            faults.append("not raised")
        except CanaryError as e:
            faults.append(str(e))
    rl = rl_cases(backend, world, tok)
    if dist.get_rank() == 0:
        json.dump({"cases": results, "checkpoints": checkpoints, "faults": faults, "rl": rl}, open(out_path, "w"))
    shutdown()
    end_rank()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
