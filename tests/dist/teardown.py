"""One 2-rank run's life and end, for tests/test_teardown.py: an FSDP2 and a DeepSpeed ZeRO-2 engine
(optimizer offloaded to CPU) built in this process, one step each, then the end every exactrl command
takes (launch.shutdown, then launch.end_rank), or with ``interpreter`` the interpreter's own exit
after shutdown, the end before launch.end_rank existed.

usage: torchrun --nproc_per_node=2 teardown.py end_rank|interpreter
"""

from __future__ import annotations

import sys

import torch
from variable_micro import DIM, MICRO, Regression, config

from exactrl.distributed.engine import build_engine
from exactrl.distributed.launch import end_rank, shutdown
from exactrl.distributed.step_plan import plan_step

LAYOUTS = [("fsdp2", []), ("deepspeed", ["deepspeed.zero_stage=2", "deepspeed.offload_optimizer=cpu"])]


def main(how: str) -> None:
    engines = []  # kept alive to the end, as a run keeps its engines
    for backend, extra in LAYOUTS:
        cfg = config(backend, extra, 2, 2)
        model = Regression()
        engine = build_engine(model, cfg, total_steps=1)
        g = torch.Generator().manual_seed(engine.rank)
        x, y = torch.randn(2 * MICRO, DIM, generator=g), torch.randn(2 * MICRO, 1, generator=g)
        mine = plan_step([1] * (4 * MICRO), MICRO, "token-mean", world_size=2).for_rank(engine.rank)
        engine.begin_step(len(mine.micro_batches))
        for mb in mine.micro_batches:
            rows = [i % len(x) for i in mb]
            loss = ((engine.forward(model, x=x[rows]) - y[rows]) ** 2).sum() / (4 * MICRO)
            engine.backward(loss, len(mb) / (4 * MICRO), len(mb))
        engine.step(mine)
        engines.append((engine, model))
    shutdown()
    if how == "end_rank":
        end_rank()


if __name__ == "__main__":
    main(sys.argv[1])
