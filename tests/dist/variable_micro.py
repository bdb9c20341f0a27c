"""Optimizer steps whose micro-batch counts differ from step to step (1, 3, 4, 2 per rank), on
every engine, against one full-batch pass; run by tests/test_variable_micro_batches.py (under
torchrun for world size 2, or as one process); writes one JSON result file.

usage: python variable_micro.py {ci,all,old} WORLD OUT.json

Mixed-policy methods (HPT, ReLIFT) give a step as many micro-batches as its data needs, so the
engine learns each step's count from ``engine.begin_step`` and DeepSpeed's configured
gradient_accumulation_steps (global batch / (micro batch x world), here 2) is only nominal. Each
case drives the engine interface (begin_step, forward, backward, step) over four steps of a
small fp32 MLP regression, micro-batch c of a step on rank c % world as the step plan lays it
out, each micro-batch's loss its sum of squared errors over the step's sample count; the
reference is plain torch SGD on each step's whole batch, its mean squared error in one forward.

``old`` runs on a DeepSpeed with the CPU-offload accumulation bug (0.15.2-0.18.x, one process):
steps of 1, 2, 3 micro-batches until the canary stops one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from equivalence import relative_error

from exactrl.checks.canary import CanaryError
from exactrl.config import SFTConfig, load_config
from exactrl.distributed.engine import SampleAccountingError, build_engine
from exactrl.distributed.launch import end_rank, shutdown
from exactrl.distributed.step_plan import plan_step

COUNTS = (1, 3, 4, 2)  # micro-batches per rank in each step; DeepSpeed is configured with 2
MICRO, DIM, LR = 2, 8, 0.1
CI = [("fsdp2", []), ("deepspeed", ["deepspeed.zero_stage=2", "deepspeed.offload_optimizer=cpu"]),
      ("deepspeed", ["deepspeed.zero_stage=1", "deepspeed.offload_optimizer=cpu"]),
      ("deepspeed", ["deepspeed.zero_stage=3", "deepspeed.offload_optimizer=cpu", "deepspeed.offload_param=cpu"])]
ALL = [("single", []), ("fsdp2", [])] + [
    ("deepspeed", [f"deepspeed.zero_stage={s}", f"deepspeed.offload_optimizer={o}"])
    for s in (0, 1, 2, 3) for o in (("none", "cpu") if s else ("none",))] + [
    ("deepspeed", ["deepspeed.zero_stage=3", "deepspeed.offload_optimizer=cpu", "deepspeed.offload_param=cpu"])]


class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.net = torch.nn.Sequential(torch.nn.Linear(DIM, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)


def steps(world: int, counts=COUNTS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(n * MICRO * world, DIM, generator=g), torch.randn(n * MICRO * world, 1, generator=g)) for n in counts]


def reference(data) -> dict:
    model = Regression()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in data:
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def config(backend: str, extra: list[str], world: int, nominal_k: int):
    return load_config(SFTConfig, None, [f"distributed.backend={backend}", f"distributed.nproc_per_node={world}", *extra,
                                         f"train.global_batch_size={nominal_k * MICRO * world}", f"train.micro_batch_size={MICRO}",
                                         "train.max_grad_norm=0", "optim.name=sgd", f"optim.lr={LR}", "optim.scheduler=constant"])


def exactrl_run(cfg, data) -> tuple[dict | None, list[dict], int, str | None]:
    """(final weights, each step's stats, rank, the canary's message if it stopped a step)."""
    from equivalence import full_state

    model = Regression()
    engine = build_engine(model, cfg, total_steps=len(data))
    stats = []
    for x, y in data:
        plan = plan_step([1] * len(x), MICRO, "token-mean", world_size=engine.world_size).for_rank(engine.rank)
        engine.begin_step(len(plan.micro_batches))
        for mb in plan.micro_batches:
            loss = ((engine.forward(model, x=x[list(mb)]) - y[list(mb)]) ** 2).sum() / len(x)
            engine.backward(loss, len(mb) / len(x), len(mb))
        try:
            stats.append(engine.step(plan))
        except CanaryError as e:
            return None, stats, engine.rank, str(e)
    return full_state(engine, model), stats, engine.rank, None


def unequal_counts(cfg) -> str:
    """Ranks that would step over different micro-batch counts must stop before any backward."""
    engine = build_engine(Regression(), cfg, total_steps=1)
    try:
        engine.begin_step(1 + engine.rank)
        return "not raised"
    except SampleAccountingError as e:
        return str(e)


def main(which: str, world: int, out_path: str) -> None:
    data = steps(world, (1, 2, 3) if which == "old" else COUNTS)
    layouts = {"ci": [(b, e, 2) for b, e in CI], "all": [(b, e, k) for b, e in ALL for k in (1, 2, 4)],
               "old": [("deepspeed", CI[1][1], 1), ("deepspeed", CI[1][1], 2), ("deepspeed", CI[2][1], 1)]}[which]
    results = []
    for backend, extra, nominal_k in layouts:
        if backend == "single" and world > 1:
            continue
        got, stats, rank, stopped = exactrl_run(config(backend, extra, world, nominal_k), data)
        if rank == 0:
            results.append({"backend": backend, "config": " ".join(extra), "nominal_k": nominal_k, "stopped": stopped,
                            "rel_err": None if got is None else relative_error(got, reference(data), Regression().state_dict()),
                            "canary": [s["canary"] for s in stats], "micro_batches": [s["micro_batches"] for s in stats]})
    unequal = {b: unequal_counts(config(b, e, world, 2)) for b, e in CI[:2]} if world > 1 and which != "old" else {}
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps({"cases": results, "unequal": unequal}))
    shutdown()
    end_rank()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
