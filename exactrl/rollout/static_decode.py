"""The decode loop at static shapes, so that one step can be replayed from a CUDA graph: on a GPU
a small model's decode is launch-bound (a train of kernel launches per token, the GPU idle between
them), and a graph replays the whole step -- the forward, the draw, the bookkeeping -- in one launch.

What is static, and why it gives the eager loop's tokens (exactrl/rollout/hf.py ``_loop``):

* the batch: every row stays in it until the end (no compaction). A finished row keeps decoding
  in its own slot, fed ``pad``, and nothing it computes is kept; rows never meet in a forward
  (attention, norms and the MLP are per row), so its slot changes no other row. On a GPU a
  launch-bound step costs the same for 8 rows as for 64, which is why shrinking the batch, the
  eager loop's saving, buys nothing here; compacting at power-of-two sizes would capture a graph
  per size, for nothing measurable at the sizes this path is for (large models decode in vLLM).
* the cache: Hugging Face's ``StaticLayer`` per layer, ``capacity`` positions written in place at
  a position held on the device; the 2D mask covers every position (0 where nothing is written
  yet), so attention's keys beyond the current step weigh exactly 0.
* the draws: ``draw`` of exactrl/rollout/sampling.py at row r's uniform of step t from
  ``uniforms(seeds)``, the eager loop's numbers -- the same tokens for the same seeds.

A model decodes here only when every cache layer is a plain key/value one (no sliding window,
linear-attention or SSM state: their static forms change shape or branch on the step in Python),
on one process (sharded parameters would need collectives in the graph), and when its step never
waits for the device: the step's first run is under ``_no_host_sync`` (exactrl/checks/syncs.py),
which names the first op that would (an ``.item()``, a ``nonzero``, a boolean index -- MoE routing
loops over the experts it hit), on the CPU too, so CI sees what a capture would refuse. The generation self-check
(exactrl/rollout/generation_check.py) checks this path as it checks the eager loop and steps down
to the eager loop where it disagrees."""

from __future__ import annotations

import inspect
import weakref
from collections import OrderedDict

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, StaticLayer

from exactrl.checks.syncs import HostSyncs
from exactrl.device import device_of
from exactrl.rollout.hf import base_model
from exactrl.rollout.sampling import draw, uniforms

DECODES = ("auto", "eager", "graphs")
_ROUND = 64  # capacity rounded up to a multiple: prompt widths close together share a session
_KEEP = 3  # sessions (cache + captured step) kept per model, the most recently used
_LOOK_EVERY = 8  # steps between looks at whether a row is still live (each look waits for the GPU)


class NotStatic(RuntimeError):
    """The static decode step cannot run this model (the generation self-check steps down)."""


def use_static(model, on: bool) -> None:
    """From now on ``model`` decodes through the static step (``on``), or not: ``hf.sample`` calls
    what the model holds (this module builds on hf.py, which does not import it)."""
    base_model(model).exactrl_static = sample_static if on else None


def decodes_static(model) -> bool:
    return getattr(base_model(model), "exactrl_static", None) is not None


def static_cache(model, capacity: int) -> DynamicCache | None:
    """The cache ``generate`` builds for ``model`` with every layer a ``StaticLayer`` of ``capacity``
    positions; None unless every layer of it is a plain key/value layer."""
    hf = base_model(model)
    if not hf._supports_default_dynamic_cache():
        return None
    cache = DynamicCache(config=hf.config.get_text_config(decoder=True))
    if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    cache.layers = [StaticLayer(capacity) for _ in cache.layers]
    return cache


def why_not_static(model, synced: bool = False) -> str | None:
    """Why the static step cannot decode ``model`` (None: it can, unless its step syncs)."""
    if synced:
        return "its parameters are sharded over ranks"
    if static_cache(model, 1) is None:
        return (f"{type(base_model(model)).__name__}'s cache has layers other than plain key/value ones "
                "(sliding-window, linear-attention, SSM or its own class)")
    return None


def wants_static(decode: str, model, synced: bool, checked: bool) -> bool:
    """Whether a run's ``rollout.decode`` puts ``model`` on the static step: graphs always (the
    self-check steps down where it cannot), auto on CUDA where the self-check runs and the model's
    cache fits, eager never."""
    if decode == "graphs":
        return True
    return (decode == "auto" and checked and device_of(model).type == "cuda"
            and why_not_static(model, synced) is None)


def _no_host_sync() -> HostSyncs:
    """Refuses an op that waits for the device or whose output's shape depends on tensor values
    (exactrl/checks/syncs.py): inside a CUDA graph the one fails the capture and the other freezes
    the value seen at capture."""
    def refuse(sync):
        raise NotStatic(f"its decode step waits for the device at {sync} (a CUDA graph cannot capture it)")
    return HostSyncs(every=True, on_sync=refuse)


def capture(step, device: torch.device):
    """``step`` (run once already) recorded in a CUDA graph: its replay. Elsewhere ``step`` itself.
    The seam the tests fake to count captures on the CPU."""
    if device.type != "cuda":
        return step
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


class Graphed:
    """``step`` (no arguments: it reads and writes tensors it holds) replayed from a CUDA graph.
    The first call runs it as is under ``_no_host_sync`` -- the warm-up a capture needs (on a side
    stream, as torch.cuda.graph's docs ask), and the check that capture can work -- then captures."""

    def __init__(self, step, device: torch.device):
        self.step, self.device, self.replay = step, device, None

    def __call__(self) -> None:
        if self.replay is not None:
            return self.replay()
        if self.device.type == "cuda":
            side, main = torch.cuda.Stream(self.device), torch.cuda.current_stream(self.device)
            side.wait_stream(main)
            with torch.cuda.stream(side), _no_host_sync():
                self.step()
            main.wait_stream(side)
        else:
            with _no_host_sync():
                self.step()
        self.replay = capture(self.step, self.device)


# model -> its sessions, most recently used last; kept outside the model so that copying or pickling
# it never meets a CUDA graph
_SESSIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _pointers(model) -> tuple:
    """Where the model's weights live: a graph reads them from there, so a weight moved elsewhere
    (not updated in place, as optimizers and load_weights do) needs a new capture."""
    return tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers()))


class _Session:
    """The buffers, cache and captured step for ``rows`` rows of up to ``capacity`` positions
    under one sampling setting; reused by every call that fits."""

    def __init__(self, model, rows: int, capacity: int, sampling: tuple):
        self.model = weakref.ref(model)  # the sessions are kept by model (_SESSIONS): not the other way round
        self.hf, self.sampling, self.capacity = weakref.ref(base_model(model)), sampling, capacity
        self.pointers = _pointers(model)
        self.cache = static_cache(model, capacity)
        forward = inspect.signature(base_model(model).forward).parameters
        self.with_positions, self.keep_one = "position_ids" in forward, "logits_to_keep" in forward
        device = device_of(model)
        ints = dict(dtype=torch.long, device=device)
        self.mask, self.tokens = torch.zeros(rows, capacity, **ints), torch.zeros(rows, capacity, **ints)
        self.u, self.logprobs = (torch.zeros(rows, capacity, device=device) for _ in range(2))
        self.position, self.fed = torch.zeros(rows, 1, **ints), torch.zeros(rows, **ints)
        self.t, self.at, self.eos, self.pad = (torch.zeros(1, **ints) for _ in range(4))
        self.live = torch.ones(rows, dtype=torch.bool, device=device)
        self.logits = None  # [rows, vocab] fp32, allocated by the first prefill
        self.step = Graphed(self._decide_and_advance, device)

    def _forward(self, ids: torch.Tensor, position: torch.Tensor | None, first: bool) -> torch.Tensor:
        extra = {"position_ids": position} if self.with_positions else {}
        inputs = self.hf().prepare_inputs_for_generation(ids, attention_mask=self.mask, use_cache=True,
                                                       is_first_iteration=first, past_key_values=self.cache, **extra)
        if first and self.keep_one:
            inputs["logits_to_keep"] = 1
        return self.model()(**inputs).logits[:, -1].float()

    def _decide(self) -> None:
        """Step t's draw from the logits: recorded for the rows live before it, then live updated
        and the next input set (pad for a finished row, as the eager loop feeds it)."""
        greedy, temperature, top_p, top_k = self.sampling
        u = None if greedy else self.u.index_select(1, self.t)[:, 0]
        token, logp = draw(self.logits, greedy, temperature, top_p, top_k, u)
        self.tokens.index_copy_(1, self.t, torch.where(self.live, token, self.pad)[:, None])
        if logp is not None:
            self.logprobs.index_copy_(1, self.t, torch.where(self.live, logp, 0.0)[:, None])
        self.live &= token != self.eos
        self.fed.copy_(torch.where(self.live, token, self.pad))
        self.t += 1

    def _decide_and_advance(self) -> None:
        """The captured step: ``_decide``, then the forward of the token fed, written at cache
        position ``at`` (its slot of the mask opened first)."""
        self._decide()
        self.mask.index_fill_(1, self.at, 1)
        self.logits.copy_(self._forward(self.fed[:, None], self.position, False))
        self.position += 1
        self.at += 1

    def run(self, input_ids, attention, max_new_tokens: int, eos: int, pad: int, seeds, stop):
        width = input_ids.shape[1]
        for layer in self.cache.layers:
            layer.reset()
        self.mask.zero_()
        self.mask[:, :width] = attention
        self.tokens.fill_(pad)
        self.logprobs.zero_()
        self.live.fill_(True)
        self.position.copy_(attention.sum(-1, keepdim=True))
        self.t.zero_()
        self.at.fill_(width)
        self.eos.fill_(eos)
        self.pad.fill_(pad)
        if not self.sampling[0]:
            self.u[:, :max_new_tokens] = uniforms(seeds, max_new_tokens, self.u.device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        logits = self._forward(input_ids, positions, True)  # the prefill, eager: its width varies
        if self.logits is None:
            self.logits = torch.empty_like(logits)
        self.logits.copy_(logits)
        for t in range(max_new_tokens):
            if t + 1 == max_new_tokens:
                self._decide()  # the last draw needs no forward after it
            else:
                self.step()
            if stop is not None:  # on the host (a tokenizer's strings): after the step, before the next draw
                self.live &= ~stop(self.tokens[:, : t + 1])
            if (stop is not None or (t + 1) % _LOOK_EVERY == 0) and not self.live.any():
                break
        out = self.tokens[:, :max_new_tokens].clone()
        return out, None if self.sampling[0] else self.logprobs[:, :max_new_tokens].clone()


@torch.no_grad()
def sample_static(model, input_ids: torch.Tensor, attention: torch.Tensor, *, max_new_tokens: int, eos: int, pad: int,
                  greedy: bool, temperature: float, top_p: float, top_k: int, seeds: list[int] | None,
                  stop=None, synced: bool = False, **_) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``hf.sample``'s contract (the same tokens and log-probs for the same seeds) through the
    static step. Raises NotStatic where the model cannot decode here."""
    why = why_not_static(model, synced)
    if why is not None:
        raise NotStatic(f"the static decode step cannot run it: {why}")
    rows, width = input_ids.shape
    capacity = -(-(width + max_new_tokens) // _ROUND) * _ROUND
    key = (rows, capacity, greedy, *((None,) * 3 if greedy else (temperature, top_p, top_k)))
    sessions = _SESSIONS.setdefault(model, OrderedDict())
    session = sessions.pop(key, None)
    if session is None or session.pointers != _pointers(model):
        session = _Session(model, rows, capacity, key[2:])
    sessions[key] = session
    while len(sessions) > _KEEP:
        sessions.popitem(last=False)
    return session.run(input_ids, attention, max_new_tokens, eos, pad, seeds, stop)
