"""`exactrl kd`'s one-step update on a distributed backend at world size 2 is the single-process full-batch update
of kd_references.py (the loss written out from its formula, plain torch); run by tests/test_kd.py under torchrun.

usage: python kd_layouts.py {fsdp2,deepspeed} WORLD OUT.json
       DeepSpeed is ZeRO-2 with the optimizer offloaded to the CPU.

Nine of kd_references' samples (1 to ~60 loss tokens), planned as train_kd plans them (sorted by length, two per
micro-batch): ranks of 5 and 4 samples, micro-batches of 2 + 2 + 1 and 2 + 1 + 1, of very different token counts.
Each kd.loss: the teacher worker scores each rank's micro-batches (kd_step, shared with every rank), then one SGD step
through Worker.train_step on the backend's engine with the canary on, compared on rank 0 with one SGD step on the
reference loss over all nine samples at once. Then forward_kl once more with each micro-batch normalised by its own
tokens (the peers' convention, OpenRLHF's KDLoss and TRL's GKD), to show the comparison tells the two apart.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch.distributed as dist
from equivalence import dtype_of, finish, full_state, precision, relative_error
from kd_references import ALPHA, BETA, LOSSES, LR, K, T, make_samples, sgd_reference
from pair_references import fresh_model

from exactrl.algorithms.kd import kd_step
from exactrl.config import SFTConfig, load_config
from exactrl.distributed.engine import build_engine
from exactrl.distributed.step_plan import plan_samples
from exactrl.losses.kd import TEACHER_FIELDS, kd_objective
from exactrl.tasks.tokenizer import build_tokenizer
from exactrl.workers.teacher import Teacher
from exactrl.workers.worker import Worker

MICRO, N = 2, 9
LAYOUTS = {"fsdp2": ["distributed.backend=fsdp2"],
           "deepspeed": ["distributed.backend=deepspeed", "deepspeed.zero_stage=2", "deepspeed.offload_optimizer=cpu"]}


def run(tok, backend: str, world: int, loss: str, micro_means: bool = False):
    """(full parameters after one optimizer step through kd_step, facts of the step)."""
    cfg = load_config(SFTConfig, None, [*LAYOUTS[backend], f"distributed.nproc_per_node={world}",
                                        "train.global_batch_size=10", "train.micro_batch_size=1", "optim.name=sgd",
                                        f"optim.lr={LR}", "optim.scheduler=constant", "train.max_grad_norm=0"])
    dtype, pad = dtype_of(cfg), tok.pad_token_id
    model = fresh_model(tok, dtype=dtype)
    engine = build_engine(model, cfg, total_steps=1)
    policy = Worker("policy", model, engine, pad_id=pad)
    teacher = Teacher("teacher", fresh_model(tok, seed=9, dtype=dtype), pad_id=pad, temperature=T)
    teacher.topk = K
    objective = kd_objective(loss, ALPHA, temperature=T, beta=BETA, agg="token-mean", norm_len=None)
    samples = make_samples(tok)[:N]
    plan = plan_samples(samples, MICRO, "token-mean", world_size=engine.world_size, sort=True)  # as train_kd
    result = kd_step(policy, teacher, samples, replace(plan, micro_means=micro_means), objective,
                     TEACHER_FIELDS[loss])
    ranks = [plan.for_rank(r).micro_batches for r in range(world)]
    facts = {"canary": result.stats["canary"], "precision": precision(cfg), "loss_value": result.loss,
             "samples_per_rank": [sum(map(len, mbs)) for mbs in ranks],
             "tokens_per_rank": [sum(samples[i].loss_tokens for mb in mbs for i in mb) for mbs in ranks],
             "samples_per_micro_batch": [len(mb) for mb in plan.micro_batches]}
    return full_state(engine, model), facts


def main(backend: str, world: int, out_path: str) -> None:
    tok = build_tokenizer()
    init = fresh_model(tok).state_dict()
    cases, peers = [], []
    for loss in (*LOSSES, "peers"):
        got, facts = run(tok, backend, world, "forward_kl" if loss == "peers" else loss, micro_means=loss == "peers")
        if not dist.is_initialized() or dist.get_rank() == 0:
            ref, value, _ = sgd_reference(tok, make_samples(tok)[:N], "forward_kl" if loss == "peers" else loss)
            case = {"loss": loss, **facts, "reference_loss": value, "rel_err": relative_error(got, ref, init)}
            (peers if loss == "peers" else cases).append(case)
    finish(out_path, cases, peers)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
