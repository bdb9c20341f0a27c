"""AdamW's fused kernel (exactrl/distributed/optim.py fused_adamw): where it runs, and that it
applies what torch's reference AdamW (the per-parameter loop) applies, within rounding. On the
CPU the fused kernel is the default for plain parameters, as it was; FSDP2's DTensors take it on
CUDA (torch shards the fused op as a pointwise one: checked here on a one-rank CPU mesh) and keep
the loop on the CPU, as they did."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
import torch.distributed as dist

from exactrl.config.schema import OptimConfig
from exactrl.distributed.optim import build_optimizer, fused_adamw

SHAPES = [(7, 5), (5,), (3, 4, 2), (64, 33)]
CFG = OptimConfig(name="adamw", lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def start(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def train(optimizer_of, steps: int = 5, wrap=lambda t: t):
    """(the parameters after ``steps`` steps on seeded gradients, the optimizer)."""
    params = [torch.nn.Parameter(wrap(t)) for t in start()]
    opt = optimizer_of(params)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = wrap(torch.randn(p.shape, generator=g))
        opt.step()
    return [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in params], opt


def loop(params):
    """torch's reference AdamW: one parameter at a time, neither foreach nor fused."""
    return torch.optim.AdamW(params, lr=CFG.lr, betas=CFG.betas, eps=CFG.eps, weight_decay=CFG.weight_decay,
                             foreach=False, fused=False)


def test_the_cpu_default_is_the_fused_kernel_and_agrees_with_the_loop():
    (fused, opt), (reference, _) = train(lambda p: build_optimizer(p, CFG)), train(loop)
    assert opt.defaults["fused"] is True  # today's CPU default, unchanged: seeded figures stay where they were
    ulp = torch.finfo(torch.float32).eps
    assert not all(torch.equal(f, s) for f, s in zip(fused, start()))
    for f, r in zip(fused, reference):
        # the two kernels round differently: within 16 ulps of the parameter (of lr, for one near 0); 1.64 seen
        # on AVX2, room for CPUs that round otherwise; a wrong update is off by lr, thousands of ulps
        torch.testing.assert_close(f, r, rtol=16 * ulp, atol=16 * ulp * CFG.lr)


def test_where_the_fused_kernel_runs():
    def param(kind: str, device: str, dtype=torch.float32):
        data = torch.empty(0) if kind == "plain" else SimpleNamespace()  # anything but a plain tensor: a DTensor
        floating = dtype.is_floating_point
        return SimpleNamespace(data=data, device=torch.device(device), is_floating_point=lambda: floating)

    assert fused_adamw([param("plain", "cpu"), param("plain", "cuda")])
    assert fused_adamw([param("dtensor", "cuda")])  # FSDP2 on a GPU
    assert not fused_adamw([param("dtensor", "cpu")])  # FSDP2 on the CPU, or offloaded there: the loop, as before
    assert not fused_adamw([param("plain", "cuda"), param("plain", "cuda", torch.int64)])
    assert not fused_adamw([param("plain", "meta")]) and not fused_adamw([])


@contextlib.contextmanager
def one_rank_mesh():
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        yield init_device_mesh("cpu", (1,))
    finally:
        if started:
            dist.destroy_process_group()


def test_fused_adamw_steps_dtensors_as_plain_tensors():
    """The fused op on FSDP2's parameter type gives the plain fused result bit for bit."""
    from torch.distributed.tensor import Shard, distribute_tensor

    def fused(params):
        return torch.optim.AdamW(params, lr=CFG.lr, betas=CFG.betas, eps=CFG.eps, weight_decay=CFG.weight_decay,
                                 fused=True)

    plain, _ = train(fused)
    with one_rank_mesh() as mesh:
        sharded, _ = train(fused, wrap=lambda t: distribute_tensor(t, mesh, [Shard(0)]))
        _, default = train(lambda p: build_optimizer(p, CFG), steps=1,
                           wrap=lambda t: distribute_tensor(t, mesh, [Shard(0)]))
    assert not default.defaults["fused"]  # a CPU DTensor keeps the loop
    assert all(torch.equal(a, b) for a, b in zip(plain, sharded))

