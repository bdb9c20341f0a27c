"""KTO cases for one backend, run by tests/test_kto.py (under torchrun for world size 2, or as one process); writes
one JSON result file.

usage: python kto_equivalence.py {fsdp2,deepspeed} WORLD OUT.json

Two SGD steps of KTO on nine unpaired rows of uneven lengths through the real path (plan_samples, the reference
worker, the no-grad pre-pass for z on every rank, Worker.train_step, the backend's engine, the canary on), compared
on rank 0 with the one-pass reference of kto_references.py (z over the whole step): micro-batches of 2, 3 and 9 rows
(at world size 2: 2, 3 and 5, ranks of 5 and 4 rows). Then the peers' per-micro-batch z on
micro-batches of 2, against the step's reference and against TRL's z written out (kto_references.paper_z).
"""

from __future__ import annotations

import sys

from equivalence import dtype_of, finish, full_state, precision, rank0, relative_error
from kto_references import BETA, W_D, W_U, make_rows, reference_model, sgd_reference
from pair_references import fresh_model

from exactrl.algorithms.kto import kto_step
from exactrl.config import SFTConfig, load_config
from exactrl.distributed.engine import build_engine
from exactrl.distributed.step_plan import plan_samples
from exactrl.losses.kto import KTOTerm
from exactrl.losses.objective import Objective
from exactrl.tasks.tokenizer import build_tokenizer
from exactrl.workers.worker import Worker

LR, STEPS = 2.0, 2
KTO = Objective((KTOTerm(beta=BETA, desirable_weight=W_D, undesirable_weight=W_U),))
MICROS = {1: (2, 3, 9), 2: (2, 3, 5)}  # world 2: ranks of 5 and 4 rows each time


def layouts(backend: str) -> list[list[str]]:
    if backend == "fsdp2":
        return [["distributed.backend=fsdp2"]]
    return [["distributed.backend=deepspeed", "deepspeed.zero_stage=2", "deepspeed.offload_optimizer=cpu"],
            ["distributed.backend=deepspeed", "deepspeed.zero_stage=3"]]


def run(layout, world: int, tok, micro: int, mode: str = "step"):
    """(full parameters after STEPS KTO steps, facts of the step, the plan)."""
    cfg = load_config(SFTConfig, None, [*layout, f"distributed.nproc_per_node={world}", "train.global_batch_size=10",
                                        "train.micro_batch_size=1", "train.max_grad_norm=0", "optim.name=sgd",
                                        f"optim.lr={LR}", "optim.scheduler=constant"])
    model = fresh_model(tok, dtype=dtype_of(cfg))
    engine = build_engine(model, cfg, total_steps=STEPS)
    policy = Worker("policy", model, engine, pad_id=tok.pad_token_id, packed=cfg.train.padding_free)
    reference = Worker("reference", reference_model(tok, dtype_of(cfg)), pad_id=tok.pad_token_id,
                       packed=cfg.train.padding_free)
    rows = make_rows(tok)
    plan = plan_samples(rows, micro, "token-mean", world_size=engine.world_size)
    results = [kto_step(policy, reference, rows, plan, KTO, mode) for _ in range(STEPS)]
    facts = {"canary": max((r.stats["canary"] for r in results), key=lambda c: abs(c - 1)), "precision": precision(cfg),
             "rows_per_rank": [plan.for_rank(r).num_samples for r in range(world)],
             "z": results[0].metrics["kto_z"]}
    return full_state(engine, model), facts, plan



def main(backend: str, world: int, out_path: str) -> None:
    tok = build_tokenizer()
    rows = make_rows(tok)
    ref = sgd_reference(rows, tok, LR, STEPS) if rank0() else None
    cases = []
    for layout in layouts(backend):
        for micro in MICROS[world]:
            got, facts, _ = run(layout, world, tok, micro)
            if rank0():
                cases.append({"micro": micro, "config": " ".join(layout), **facts,
                              "rel_err": relative_error(got, *ref)})
    got, facts, plan = run(layouts(backend)[0], world, tok, 2, "micro_batch")
    if rank0():
        mbs = [list(mb) for mb in plan.micro_batches]
        trl = sgd_reference(rows, tok, LR, STEPS, [mbs[c : c + world] for c in range(0, len(mbs), world)])
        peers = {**facts, "rel_err": relative_error(got, *ref), "rel_err_to_trl": relative_error(got, *trl)}
    finish(out_path, cases, peers if rank0() else None)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
