"""Equivalence cases for one backend, run by tests/test_fsdp2.py and tests/test_deepspeed.py
(under torchrun for world size 2, or as one process); writes one JSON result file.

usage: python equivalence.py {fsdp2,deepspeed} WORLD OUT.json

For each case: two optimizer steps of SFT through the real path (plan_step per rank,
sft_micro_batch_loss, the backend's engine) from the same initial model, then the full
parameters are compared on rank 0 with an independent single-process reference: one
padded forward per step over the whole global batch, the loss written out by its
definition, plain torch SGD or AdamW. One process group serves every case.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from exactrl.algorithms.sft import sft_micro_batch_loss
from exactrl.checks.canary import CanaryError
from exactrl.config import SFTConfig, load_config
from exactrl.data.encode import encode_sft
from exactrl.data.jsonl import Row
from exactrl.distributed.engine import build_engine
from exactrl.distributed.launch import shutdown
from exactrl.distributed.step_plan import plan_step
from exactrl.tasks.arithmetic import Problem, worked_solution
from exactrl.tasks.tiny_model import build_tiny_model
from exactrl.tasks.tokenizer import build_tokenizer

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64)
COMPLETIONS = ["1", "#### 15", worked_solution(Problem(347, 285)), "ab", worked_solution(Problem(123456, 654321)),
               "#### 10", "x" * 40, worked_solution(Problem(7, 8))]
NORM_LEN = 64.0


def definition_loss(logits, ids, mask, mode):
    nll = -torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    seq = (nll * mask).sum(1)
    n = mask.sum(1)
    return {"token-mean": seq.sum() / mask.sum(), "seq-mean-token-mean": (seq / n).mean(),
            "seq-mean-token-sum": seq.mean(), "seq-mean-token-sum-norm": seq.sum() / (len(seq) * NORM_LEN)}[mode]


def reference(model, steps, tok, mode, optim, eps=1e-8, lr=None):
    opt = (torch.optim.SGD(model.parameters(), lr=lr or 0.5) if optim == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=lr or 1e-2, eps=eps, weight_decay=0.0))
    for exs in steps:
        width = max(len(e.input_ids) for e in exs)
        ids = torch.tensor([e.input_ids + [tok.pad_token_id] * (width - len(e.input_ids)) for e in exs])
        attn = torch.tensor([[1] * len(e.input_ids) + [0] * (width - len(e.input_ids)) for e in exs])
        mask = torch.tensor([e.loss_mask + [0] * (width - len(e.loss_mask)) for e in exs])[:, 1:].float()
        opt.zero_grad()
        definition_loss(model(input_ids=ids, attention_mask=attn).logits, ids, mask, mode).backward()
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def exactrl_run(model, steps, tok, cfg, fault=None):
    """Two optimizer steps through the real path. ``fault`` injects what a backend bug does:
    ``drop`` loses micro-batch 1's gradient on every rank, ``duplicate`` accumulates micro-batch
    0's twice (both by scaling that micro-batch's whole contribution, canary term included, by
    0 or 2 -- the gradient a lost or doubled accumulation leaves), ``rank_local_normalizer``
    normalises each micro-batch by its own tokens (the mean-of-means bug)."""
    engine = build_engine(model, cfg, total_steps=len(steps))
    t = cfg.train
    for exs in steps:
        plan = plan_step([e.loss_tokens for e in exs], t.micro_batch_size, t.loss_agg, NORM_LEN,
                         lengths=[len(e.input_ids) for e in exs], world_size=engine.world_size, rank=engine.rank)
        for i, mb in enumerate(plan.micro_batches):
            batch = [exs[j] for j in mb]
            norm = plan.normalizer
            if fault == "rank_local_normalizer":
                norm = plan_step([e.loss_tokens for e in batch], len(batch), t.loss_agg, NORM_LEN).normalizer
            loss, share = sft_micro_batch_loss(model, engine, batch, tok.pad_token_id, norm)
            scale = {("drop", 1): 0.0, ("duplicate", 0): 2.0}.get((fault, i), 1.0)
            engine.backward(loss * scale, share * scale, len(mb))
        engine.step(plan)
    return full_state(engine, model)


def full_state(engine, model) -> dict:
    if engine.backend == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if engine.backend == "deepspeed" and engine.stage == 3:
        state = engine.ds._zero3_consolidated_16bit_state_dict() or {}
        return {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
ZERO2_CPU = ["deepspeed.zero_stage=2", "deepspeed.offload_optimizer=cpu"]
# A user's own DeepSpeed JSON, as Hugging Face and OpenRLHF users write them ("auto" batch
# sizes), with buckets small enough that every step reduces in several pieces.
USER_JSON = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
             "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "overlap_comm": True,
                                   "contiguous_gradients": True, "reduce_bucket_size": 2000, "allgather_bucket_size": 2000}}
FAULTS = ("drop", "duplicate", "rank_local_normalizer")


def cases(backend: str, world: int) -> list[dict]:
    """One dict per case. K = batch / (micro x world) micro-batches per rank: K in {1, 2, 4}
    (and 8 at world size 1) from a batch of 8, K = 3 from a batch of 6."""
    micros = [m for m in (4, 2, 1) if 8 % (m * world) == 0] if world == 2 else [8, 4, 2, 1]
    k3 = dict(mode="token-mean", micro=2 // world, optim="sgd", batch=6)
    # AdamW at torch's default eps and at eps=1e-6, where Adam's per-element division stays
    # well conditioned for this model's smallest gradient elements (see tests/test_fsdp2.py).
    adamw = [dict(mode="token-mean", micro=2, optim="adamw", eps=eps) for eps in (1e-8, 1e-6)]
    if backend == "fsdp2":
        out = [dict(mode=m, micro=mi, optim="sgd", extra=[]) for m in MODES for mi in micros]
        # Recomputed activations must not change the update (FSDP2's CPU offload needs a GPU: make gpu-check).
        knobs = [dict(mode="token-mean", micro=2 // world, optim="sgd", extra=[x]) for x in
                 ["train.gradient_checkpointing=true"] + (["distributed.fsdp_cpu_offload=true"] if os.environ.get("EXACTRL_TEST_DEVICE") == "cuda" else [])]
        return out + [dict(k3, extra=[])] + [dict(a, extra=[]) for a in adamw] + knobs
    out = []
    for stage in (0, 1, 2, 3):
        for offload in (("none", "cpu") if stage else ("none",)):
            extra = [f"deepspeed.zero_stage={stage}", f"deepspeed.offload_optimizer={offload}"]
            out += [dict(mode="token-mean", micro=mi, optim="sgd", extra=extra) for mi in micros] + [dict(k3, extra=extra)]
    out += [dict(mode="token-mean", micro=mi, optim="sgd", extra=["deepspeed.zero_stage=3", "deepspeed.offload_optimizer=cpu",
                                                                   "deepspeed.offload_param=cpu"]) for mi in micros[1:]]
    out += [dict(mode=m, micro=2, optim="sgd", extra=ZERO2_CPU) for m in MODES[1:]]
    out += [dict(mode="token-mean", micro=mi, optim="sgd", extra=["deepspeed.config=USER_JSON"]) for mi in micros[1:]]
    return out + [dict(a, extra=x) for a in adamw for x in (ZERO2_CPU, ["deepspeed.zero_stage=3"])]


def fault_layouts(backend: str) -> list[list[str]]:
    if backend == "fsdp2":
        return [[]]
    return [["deepspeed.zero_stage=0"], ["deepspeed.zero_stage=1", "deepspeed.offload_optimizer=cpu"], ZERO2_CPU,
            ["deepspeed.zero_stage=3"], ["deepspeed.zero_stage=3", "deepspeed.offload_optimizer=cpu", "deepspeed.offload_param=cpu"]]


def main(backend: str, world: int, out_path: str) -> None:
    tok = build_tokenizer()
    rows = [Row(f"t:{i}", {"prompt": f"{i}+{i}=", "completion": c}) for i, c in enumerate(COMPLETIONS)]
    exs = encode_sft(rows, tok, 256)
    fresh = lambda: build_tiny_model(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, seed=3, **SMALL)  # noqa: E731
    # EXACTRL_TEST_DEVICE=cuda: the backend runs on GPUs over NCCL (tests/test_gpu.py); the reference stays on the CPU.
    layout = [f"distributed.backend={backend}", f"distributed.nproc_per_node={world}",
              f"distributed.device={os.environ.get('EXACTRL_TEST_DEVICE', 'auto')}"]
    user_json = Path(out_path).with_name("user_ds_config.json")
    user_json.write_text(json.dumps(USER_JSON))
    results = []
    for case in cases(backend, world):
        n = case.get("batch", 8)
        steps = [exs[:n], exs[:n][::-1]]
        extra = [e.replace("USER_JSON", str(user_json)) for e in case["extra"]]
        cfg = load_config(SFTConfig, None, [*layout, *extra, f"train.loss_agg={case['mode']}", f"train.global_batch_size={n}",
                                            f"train.micro_batch_size={case['micro']}", "train.max_grad_norm=0", f"optim.name={case['optim']}",
                                            f"optim.lr={0.5 if case['optim'] == 'sgd' else 1e-2}", "optim.scheduler=constant",
                                            f"optim.eps={case.get('eps', 1e-8)}"])
        got = exactrl_run(fresh(), steps, tok, cfg)
        if dist.get_rank() == 0:
            ref, init = reference(fresh(), steps, tok, case["mode"], case["optim"], case.get("eps", 1e-8)), fresh().state_dict()
            num = sum(((got[k] - ref[k]).norm() ** 2).item() for k in ref)
            den = sum(((ref[k] - init[k]).norm() ** 2).item() for k in ref)
            results.append({**{k: v for k, v in case.items() if k != "extra"}, "config": " ".join(case["extra"]),
                            "K": n // (case["micro"] * world), "rel_err": (num / den) ** 0.5})
    faults = []
    for extra in fault_layouts(backend):
        for fault in FAULTS:
            cfg = load_config(SFTConfig, None, [*layout, *extra, "train.global_batch_size=8", "train.micro_batch_size=2", "optim.name=sgd"])
            try:
                exactrl_run(fresh(), [exs, exs], tok, cfg, fault=fault)
                message = "not raised"
            except CanaryError as e:
                message = str(e)
            faults.append({"config": " ".join(extra), "fault": fault, "message": message})
    if dist.get_rank() == 0:
        json.dump({"cases": results, "faults": faults}, open(out_path, "w"))
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
