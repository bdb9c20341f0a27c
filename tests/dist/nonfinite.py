"""Non-finite gradients on a distributed backend, one rank poisoned: every rank must make the
same decision (stop, or skip) and the weights must stay bitwise what they were. Run by
tests/test_nonfinite_backends.py under torchrun (world size 2) or as one process.

usage: python nonfinite.py {fsdp2,deepspeed} WORLD OUT.json
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from equivalence import COMPLETIONS, SMALL, full_state
from rl_helpers import sft_micro_batch_loss
from exactrl.config import SFTConfig, load_config
from exactrl.data.encode import encode_sft
from exactrl.data.jsonl import Row
from exactrl.distributed.engine import NonFiniteError, build_engine
from exactrl.distributed.launch import end_rank, shutdown
from exactrl.distributed.step_plan import plan_step
from exactrl.tasks.tiny_model import build_tiny_model
from exactrl.tasks.tokenizer import build_tokenizer


def step(engine, model, tok, exs, poison_rank: int | None):
    plan = plan_step([e.loss_tokens for e in exs], 2, "token-mean", world_size=engine.world_size)
    mine = plan.for_rank(engine.rank)
    engine.begin_step(len(mine.micro_batches))
    for i, mb in enumerate(mine.micro_batches):
        loss, share = sft_micro_batch_loss(model, engine, [exs[j] for j in mb], tok.pad_token_id, plan.normalizer)
        if engine.rank == poison_rank and i == len(mine.micro_batches) - 1:
            loss = loss * float("nan")
        engine.backward(loss, share, len(mb))
    return engine.step(mine)


def main(backend: str, world: int, out_path: str) -> None:
    tok = build_tokenizer()
    exs = encode_sft([Row(f"t:{i}", {"prompt": f"{i}+{i}=", "completion": c}) for i, c in enumerate(COMPLETIONS)], tok, 256)
    fresh = lambda: build_tiny_model(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, seed=3, **SMALL)  # noqa: E731
    poison = world - 1  # the last rank only: the others must still stop or skip with it
    policies = ["error", "skip"] if backend != "deepspeed" else ["error"]
    out = {}
    for policy in policies:
        model = fresh()
        cfg = load_config(SFTConfig, None, [f"distributed.backend={backend}", f"distributed.nproc_per_node={world}",
                                            "train.global_batch_size=8", "train.micro_batch_size=2", "optim.scheduler=constant",
                                            f"train.nonfinite={policy}", "deepspeed.zero_stage=2"])
        engine = build_engine(model, cfg, total_steps=2)
        before = {k: v.detach().clone() for k, v in full_state(engine, model).items()}
        try:
            stats = step(engine, model, tok, exs, poison)
            result = {"raised": None, "skipped": stats["skipped_nonfinite"]}
        except NonFiniteError as e:
            result = {"raised": str(e)}
        after = full_state(engine, model)
        result["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
        if policy == "skip":  # a good step afterwards really updates
            step(engine, model, tok, exs, None)
            result["moved_after"] = not all(torch.equal(before[k], v) for k, v in full_state(engine, model).items())
        out[policy] = result
    if dist.get_rank() == 0:
        json.dump(out, open(out_path, "w"))
    shutdown()
    end_rank()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
