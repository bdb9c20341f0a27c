"""Is the training step deterministic? Once dropout and the noise settings exactrl knows are off
(packing.disable_dropout), a train-mode forward and backward must draw nothing from torch's
random streams, and two of them on the same batch must agree (logits bit for bit).

A training forward can be random by design in ways no dropout setting reaches: Phi-3.5-MoE's
router samples its experts with Gumbel noise in train mode (sparsemixer), and a model nobody
has tried may do anything. RL needs the training forward to compute the log-probs the
generator sampled with, so a random one is refused for ``rl`` (naming the module that draws);
``sft`` trains with it, as with dropout, and the packing self-check then compares in eval mode.
Costs two forwards of the probe sequences.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from exactrl.checks.packing import probe_sequences
from exactrl.device import device_of
from exactrl.models import packing


class DeterminismError(RuntimeError):
    """The training forward is random and the run needs it deterministic (rl)."""


@dataclass
class DeterminismReport:
    deterministic: bool
    source: str | None  # the first module whose train-mode output differed: "name (Class)"
    seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


def _tensors(out) -> list[torch.Tensor]:
    """Every tensor in a module's output (tensors, tuples, lists, dicts, ModelOutputs)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in _tensors(item)]
    return []


def _differ(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> bool:
    return len(xs) != len(ys) or any(x.shape != y.shape or not torch.equal(x, y) for x, y in zip(xs, ys))


def _traced_forward(model, inputs) -> tuple[torch.Tensor, list[tuple[str, list[torch.Tensor]]]]:
    """The logits and, in the order modules finished, each module's output tensors."""
    seen: list[tuple[str, list[torch.Tensor]]] = []
    names = {m: n for n, m in model.named_modules()}

    def hook(module, _args, out):
        seen.append((names.get(module, "?"), [t.detach().clone() for t in _tensors(out)]))

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        logits = model(**inputs).logits.detach().clone()
    finally:
        for h in handles:
            h.remove()
    return logits, seen


# The gradients of two identical steps: on CUDA, kernels that accumulate with atomics (index_add,
# embedding backward) differ in the last bits from run to run; a random backward (a sampled
# routing's gradient estimator, a random mask) differs by a whole term.
GRAD_RTOL = 1e-3


def _rng_state(device) -> list[torch.Tensor]:
    return [torch.random.get_rng_state()] + ([torch.cuda.get_rng_state(device)] if device.type == "cuda" else [])


def _drawing_module(model, inputs, device) -> str | None:
    """The first module (innermost: modules finish inside out) whose forward drew from torch's
    random streams; None when none did."""
    names = {m: n for n, m in model.named_modules()}
    before: dict = {}
    found: list[str] = []

    def pre(module, _args):
        before[module] = _rng_state(device)

    def post(module, _args, _out):
        if not found and any(not torch.equal(a, b) for a, b in zip(before.pop(module), _rng_state(device))):
            found.append(f"{names.get(module, '?')} ({type(module).__name__})")

    handles = [h for m in model.modules() for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None


def _step(model, inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward and backward of a fixed random weighting of the logits: (logits, the gradient
    with respect to the input embeddings). The weights are frozen meanwhile: no gradient buffer
    the size of the model is allocated, and nothing is left in .grad."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    leaves: list[torch.Tensor] = []

    def leaf(_module, _args, out):
        leaves.append(out.detach().requires_grad_())
        return leaves[-1]

    hook = model.get_input_embeddings().register_forward_hook(leaf)
    try:
        for p in trainable:
            p.requires_grad_(False)
        logits = model(**inputs).logits
        weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3)).to(logits.device)
        (logits.float() * weights).sum().backward()
    finally:
        hook.remove()
        for p in trainable:
            p.requires_grad_(True)
    return logits.detach(), leaves[0].grad


def check_determinism(model, vocab_size: int, lengths: list[int]) -> DeterminismReport:
    """Two train-mode forward and backward passes of sequences of ``lengths`` (right-padded) on
    ``model``: they must draw no random numbers (a draw that happened not to change anything
    this time still makes the step random), their logits must agree bit for bit and their
    gradients (with respect to the input embeddings) to GRAD_RTOL. ``source`` names the first
    module that drew, or whose outputs differ (in the order modules finish), or the backward.
    Leaves no gradient behind and draws nothing from the run's random streams."""
    t0 = time.perf_counter()
    seqs = probe_sequences(packing._hf_model(model).config, vocab_size, lengths, seed=1)
    inputs = packing.model_batch(model, seqs, 0, packed=False).inputs
    was_training = model.training
    model.train()
    device = device_of(model)
    source = None
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
        start = _rng_state(device)
        with torch.enable_grad():
            a, grad_a = _step(model, inputs)
            b, grad_b = _step(model, inputs)
        if any(not torch.equal(x, y) for x, y in zip(start, _rng_state(device))):
            # a step that draws random numbers is random by design, whether or not this draw changed anything
            source = _drawing_module(model, inputs, device) or "the backward pass (no module's forward draws)"
        elif not torch.equal(a, b):
            with torch.no_grad():
                _, first = _traced_forward(model, inputs)
                _, second = _traced_forward(model, inputs)
            source = next((name for (name, xs), (_, ys) in zip(first, second) if _differ(xs, ys)), "an unknown module")
            modules = dict(model.named_modules())
            if source in modules:
                source = f"{source} ({type(modules[source]).__name__})"
        elif (grad_a - grad_b).norm() > GRAD_RTOL * grad_a.norm():
            source = "the backward pass (the gradients of two identical steps differ)"
    model.train(was_training)
    return DeterminismReport(source is None, source, time.perf_counter() - t0)


def random_forward_message(report: DeterminismReport, what: str) -> str:
    return (f"{what}'s training step is random: two train-mode forward and backward passes of the same batch differ, "
            f"first in {report.source}, with dropout and the noise settings exactrl knows turned off "
            "(model.disable_dropout)")
