"""Process reward model cases for one backend, run by tests/test_prm.py (under torchrun for world size 2, or as one
process); writes one JSON result file.

usage: python prm_equivalence.py {fsdp2,deepspeed} WORLD OUT.json

Two SGD steps of the PRM's per-step loss on six step-labelled rows (1 to 6 steps each) through the real path
(StepExample.sample, plan_samples, ProcessTerm, Worker.train_step, the backend's engine, the canary on), micro-batches
holding different numbers of steps (at world size 2 with micro-batches of 1 row, ranks holding 4 and 14 steps),
compared on rank 0 with the one-pass reference of prm_references.py. Then once the peers' per-micro-batch mean over
steps (fault.mean_of_means), to show it is another update.
"""

from __future__ import annotations

import sys
from dataclasses import replace

from equivalence import dtype_of, finish, full_state, precision, rank0, relative_error
from prm_references import make_steps, sgd_reference, value_model

from exactrl.config import SFTConfig, load_config
from exactrl.distributed.engine import build_engine
from exactrl.distributed.step_plan import plan_samples
from exactrl.losses.objective import Objective
from exactrl.losses.process import ProcessTerm
from exactrl.tasks.tokenizer import build_tokenizer
from exactrl.workers.reward_model import RewardModel

LR, STEPS = 0.5, 2
PRM = Objective((ProcessTerm(),))
MICROS = {1: (1, 2), 2: (1, 3)}  # rows per micro-batch


def layouts(backend: str) -> list[list[str]]:
    if backend == "fsdp2":
        return [["distributed.backend=fsdp2"]]
    return [["distributed.backend=deepspeed", "deepspeed.zero_stage=2", "deepspeed.offload_optimizer=cpu"],
            ["distributed.backend=deepspeed", "deepspeed.zero_stage=3"]]


def run(layout, world: int, rows, tok, micro: int, micro_means: bool = False):
    """(full parameters after STEPS optimizer steps, facts of the step) through Worker.train_step."""
    cfg = load_config(SFTConfig, None, [*layout, f"distributed.nproc_per_node={world}", "train.global_batch_size=6",
                                        "train.micro_batch_size=1", "train.max_grad_norm=0", "optim.name=sgd",
                                        f"optim.lr={LR}", "optim.scheduler=constant"])
    model = value_model(tok, dtype=dtype_of(cfg))
    engine = build_engine(model, cfg, total_steps=STEPS)
    worker = RewardModel("reward_model", model, engine, pad_id=tok.pad_token_id, packed=cfg.train.padding_free)
    samples = [e.sample() for e in rows]
    plan = replace(plan_samples(samples, micro, "token-mean", world_size=engine.world_size), micro_means=micro_means)
    canary = [worker.train_step(samples, plan, PRM).stats["canary"] for _ in range(STEPS)]
    facts = {"canary": max(canary, key=lambda c: abs(c - 1)), "precision": precision(cfg), "micro": micro,
             "steps_per_rank": [sum(samples[i].loss_tokens for mb in plan.for_rank(r).micro_batches for i in mb)
                                for r in range(world)],
             "groups": [list(mb) for mb in plan.micro_batches]}
    return full_state(engine, model), facts



def main(backend: str, world: int, out_path: str) -> None:
    tok = build_tokenizer()
    rows = make_steps(tok)
    ref, cases = None, []
    for layout in layouts(backend):
        for micro in MICROS[world]:
            got, facts = run(layout, world, rows, tok, micro)
            if rank0():
                ref = ref or sgd_reference(tok, rows, LR, STEPS)
                cases.append({"config": " ".join(layout), **facts, "rel_err": relative_error(got, *ref)})
    got, facts = run(layouts(backend)[0], world, rows, tok, 1, micro_means=True)
    if rank0():
        peers = {**facts, "rel_err": relative_error(got, *ref),
                 "peers_formula_err": relative_error(got, *sgd_reference(tok, rows, LR, STEPS, facts["groups"]))}
    finish(out_path, cases, peers if rank0() else None)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
