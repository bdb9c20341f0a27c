"""train.compile: each decoder layer's training forward through ``torch.compile``.

Per layer, not the whole model (torchtitan's and accelerate's regional compilation): a decoder's
layers share one ``forward``, and with the parameters as graph inputs (torch's
inline_inbuilt_nn_modules) Dynamo compiles that code once and every layer of the same kind reuses
it; what lies between the layers -- embeddings, mask builders, the output head (a custom
autograd function in chunks, exactrl/models/head.py), the loss -- stays eager.

- Dynamic shapes (``dynamic=True``): a packed row's length, its number of sequences and its
  longest sequence change with every micro-batch. Compiled with symbolic sizes from the first
  call, one graph serves them all; the default (specialise to the first row, recompile at the
  second with sizes made dynamic) would compile every layer kind twice for nothing.
- Attention stays eager: packing.varlen_attention is a Python dispatcher that counts its calls
  for the packing self-check, reads the row's longest sequence on the host, picks a kernel and
  gathers by data-dependent indices; it is marked torch.compiler.disable, one graph break per
  layer (its kernels -- SDPA, flash-attention, varlen_attn -- are fused kernels already).
- Only forwards that build a graph for backward run compiled: the training forward, and its
  recomputation under gradient checkpointing. No-grad passes (old and reference log-probs, the
  decode loop with its KV cache and CUDA-graph capture) run the eager layer: no compile for
  them, and no cache object for Dynamo to guard on.
- The compiled function is the layer class's ``forward``, called from a subclass the layer is
  switched to (as FSDP2's fully_shard switches it): transformers wraps every layer class's
  ``forward`` in its gradient checkpointing, the subclass's too, so the checkpoint stays outside
  the compiled code and recomputes by running it again (Dynamo cannot split a traced checkpoint
  at attention's graph break); FSDP2's hooks, run by ``__call__``, stay outside as well.
"""

from __future__ import annotations

import functools

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from exactrl.config.loader import ConfigError

# torch.compile's backend. Tests set "aot_eager" (Dynamo's capture and AOT autograd without
# code generation) or a counting backend here.
BACKEND = "inductor"


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: transformers' GradientCheckpointingLayer modules (every
    decoder's layer class derives from it), outermost ones only."""
    found: list[str] = []
    layers = []
    for name, module in model.named_modules():
        if isinstance(module, GradientCheckpointingLayer) and not any(name.startswith(f + ".") for f in found):
            found.append(name)
            layers.append(module)
    return layers


def is_compiled(layer: torch.nn.Module) -> bool:
    return getattr(type(layer), "exactrl_compiled", False)


def compile_layers(model: torch.nn.Module) -> int:
    """Switch each decoder layer to a subclass whose ``forward`` runs the layer's compiled when grad
    is enabled, eager otherwise; returns how many layers. A layer compiled already is left as it is."""
    layers = decoder_layers(model)
    if not layers:
        raise ConfigError(f"train.compile=true: {type(model).__name__} has no decoder layers exactrl can compile "
                          "(no transformers GradientCheckpointingLayer among its modules); set train.compile=false")
    for layer in layers:
        if not is_compiled(layer):
            layer.__class__ = _compiled_class(type(layer), BACKEND)
    return len(layers)


@functools.cache
def _compiled_class(cls: type, backend) -> type:
    compiled = torch.compile(cls.forward, dynamic=True, backend=backend)

    def forward(self, *args, **kwargs):
        return (compiled if torch.is_grad_enabled() else cls.forward)(self, *args, **kwargs)

    # transformers' __init_subclass__ wraps this forward in the layer's gradient checkpointing.
    return type(f"Compiled{cls.__name__}", (cls,), {"forward": forward, "exactrl_compiled": True})
