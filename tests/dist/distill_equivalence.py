"""On-policy distillation cases for one backend, run by tests/test_on_policy_distill.py (under torchrun for world
size 2, or as one process); writes one JSON result file.

usage: python distill_equivalence.py {fsdp2,deepspeed} WORLD OUT.json

For k1 (through the ratio), jsd and forward_kl_topk (over the vocabulary; DeepSpeed: k1 and forward_kl_topk): the
teacher worker scores the samples in each rank's micro-batches, shared with every rank (algorithms/distill.py
attach_teacher), then two SGD steps through Worker.train_step on FSDP2 in float64, or DeepSpeed ZeRO-2 with the
optimizer offloaded to the CPU (a float64 model stepped through fp32 master weights), ranks holding different numbers
of tokens, compared on rank 0 with the one-pass reference of distill_references.py.
"""

from __future__ import annotations

import json
import sys

import torch.distributed as dist
from distill_references import BETA, TOPK, fresh_model, make_samples, sgd_reference
from equivalence import dtype_of, full_state, precision, relative_error

from exactrl.algorithms.distill import attach_teacher
from exactrl.config import SFTConfig, load_config
from exactrl.config.schema_distill import DistillConfig
from exactrl.distributed.engine import build_engine
from exactrl.distributed.launch import end_rank, shutdown
from exactrl.distributed.step_plan import plan_samples
from exactrl.losses.distill_terms import distill_term
from exactrl.losses.objective import Objective
from exactrl.tasks.tokenizer import build_tokenizer
from exactrl.workers.teacher import Teacher
from exactrl.workers.worker import Worker

LR, STEPS, MICRO = 0.5, 2, 2
LAYOUTS = {"fsdp2": ["distributed.backend=fsdp2"],
           "deepspeed": ["distributed.backend=deepspeed", "deepspeed.zero_stage=2", "deepspeed.offload_optimizer=cpu"]}
# DeepSpeed's fp32 master weights round the final weights by ~3e-5 of jsd's small two-step update here (1e-6 of k1's,
# 3e-7 of forward_kl_topk's), past the 1e-5 bound of fp32 master weights: jsd is held to float64 on FSDP2 alone.
LOSSES = {"fsdp2": ("k1", "jsd", "forward_kl_topk"), "deepspeed": ("k1", "forward_kl_topk")}


def run(tok, loss: str, backend: str, world: int):
    cfg = load_config(SFTConfig, None, [*LAYOUTS[backend], f"distributed.nproc_per_node={world}",
                                        "train.global_batch_size=14", "train.micro_batch_size=1",
                                        "train.max_grad_norm=0", "optim.name=sgd", f"optim.lr={LR}",
                                        "optim.scheduler=constant"])
    dtype = dtype_of(cfg)
    model = fresh_model(tok, dtype=dtype)
    engine = build_engine(model, cfg, total_steps=STEPS)
    policy = Worker("policy", model, engine, pad_id=tok.pad_token_id)
    samples = make_samples(tok)
    plan = plan_samples(samples, MICRO, "token-mean", world_size=engine.world_size)
    teacher = Teacher("teacher", fresh_model(tok, seed=9, dtype=dtype), pad_id=tok.pad_token_id)
    teacher.topk = TOPK
    attach_teacher(samples, teacher, [plan.for_rank(r).micro_batches for r in range(world)],
                   DistillConfig(teacher="t", loss=loss))
    objective = Objective((distill_term(loss, 1.0, temperature=1.0, beta=BETA),))
    canary = [policy.train_step(samples, plan, objective).stats["canary"] for _ in range(STEPS)]
    tokens = [sum(samples[i].loss_tokens for mb in plan.for_rank(r).micro_batches for i in mb) for r in range(world)]
    return full_state(engine, model), {"canary": max(canary, key=lambda c: abs(c - 1)), "tokens_per_rank": tokens,
                                       "precision": precision(cfg)}


def main(backend: str, world: int, out_path: str) -> None:
    tok = build_tokenizer()
    cases = []
    for loss in LOSSES[backend]:
        got, facts = run(tok, loss, backend, world)
        if not dist.is_initialized() or dist.get_rank() == 0:
            ref, init, _ = sgd_reference(tok, make_samples(tok), loss, LR, STEPS)
            cases.append({"loss": loss, **facts, "rel_err": relative_error(got, ref, init)})
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump({"cases": cases}, f)
    shutdown()
    end_rank()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
