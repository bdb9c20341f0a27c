"""Preference-pair cases for one backend, run by tests/test_pair_objective.py (under torchrun for world
size 2, or as one process); writes one JSON result file.

usage: python pair_equivalence.py {fsdp2,deepspeed} WORLD OUT.json

For DPO and RPO (DPO plus the chosen answers' token-mean NLL), two SGD steps on five pairs of uneven
answer lengths through the real path (plan_samples with unit=2, Worker.train_step, the backend's engine,
the canary on), micro-batches holding different numbers of pairs (2 + 2 + 1 at world size 1; ranks of 3
and 2 pairs at world size 2), compared on rank 0 with the one-pass reference of pair_references.py. Then
once the peers' per-micro-batch mean over pairs (fault.mean_of_means), to show it is another update.
"""

from __future__ import annotations

import sys
from dataclasses import replace

from equivalence import dtype_of, finish, full_state, precision, rank0, relative_error
from pair_references import BETA, NLL_COEF, fresh_model, make_pairs, sgd_reference

from exactrl.config import SFTConfig, load_config
from exactrl.distributed.engine import build_engine
from exactrl.distributed.step_plan import plan_samples
from exactrl.losses.objective import NLLTerm, Objective
from exactrl.losses.pairs import PairTerm
from exactrl.losses.preference import PairParams
from exactrl.tasks.tokenizer import build_tokenizer
from exactrl.workers.worker import Worker

LR, STEPS = 0.5, 2
OBJECTIVES = {"dpo": (Objective((PairTerm(loss="dpo", params=PairParams(beta=BETA)),)), 0.0),
              "rpo": (Objective((PairTerm(loss="dpo", params=PairParams(beta=BETA)),
                                 NLLTerm(sources=("chosen",), coef=NLL_COEF))), NLL_COEF)}
# micro-batch sizes in samples (2 per pair): at world size 2, micro 4 plans 2+1+1+1 pairs (ranks of 3 and 2, K = 2)
# and micro 6 plans 3+2 (K = 1); at world size 1, micro 4 plans 2+2+1 and micro 2 one pair each
MICROS = {1: (4, 2), 2: (4, 6)}


def layouts(backend: str) -> list[list[str]]:
    if backend == "fsdp2":
        return [["distributed.backend=fsdp2"]]
    return [["distributed.backend=deepspeed", "deepspeed.zero_stage=2", "deepspeed.offload_optimizer=cpu"],
            ["distributed.backend=deepspeed", "deepspeed.zero_stage=3"]]


def run(layout, world: int, samples, tok, micro: int, objective: Objective, micro_means: bool = False):
    """(full parameters after STEPS optimizer steps, facts of the step) through Worker.train_step."""
    cfg = load_config(SFTConfig, None, [*layout, f"distributed.nproc_per_node={world}", "train.global_batch_size=10",
                                        "train.micro_batch_size=1", "train.max_grad_norm=0", "optim.name=sgd",
                                        f"optim.lr={LR}", "optim.scheduler=constant"])
    model = fresh_model(tok, dtype=dtype_of(cfg))
    engine = build_engine(model, cfg, total_steps=STEPS)
    worker = Worker("policy", model, engine, pad_id=tok.pad_token_id, packed=cfg.train.padding_free)
    plan = replace(plan_samples(samples, micro, "token-mean", world_size=engine.world_size, unit=2),
                   micro_means=micro_means)
    canary = [worker.train_step(samples, plan, objective).stats["canary"] for _ in range(STEPS)]
    facts = {"canary": max(canary, key=lambda c: abs(c - 1)), "precision": precision(cfg),
             "pairs_per_rank": [sum(len(mb) // 2 for mb in plan.for_rank(r).micro_batches) for r in range(world)],
             "pairs_per_micro_batch": [len(mb) // 2 for mb in plan.micro_batches]}
    return full_state(engine, model), facts



def main(backend: str, world: int, out_path: str) -> None:
    tok = build_tokenizer()
    samples = make_pairs(tok)
    refs = {}
    cases = []
    for layout in layouts(backend):
        for name, (objective, nll) in OBJECTIVES.items():
            for micro in MICROS[world]:
                got, facts = run(layout, world, samples, tok, micro, objective)
                if rank0():
                    if name not in refs:
                        refs[name] = sgd_reference(samples, tok, LR, STEPS, nll)
                    cases.append({"loss": name, "micro": micro, "config": " ".join(layout), **facts,
                                  "rel_err": relative_error(got, *refs[name])})
    got, facts = run(layouts(backend)[0], world, samples, tok, 4, OBJECTIVES["dpo"][0], micro_means=True)
    if rank0():
        peers = {**facts, "rel_err": relative_error(got, *refs["dpo"])}
    finish(out_path, cases, peers if rank0() else None)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
