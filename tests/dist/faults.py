"""fault.dropped_micro_batches on the distributed engines: one optimizer step of K = 4 micro-batches
per rank, FSDP2 and DeepSpeed ZeRO-2 with the optimizer offloaded to CPU (where the real bug sat),
under audit.canary=warn; run by tests/test_faults_backends.py (under torchrun for world size 2, or
as one process); writes one JSON result file.

usage: python faults.py ci WORLD OUT.json

The model is a small fp32 MLP regression driven through the engine interface, micro-batch c on rank
c % world as the step plan lays it out, each micro-batch's loss its sum of squared errors over the
step's sample count. The references are plain torch SGD: on the micro-batches the bug keeps (each
rank's first and last) and on the whole batch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from equivalence import full_state, relative_error
from variable_micro import DIM, LR, MICRO, Regression, config

from exactrl.distributed.engine import build_engine
from exactrl.distributed.launch import end_rank, shutdown
from exactrl.distributed.step_plan import plan_step

K = 4
LAYOUTS = [("fsdp2", []), ("deepspeed", ["deepspeed.zero_stage=2", "deepspeed.offload_optimizer=cpu"])]


def sgd_on(x, y, rows) -> dict:
    """Plain SGD on the squared error of ``rows``, summed and divided by the whole step's sample count."""
    model = Regression()
    ((model(x[rows]) - y[rows]) ** 2).sum().div(len(x)).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main(which: str, world: int, out_path: str) -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(K * MICRO * world, DIM, generator=g), torch.randn(K * MICRO * world, 1, generator=g)
    plan = plan_step([1] * len(x), MICRO, "token-mean", world_size=world)
    kept = [i for r in range(world) for mb in (plan.for_rank(r).micro_batches[0], plan.for_rank(r).micro_batches[-1])
            for i in mb]
    results = []
    for backend, extra in LAYOUTS:
        cfg = config(backend, [*extra, "fault.dropped_micro_batches=true", "audit.canary=warn"], world, K)
        model = Regression()
        engine = build_engine(model, cfg, total_steps=1)
        mine = plan.for_rank(engine.rank)
        engine.begin_step(len(mine.micro_batches))
        for mb in mine.micro_batches:
            loss = ((engine.forward(model, x=x[list(mb)]) - y[list(mb)]) ** 2).sum() / len(x)
            engine.backward(loss, len(mb) / len(x), len(mb))
        stats = engine.step(mine)
        got, init = full_state(engine, model), Regression().state_dict()
        if engine.rank == 0:
            results.append({"backend": backend, "config": " ".join(extra), "canary": stats["canary"],
                            "canary_fired": stats["canary_fired"], "micro_batches": stats["micro_batches"],
                            "kept_share": len(kept) / len(x),
                            "rel_err_bugged": relative_error(got, sgd_on(x, y, kept), init),
                            "rel_err_full": relative_error(got, sgd_on(x, y, list(range(len(x)))), init)})
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps({"cases": results}))
    shutdown()
    end_rank()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
