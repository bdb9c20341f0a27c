"""The output head in chunks of tokens: per-token log-probs without the [tokens x vocabulary] logits.

A micro-batch of 16k tokens over a 32k vocabulary has 2 GB of fp32 logits; their log-softmax
and the gradient of both take as much again. None of that is needed: the losses read one
number per token (the target's log-prob, an entropy, a kept-set log-prob). Inside
``per_token_head``, the model's output head -- its ``get_output_embeddings()`` Linear --
computes those numbers ``chunk`` tokens at a time and returns them in place of the logits:
``model(**inputs).logits`` is [B, T-1, fields] (exactrl/workers/worker.py). Backward recomputes
each chunk's logits and differentiates the same per-row functions (``ChunkedHead``), so the
largest tensor is one chunk's [chunk, vocabulary].

The head runs inside the model's own forward, so whatever gathers its weight for the forward
and its backward (FSDP2's root unit, DeepSpeed ZeRO-3's hooks on the head's output) does so as
for the plain head, and a tied head is the embedding's own parameter. What a model applies to
its logits after the head is folded in (``post_ops``: Gemma's final-logit softcap, Cohere's
logit scale, Granite's logits scaling) and switched off in the model for the call; the head
self-check (exactrl/checks/head.py) compares the result with the model's own logits on every
model before the first step, so a model that does anything else after its head keeps the plain
path.

Numbers: each token's row is computed by itself, as the plain path computes it, in the same
dtypes (the head under the run's autocast, the rest in fp32 at least). A micro-batch of at most
``chunk`` positions runs exactly the plain path's operations (bit-identical values and
gradients); more are split, which changes only the rounding of the head's matmuls and of the
weight gradient's sum over chunks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from exactrl.losses.token_losses import entropy_rows, kept_rows, logprob_rows
from exactrl.models.packing import base_model

# The per-token fields the head can compute in chunks; a field over the whole vocabulary (the
# logits of a divergence) needs the plain head.
FIELDS = ("logprobs", "kept_logprobs", "entropy")


@dataclass(frozen=True)
class Sampling:
    """How log-probs are taken: the rollout's temperature and the top-p/top-k kept set."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


def row_fn(name: str, s: Sampling) -> Callable:
    """``name``'s per-row function: (logits rows [N, V], targets [N]) -> [N]."""
    if name == "logprobs":
        return partial(logprob_rows, temperature=s.temperature)
    if name == "kept_logprobs":
        return partial(kept_rows, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
    if name == "entropy":
        return lambda rows, targets: entropy_rows(rows, s.temperature)
    raise ValueError(f"the chunked head computes {', '.join(FIELDS)}, not '{name}'")


# --- what models apply after their head ---------------------------------------------------------
# Each: (where the setting lives, its name, the op). Attributes of the model are read from the
# model, the others from its text config; the model's own value is switched to ``off`` for the call.
POST_OPS = (
    ("config", "final_logit_softcapping", "softcap", None),  # Gemma 2/3, and models copied from them
    ("config", "logits_scaling", "div", 1.0),  # Granite
    ("model", "logit_scale", "mul", 1.0),  # Cohere
)


def post_ops(hf) -> list[tuple[str, str, str, object, float]]:
    """The post-head ops ``hf`` applies: (where, name, op, off value, value)."""
    config = hf.config.get_text_config(decoder=True)
    found = []
    for where, name, op, off in POST_OPS:
        value = getattr(hf if where == "model" else config, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value != off:
            found.append((where, name, op, off, float(value)))
    return found


def apply_post(logits: torch.Tensor, ops) -> torch.Tensor:
    """``ops`` on ``logits``, written as the models write them (the same roundings)."""
    for _, _, op, _, value in ops:
        if op == "softcap":
            logits = torch.tanh(logits / value) * value
        elif op == "div":
            logits = logits / value
        else:
            logits = logits * value
    return logits


@contextlib.contextmanager
def _ops_off(hf, ops) -> Iterator[None]:
    config = hf.config.get_text_config(decoder=True)
    saved = [(hf if where == "model" else config, name, getattr(hf if where == "model" else config, name))
             for where, name, _, _, _ in ops]
    try:
        for (obj, name, _), op in zip(saved, ops):
            object.__setattr__(obj, name, op[3])  # past a strict config's validation (Gemma 3n)
        yield
    finally:
        for obj, name, value in saved:
            object.__setattr__(obj, name, value)


# --- the chunked computation ----------------------------------------------------------------------
class ChunkedHead(torch.autograd.Function):
    """``trained`` fields (differentiable) and ``metrics`` fields (not) of ``hidden`` [N, H]
    through the head (``weight`` [V, H], ``bias``) and ``ops``, ``chunk`` rows at a time; each
    field [N]. Saves only its inputs; backward recomputes chunk by chunk under the forward's
    autocast."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, spec):
        trained, metrics, chunk = spec["trained"], spec["metrics"], spec["chunk"]
        ctx.spec, ctx.autocast = spec, _autocast_state(hidden.device.type)
        ctx.save_for_backward(hidden, weight, bias, targets)
        with torch.no_grad():
            parts = [_fields(h, weight, bias, t, trained + metrics, spec) for h, t in zip(hidden.split(chunk),
                                                                                            targets.split(chunk))]
        out = [torch.cat([p[i] for p in parts]) for i in range(len(trained) + len(metrics))]
        ctx.mark_non_differentiable(*out[len(trained):])
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        hidden, weight, bias, targets = ctx.saved_tensors
        spec = ctx.spec
        live = [i for i, g in enumerate(grads[: len(spec["trained"])]) if g is not None]
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        want_b = want_b and bias is not None
        grad_h = torch.zeros_like(hidden) if want_h else None
        grad_w = grad_b = None
        if not live:
            return grad_h, None, None, None, None
        names, flat = [spec["trained"][i] for i in live], [grads[i].reshape(-1) for i in live]
        start = 0
        for h, t in zip(hidden.split(spec["chunk"]), targets.split(spec["chunk"])):
            n = t.numel()
            h_, w_ = h.detach().requires_grad_(want_h), weight.detach().requires_grad_(want_w)
            b_ = None if bias is None else bias.detach().requires_grad_(want_b)
            with torch.enable_grad(), _autocast(ctx.autocast):
                out = _fields(h_, w_, b_, t, names, spec)
            wrt = [x for x, wanted in ((h_, want_h), (w_, want_w), (b_, want_b)) if wanted]
            got = iter(torch.autograd.grad(out, wrt, [g[start: start + n] for g in flat]))
            if want_h:
                grad_h[start: start + n] = next(got)
            if want_w:
                gw = next(got)
                grad_w = gw if grad_w is None else grad_w + gw
            if want_b:
                gb = next(got)
                grad_b = gb if grad_b is None else grad_b + gb
            start += n
        return grad_h, grad_w, grad_b, None, None


def _fields(hidden, weight, bias, targets, names, spec):
    """The fields ``names`` of one chunk of rows, each [n]."""
    logits = apply_post(F.linear(hidden, weight, bias), spec["ops"])
    return [row_fn(name, spec["sampling"])(logits, targets) for name in names]


def _autocast_state(device_type: str):
    return (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))


def _autocast(state):
    device_type, enabled, dtype = state
    return torch.autocast(device_type, dtype=dtype, enabled=enabled) if enabled else contextlib.nullcontext()


# --- the head inside the model's forward -------------------------------------------------------------
def _hf(model):
    return base_model(model)


def output_head(model) -> torch.nn.Linear | None:
    """The model's output head when it is a plain Linear (the chunked head's weight and bias), else None."""
    hf = _hf(model)
    head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    return head if type(head) is torch.nn.Linear else None


def can_chunk(model) -> bool:
    """The model has a Linear head and the head self-check has not turned the chunked head off."""
    return output_head(model) is not None and getattr(_hf(model), "exactrl_chunked_head", True)


def disable(model) -> None:
    """The plain head (the model's full logits) from now on for ``model``."""
    _hf(model).exactrl_chunked_head = False


@contextlib.contextmanager
def per_token_head(model, input_ids: torch.Tensor, trained: tuple[str, ...], metrics: tuple[str, ...] = (),
                   sampling: Sampling = Sampling(), chunk: int = 0) -> Iterator[None]:
    """Within it, ``model``'s forward on ``input_ids`` [B, T] returns as its logits the per-token
    fields ``trained + metrics`` [B, T-1, fields] instead of [B, T, V] logits: ``trained`` ones
    differentiable, ``metrics`` ones not; ``chunk`` tokens of the head at a time (0 or at least
    B*(T-1): the plain path's operations). The model's post-head ops are folded in."""
    hf, head = _hf(model), output_head(model)
    ops = post_ops(hf)
    targets = input_ids[:, 1:]
    rows = targets.numel()

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        if chunk <= 0 or rows <= chunk:  # one chunk: the plain path itself, its graph kept (no recompute)
            logits = apply_post(F.linear(hidden, head.weight, head.bias), ops)[:, :-1].reshape(-1, head.out_features)
            out = []
            for name in trained + metrics:
                with torch.set_grad_enabled(name in trained and torch.is_grad_enabled()):
                    out.append(row_fn(name, sampling)(logits, targets.reshape(-1)))
        else:
            spec = {"trained": trained, "metrics": metrics, "chunk": chunk, "ops": ops, "sampling": sampling}
            out = ChunkedHead.apply(hidden[:, :-1].reshape(-1, hidden.size(-1)), head.weight, head.bias,
                                    targets.reshape(-1), spec)
        return torch.stack(out, -1).view(*targets.shape, len(out))

    head.forward = forward
    try:
        with _ops_off(hf, ops):
            yield
    finally:
        del head.forward
