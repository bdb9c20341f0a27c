"""One process of `exactrl audit stack`: real tiny training steps on the installed stack.

Imports only torch (and DeepSpeed when asked), never the rest of exactrl, so it can audit
another Python environment: ``ENV/bin/python -m exactrl.audit.stack_worker`` with this
repository on PYTHONPATH. Each configuration trains a small MLP for one optimizer step
with K accumulation steps the way users do (each micro-batch's loss is its mean; the
backend divides by K and averages over ranks) and compares the applied update with plain
torch SGD on the full batch. Prints one JSON line per configuration; an exception in one
configuration is reported as an error for it and the audit goes on.

Before the first row, the one-off costs: the process group and, when a configuration needs it,
DeepSpeed's communication layer, which on the CPU JIT-compiles its shared-memory op the first
time on a machine (minutes on 2 cores; then cached in TORCH_EXTENSIONS_DIR). Rank 0 says when
that starts (``AUDIT-STAGE deepspeed``) and when every rank is ready (``AUDIT-READY``), so the
caller's progress counts rows, not compilation.

usage: python -m exactrl.audit.stack_worker CONFIGS_JSON   (a list of {backend, stage, offload, k})
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch

from exactrl.distributed.launch import end_rank, shutdown, single_process_env

MICRO, DIM = 4, 16


def _data(k: int, world: int):
    g = torch.Generator().manual_seed(0)
    return torch.randn(MICRO * k * world, DIM, generator=g), torch.randn(MICRO * k * world, 4, generator=g)


def _fresh():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


def reference_update(k: int, world: int) -> torch.Tensor:
    x, y = _data(k, world)
    model = _fresh()
    before = _flat(model)
    ((model(x) - y) ** 2).mean().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return _flat(model) - before


def _my_batches(k: int, world: int, rank: int):
    x, y = _data(k, world)
    per = MICRO * k
    return [(x[rank * per + i * MICRO: rank * per + (i + 1) * MICRO], y[rank * per + i * MICRO: rank * per
                                                                        + (i + 1) * MICRO])
            for i in range(k)]


def deepspeed_update(stage: int, offload: str, k: int, world: int, rank: int) -> torch.Tensor:
    import deepspeed

    model = _fresh()
    before = _flat(model)
    cfg = {"train_batch_size": MICRO * k * world, "train_micro_batch_size_per_gpu": MICRO,
           "gradient_accumulation_steps": k,
           "zero_optimization": {"stage": stage, **({"offload_optimizer": {"device": offload}} if offload != "none"
                                                    else {})},
           "gradient_clipping": 0.0, "zero_force_ds_cpu_optimizer": False, "zero_allow_untested_optimizer": True,
           "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    for xb, yb in _my_batches(k, world, rank):
        engine.backward(((engine(xb) - yb) ** 2).mean())
        engine.step()
    if stage == 3:
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            return _flat(model) - before
    return _flat(model) - before


def torch_update(backend: str, k: int, world: int, rank: int) -> torch.Tensor:
    """Plain torch accumulation (loss / K, DDP-style averaging), or FSDP2's."""
    model = _fresh()
    before = _flat(model)
    if backend == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    for xb, yb in _my_batches(k, world, rank):
        (((model(xb) - yb) ** 2).mean() / k).backward()
    if backend == "torch" and world > 1:
        for p in model.parameters():
            torch.distributed.all_reduce(p.grad)
            p.grad /= world
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    if backend == "fsdp2":
        return torch.cat([p.detach().full_tensor().reshape(-1) for p in model.parameters()]) - before
    return _flat(model) - before


def main(configs: list[dict]) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    single_process_env()  # a free port: audits running side by side do not collide
    torch.distributed.init_process_group("gloo")
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    if any(c["backend"] == "deepspeed" for c in configs):
        if rank == 0:
            print("AUDIT-STAGE deepspeed", flush=True)
        try:  # what deepspeed.initialize would do in the first row (compiling the shm op on first use)
            import deepspeed

            deepspeed.init_distributed(dist_backend="gloo")
        except Exception:  # pragma: no cover - each DeepSpeed row then reports the stack's error itself
            pass
    torch.distributed.barrier()
    if rank == 0:
        print("AUDIT-READY", flush=True)
    for c in configs:
        row = {**c, "world": world}
        try:
            if c["backend"] == "deepspeed":
                got = deepspeed_update(c["stage"], c["offload"], c["k"], world, rank)
            else:
                got = torch_update(c["backend"], c["k"], world, rank)
            ref = reference_update(c["k"], world)
            row["rel_err"] = float((got - ref).norm() / ref.norm())
        except Exception as e:  # the stack cannot run this configuration: report, go on
            row["error"] = (traceback.format_exception_only(type(e), e)[-1].strip())[:300]
        if rank == 0:
            print("AUDIT " + json.dumps(row), flush=True)
    shutdown()
    end_rank()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
