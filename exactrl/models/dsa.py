"""DeepSeek Sparse Attention's key choice (DeepSeek-V3.2, GLM-5 and their kin), made the same
for every batch layout.

The indexer of a DSA layer keeps, for each query, the ``index_topk`` keys of highest index
score, a weighted sum over indexer heads of ReLU'd dot products. A key that every head scores
at or below zero gets exactly 0, so keys tie, and ``torch.topk`` breaks ties by an order that
depends on the width of the row it searches (on the CPU std::nth_element or std::partial_sort
over the row, neither stable: ATen's TopKImpl.h). The same sequence alone, right-padded beside
a longer one, or decoded one token at a time (each step's row as wide as its prefix) then keeps
different keys and computes other log-probs, through Hugging Face's own eager and SDPA paths
alike: a padded training forward that is not each sequence's, and sampled log-probs that are
not the training forward's.

Tied keys are equally entitled to a place, so the model does not say which to keep; exactrl
keeps the earliest (a stable descending sort), whatever the layout: in training forwards,
self-checks and decoding alike. Where no scores tie it keeps the keys torch.topk keeps.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


def earliest_first_topk(x: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
    """``torch.topk`` whose ties go to the lowest index: values and indices, best first."""
    values, indices = x.sort(dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


class _EarliestFirst(TorchFunctionMode):
    """Inside an indexer's forward: every top-k breaks ties by position."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.topk or func is torch.Tensor.topk:
            return earliest_first_topk(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _enter(module, args) -> None:
    module.exactrl_topk_mode = _EarliestFirst()
    module.exactrl_topk_mode.__enter__()


def _leave(module, args, output) -> None:
    module.exactrl_topk_mode.__exit__(None, None, None)


def is_indexer(module: torch.nn.Module) -> bool:
    """A DSA indexer: the module that picks each query's ``index_topk`` keys."""
    return hasattr(module, "index_topk") and type(module).__name__.endswith("Indexer")


def break_ties_by_position(model: torch.nn.Module) -> int:
    """Make every DSA indexer of ``model`` keep the earliest of tied keys (once per module);
    returns how many indexers the model has. The hooks live on the modules, so a copy of the
    model keeps them; ``always_call`` leaves the mode even when the forward raises."""
    indexers = [m for m in model.modules() if is_indexer(m)]
    for module in indexers:
        if not getattr(module, "exactrl_earliest_first", False):
            module.register_forward_pre_hook(_enter)
            module.register_forward_hook(_leave, always_call=True)
            module.exactrl_earliest_first = True
    return len(indexers)
