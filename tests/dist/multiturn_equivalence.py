"""Multi-turn episodes' one-step update on a distributed backend at world size 2 is the single-process full-batch
update of multiturn_references.py (the loss written out over the whole batch's policy tokens, plain torch); run by
tests/test_multiturn_exactness.py under torchrun.

usage: python multiturn_equivalence.py BACKENDS WORLD OUT.json
       BACKENDS: fsdp2, deepspeed or both (fsdp2,deepspeed: one launch, one process group, the start-up paid once)

Eight episodes of 15 to 37 policy tokens and 10 to 67 template and environment tokens, two ranks of four. FSDP2
(float64): every aggregation mode, micro-batches of 1 and 2. DeepSpeed ZeRO-2 with the optimizer offloaded to the
CPU (a float64 model stepped through fp32 master weights): every mode, micro-batches of 1 (four accumulation steps
per rank). Each case: one SGD step through Worker.train_step under GRPO's objective (clipped surrogate, k3 KL,
entropy bonus), the canary on, compared on rank 0 with one SGD step on the reference loss. Then token-mean once more
with each micro-batch normalised by its own policy tokens (the peers' mean of means), to show the comparison tells
the two apart.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import torch.distributed as dist
from equivalence import dtype_of, full_state, precision, relative_error
from multiturn_references import MODES, fresh_model, make_samples, overrides, sgd_reference

from exactrl.algorithms.registry import ALGORITHMS
from exactrl.algorithms.rl import step_plan
from exactrl.config import RLConfig, load_config
from exactrl.distributed.engine import build_engine
from exactrl.distributed.launch import end_rank, shutdown
from exactrl.tasks.tokenizer import build_tokenizer
from exactrl.workers.worker import Worker

LAYOUTS = {"fsdp2": ["distributed.backend=fsdp2"],
           "deepspeed": ["distributed.backend=deepspeed", "deepspeed.zero_stage=2", "deepspeed.offload_optimizer=cpu"]}
MICRO = {"fsdp2": (1, 2), "deepspeed": (1,)}


def run(tok, samples, backend: str, world: int, mode: str, micro: int, micro_means: bool = False):
    """(full parameters after one optimizer step through Worker.train_step, facts of the step)."""
    cfg = load_config(RLConfig, None, [*overrides(mode, micro, world), *LAYOUTS[backend]])
    model = fresh_model(tok, dtype=dtype_of(cfg))
    engine = build_engine(model, cfg, total_steps=1)
    policy = Worker("policy", model, engine, pad_id=tok.pad_token_id, packed=cfg.train.padding_free,
                    temperature=cfg.rollout.temperature)
    plan = replace(step_plan(samples, cfg, engine.world_size), micro_means=micro_means)
    result = policy.train_step(samples, plan, ALGORITHMS.lookup("grpo").objective(cfg))
    ranks = [plan.for_rank(r).micro_batches for r in range(world)]
    facts = {"mode": mode, "micro": micro, "canary": result.stats["canary"], "precision": precision(cfg),
             "loss": result.loss, "samples_per_rank": [sum(map(len, mbs)) for mbs in ranks],
             "policy_tokens_per_rank": [sum(samples[i].loss_tokens for mb in mbs for i in mb) for mbs in ranks]}
    return full_state(engine, model), facts


def root() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0  # the first engine starts the process group


def main(backends: str, world: int, out_path: str) -> None:
    tok = build_tokenizer()
    samples, episodes = make_samples(tok)
    init, refs, out = fresh_model(tok).state_dict(), {}, {}
    for backend in backends.split(","):
        cases = []
        for mode in MODES:
            for micro in MICRO[backend]:
                got, facts = run(tok, samples, backend, world, mode, micro)
                if root():
                    ref, value = refs[mode] = refs.get(mode) or sgd_reference(tok, samples, episodes, mode)
                    cases.append({**facts, "rel_err": relative_error(got, ref, init),
                                  "loss_rel_diff": abs(facts["loss"] - value) / abs(value)})
        got, facts = run(tok, samples, backend, world, "token-mean", 2, micro_means=True)
        if root():
            out[backend] = {"cases": cases, "peers": {**facts, "rel_err": relative_error(got, refs["token-mean"][0],
                                                                                          init)}}
    if root():
        with open(out_path, "w") as f:
            json.dump(out, f)
    shutdown()
    end_rank()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
