"""No host sync per micro-batch on the training path (issue 38).

On a GPU the host queues a micro-batch's kernels while the device runs the previous one's; an op
that makes the host wait for the device (exactrl/checks/syncs.py: a value read, a shape made
from values, a blocking copy) drains that queue, once per micro-batch and, in attention, once per
layer. These tests run the path a step runs -- collate, the packed or padded forward, the chunked
or plain head, the loss, the canary's share, backward -- under the detector, on the CPU standing
in for a device (``EMULATED``: the model's tensors and whatever comes from them are the device's,
a collated batch is the host's until it moves), and count.

What remains once per *step*, and is allowed: Worker.train_step's one read of the reduced metrics
and counts (its ``tolist``s: the metric sums, the maxima), the canary's reading, and the gradient
norm read by the engine before it decides to apply the step.
"""

from __future__ import annotations

import contextlib
import random
import warnings

import pytest
import torch

from exactrl.algorithms.registry import ALGORITHMS
from exactrl.algorithms.sft import demonstration, sft_objective
from exactrl.checks.syncs import EMULATED, HostSyncs
from exactrl.config import RLConfig, SFTConfig, load_config
from exactrl.data.batch import Sample
from exactrl.data.encode import SFTExample
from exactrl.distributed.engine import SingleEngine
from exactrl.distributed.step_plan import plan_step
from exactrl.losses.objective import Metrics
from exactrl.models import packing
from exactrl.tasks.tiny_model import build_tiny_model
from exactrl.workers.worker import Worker
from rl_helpers import attach_logprobs

PAD, LAYERS = 0, 3
# The syncs of one step (op, function), whatever its number of micro-batches.
PER_STEP = {("Tensor.tolist", "train_step"), ("aten._local_scalar_dense.default", "read"),
            ("aten._local_scalar_dense.default", "step")}
VARIANTS = {
    "packed": [],
    "padded": ["train.padding_free=false"],
    "packed, head in chunks": ["train.logprob_chunk_size=5"],
    "padded, head in chunks": ["train.padding_free=false", "train.logprob_chunk_size=5"],
    "packed, checkpointed": ["train.gradient_checkpointing=true"],
}


def model(seed: int = 0):
    """A small Llama whose attention takes packed rows, as exactrl loads every model (models/loading.py)."""
    return packing.enable(build_tiny_model(64, PAD, 1, 2, seed=seed, hidden_size=32, num_hidden_layers=LAYERS,
                                           num_attention_heads=4, num_key_value_heads=2, intermediate_size=64).float())


def seqs(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 60) for _ in range(rng.randrange(4, 20))] for _ in range(n)]


def sft_batch(n: int = 6):
    out = []
    for i, s in enumerate(seqs(n, 1)):
        k = 1 + i % (len(s) - 1)
        out.append(demonstration(SFTExample(input_ids=s, loss_mask=[0] * k + [1] * (len(s) - k), source="test")))
    return out


def grpo_batch(n: int = 6):
    g = torch.Generator().manual_seed(0)
    out = []
    for i, s in enumerate(seqs(n, 2)):
        resp = torch.randint(3, 60, (2 + (i * 5) % 9,), generator=g).tolist()
        adv = torch.tensor([0.0] * (len(s) - 1) + [float(i % 3) - 1.0] * len(resp))
        out.append(Sample(s, resp, reward=float(i % 2), advantages=adv))
    for field, seed in (("old_logprobs", 6), ("ref_logprobs", 7)):  # not the policy's: ratios and KL are not trivial
        attach_logprobs(model(seed), out, field, [list(range(n))], PAD, 1.0, contextlib.nullcontext)
    return out


def setup(kind: str, overrides: list[str], device: torch.device = EMULATED):
    """(worker on ``device``, the emulated one by default; batch, objective, loss tokens)."""
    if kind == "sft":
        cfg = load_config(SFTConfig, None, overrides)
        batch, objective = sft_batch(), sft_objective(cfg.train.loss_agg, cfg.train.loss_agg_norm)
    else:
        cfg = load_config(RLConfig, None, ["algo.kl_coef=0.1", "algo.entropy_coef=0.01", "algo.group_size=2",
                                           *overrides])
        batch, objective = grpo_batch(), ALGORITHMS.lookup(cfg.algo.name).objective(cfg)
    tokens = [s.loss_tokens for s in batch]
    m = model()
    engine = SingleEngine(m, cfg.model, cfg.train, cfg.optim, cfg.audit, 4, device=device, fault=cfg.fault)
    worker = Worker("policy", m, engine, pad_id=PAD, packed=cfg.train.padding_free,
                    temperature=getattr(getattr(cfg, "rollout", None), "temperature", 1.0))
    return worker, batch, objective, tokens


def detector(worker) -> HostSyncs:
    """The detector with the worker's model and canary on the (emulated) device; on CUDA, CUDA's tensors."""
    if worker.engine.device.type == "cuda":
        return HostSyncs()
    canary = worker.engine.canary.module
    return HostSyncs(on_device=[*worker.model.parameters(), *worker.model.buffers(), *canary.parameters()])


def sites(found: HostSyncs) -> list[tuple[str, str]]:
    return sorted((s.what.split(" ")[0], s.where.rsplit(" in ", 1)[-1]) for s in found.syncs)


def step(worker, batch, objective, tokens, micro: int) -> HostSyncs:
    plan = plan_step(tokens, micro, "token-mean")
    with detector(worker) as found:
        worker.train_step(batch, plan, objective)
    return found


@pytest.mark.parametrize("kind", ["sft", "grpo"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_micro_batch_makes_the_host_wait_for_nothing(kind, variant):
    worker, batch, objective, tokens = setup(kind, VARIANTS[variant])
    plan = plan_step(tokens, 3, "token-mean")
    normalizers = objective.normalizers(plan)
    worker.engine.begin_step(len(plan.micro_batches))
    for mb in plan.micro_batches:
        with detector(worker) as found:
            loss, share, mask = worker.micro_batch([batch[i] for i in mb], objective, normalizers, Metrics())
            worker.engine.backward(loss, share, num_samples=mask.size(0))
        assert found.syncs == [], [str(s) for s in found.syncs]
    assert worker.engine.step(plan)["canary"] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["sft", "grpo"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_on_the_gpu_no_micro_batch_waits(kind, variant, gpu_device):
    """On CUDA (make gpu-check): the detector sees no CUDA tensor read, and torch's own sync debug
    mode, which warns at every synchronising call (a blocking copy's stream sync too), none either."""
    worker, batch, objective, tokens = setup(kind, VARIANTS[variant], gpu_device if gpu_device.type == "cuda"
                                             else EMULATED)
    plan = plan_step(tokens, 3, "token-mean")
    normalizers = objective.normalizers(plan)
    worker.engine.begin_step(len(plan.micro_batches))
    cuda = gpu_device.type == "cuda"
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for mb in plan.micro_batches:
            with detector(worker) as found:
                if cuda:
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    loss, share, mask = worker.micro_batch([batch[i] for i in mb], objective, normalizers, Metrics())
                    worker.engine.backward(loss, share, num_samples=mask.size(0))
                finally:
                    if cuda:
                        torch.cuda.set_sync_debug_mode("default")
            assert found.syncs == [], [str(s) for s in found.syncs]
    assert [str(w.message) for w in warned if "synchroniz" in str(w.message)] == []
    assert worker.engine.step(plan)["canary"] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("kind", ["sft", "grpo"])
@pytest.mark.parametrize("variant", ["packed", "padded, head in chunks"])
def test_a_step_waits_only_for_its_per_step_reads(kind, variant):
    worker, batch, objective, tokens = setup(kind, VARIANTS[variant])
    step(worker, batch, objective, tokens, 6)  # the first step creates the optimizer's state
    one, three = (step(worker, batch, objective, tokens, micro) for micro in (6, 2))
    assert sites(one) == sites(three)  # the same syncs for 1 and for 3 micro-batches: none per micro-batch
    assert set(sites(one)) == PER_STEP | ({("Tensor.tolist", "train_step")} if kind == "grpo" else set())
    assert len(one.syncs) == len(PER_STEP) + (kind == "grpo")  # GRPO's maxima: a second tolist


def _gather_index_with_nonzero(cu, width, n):
    """The gather path's indices as taken before issue 38: a nonzero of the valid slots."""
    lengths = cu[1:] - cu[:-1]
    pos = torch.arange(width, device=cu.device)
    valid = pos[None, :] < lengths[:, None]
    gather = torch.where(valid, cu[:-1, None] + pos[None, :], cu[:-1, None]).flatten()
    return gather, valid.flatten().nonzero()[:, 0]


def test_the_detector_sees_a_nonzero_in_every_layer(monkeypatch):
    """What the micro-batch test would fail on: the old gather indices, one sync per layer."""
    worker, batch, objective, tokens = setup("sft", [])
    monkeypatch.setattr(packing, "_gather_index", _gather_index_with_nonzero)
    plan = plan_step(tokens, 6, "token-mean")
    with detector(worker) as found:
        worker.micro_batch(batch, objective, objective.normalizers(plan), Metrics())
    assert sites(found) == [("aten.nonzero.default", "_gather_index_with_nonzero")] * LAYERS


def test_packed_indices_are_the_nonzero_ones():
    """The gather path's indices, now from the lengths alone, equal the nonzero-based ones."""
    for lengths in ([1], [5], [3, 1, 4], [7, 7, 2, 1, 9]):
        cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
        width, n = max(lengths), sum(lengths)
        got, want = packing._gather_index(cu, width, n), _gather_index_with_nonzero(cu, width, n)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), lengths


def test_the_detector_tells_device_reads_from_host_work():
    weight = torch.randn(4, 3)
    host = torch.tensor([1.0, 0.0, 2.0])
    with HostSyncs(on_device=[weight]) as found:
        x = weight @ host  # the device's
        host.sum().item(), host.tolist(), host.nonzero(), host[host > 0]  # the host's: no wait
        moved = host.to(EMULATED, non_blocking=True)  # asynchronous: no wait
        assert moved is not host and moved.device == EMULATED and host.device != EMULATED
        torch.zeros(2, device=x.device) + 1  # made on the device
        expected = [x.sum().item(), bool(x[0] > 0), x.tolist(), x.cpu(), x.to("cpu"), x.nonzero(), x[x > 0],
                    torch.where(x > 0), x.masked_select(x > 0), host.to(EMULATED), torch.tensor([1], device=x.device),
                    torch.equal(x, x), torch.zeros(2, device=x.device).nonzero()]
    assert len(expected) == len(found.syncs) == 13, [str(s) for s in found.syncs]
    assert all("test_host_syncs.py" in s.where for s in found.syncs)
