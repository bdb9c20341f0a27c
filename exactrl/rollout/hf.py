"""Generation with the trainer's own Hugging Face model (KV cache, batched sampling, finished
rows leaving the batch), on the model's device: the default engine, the first implementation of
exactrl/rollout/generator.py."""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.cache_utils import (
    Cache,
    DummyLayer,
    DynamicIndexedLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
)

from exactrl.checks.weight_sync import WeightsDigest, WeightsState, WeightSyncError, digest_of, shared_digest
from exactrl.device import device_of
from exactrl.distributed.export import hf_tensors
from exactrl.models.packing import base_model
from exactrl.rollout import unpadded
from exactrl.rollout.generator import Generation, SamplingParams, prompt_seeds, row_seed
from exactrl.rollout.sampling import KeyedDraw, draw, uniforms
from exactrl.rollout.stops import StopStrings, response_ends


class _PreallocatedLayer(DynamicLayer):
    """A key/value layer that writes each step into buffers sized for the whole generation.
    Hugging Face's DynamicLayer concatenates the cache every step, a copy that dominated CPU
    sampling. Keys and values keep their own shapes (MLA caches its latent as keys and the rope
    part as values)."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.length = capacity, 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self._k, self._v = (t.new_empty(*t.shape[:2], self.capacity, t.shape[-1])
                                for t in (key_states, value_states))
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache of {self.capacity} positions overflowed at {end}")
        self._k[:, :, self.length:end] = key_states
        self._v[:, :, self.length:end] = value_states
        self.length = end
        self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows ``indices`` (finished rows leave the batch), copying the filled part."""
        if not self.is_initialized:
            return
        for name in ("_k", "_v"):
            old = getattr(self, name)
            new = old.new_empty(len(indices), *old.shape[1:])
            new[:, :, : self.length] = old[indices, :, : self.length]
            setattr(self, name, new)
        self.keys, self.values = self._k[:, :, : self.length], self._v[:, :, : self.length]


# The cache layers the loop can shrink to the live rows: Hugging Face's key/value layers (plain,
# sliding-window or chunked, with DSA's index keys), linear-attention / SSM / short-conv states,
# hybrids of both, and layers that hold nothing. Any other layer type (a model's own cache class)
# hands the model to ``generate``.
_KV_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, DynamicIndexedLayer)
_STATE_LAYERS = (LinearAttentionLayer, LinearAttentionAndFullAttentionLayer,
                 LinearAttentionAndSlidingWindowAttentionLayer)
_KNOWN_LAYERS = (*_KV_LAYERS, *_STATE_LAYERS, DummyLayer)


def decode_cache(model, capacity: int) -> tuple[str, Cache] | None:
    """The cache ``generate`` builds for ``model`` -- from its config, so every layer gets its
    kind of state (key/value, sliding, linear-attention, SSM, conv) -- with the plain key/value
    layers pre-allocated for ``capacity`` positions, and the name of the model's cache argument
    (Mamba models take ``cache_params``). None when the model brings its own cache class or a
    layer type the loop does not know: the caller uses ``generate``."""
    hf = base_model(model)
    if not hf._supports_default_dynamic_cache():
        return None
    cache = DynamicCache(config=hf.config.get_text_config(decoder=True))
    if not cache.layers or any(type(layer) not in _KNOWN_LAYERS for layer in cache.layers):
        return None
    cache.layers = [_PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    # generate's own rule for the argument's name (GenerationMixin._prepare_cache_for_generation)
    return ("cache_params" if "mamba" in type(hf).__name__.lower() else "past_key_values"), cache


def _keep_rows(cache: Cache, keep: torch.Tensor) -> None:
    """Shrink every layer of ``cache`` to the rows ``keep``."""
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):  # conv and recurrent states (a hybrid's KV: below)
            LinearAttentionCacheLayerMixin.reorder_cache(layer, keep)
        if isinstance(layer, _KV_LAYERS):
            layer.batch_select_indices(keep)


def use_generate(model, reason: str | None) -> None:
    """From now on ``model`` decodes through Hugging Face's ``generate`` (``reason``: why, for
    the record), or through the loop again (None)."""
    base_model(model).exactrl_generate = reason


def use_unpadded(model, reason: str | None) -> None:
    """From now on ``model`` decodes the prompts of each length apart, without left padding
    (exactrl/rollout/unpadded.py; ``reason``: why), or in left-padded batches again (None)."""
    base_model(model).exactrl_unpadded = reason


def decodes_unpadded(model) -> str | None:
    """Why ``model`` decodes its prompts grouped by length (None: in left-padded batches)."""
    return getattr(base_model(model), "exactrl_unpadded", None)


def decodes_with_generate(model) -> str | None:
    """Why ``model`` decodes through ``generate`` (None: through the loop): the generation
    self-check chose it, or the model brings a cache the loop does not know."""
    reason = getattr(base_model(model), "exactrl_generate", None)
    if reason is None and decode_cache(model, 1) is None:
        reason = f"{type(base_model(model)).__name__} brings a cache of its own"
    return reason


class _AfterPrompt(StoppingCriteria):
    """``stop`` inside ``generate``, which passes prompt + response: only the response is matched."""

    def __init__(self, stop: StopStrings, width: int):
        self.stop, self.width = stop, width

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return self.stop(input_ids[:, self.width:])


def _any_live(live: torch.Tensor, synced: bool) -> bool:
    flag = live.any().to(torch.int32)  # on the model's device, as NCCL needs
    if synced:  # every rank steps while any rank has a live row
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag)


def _takes(fn, name: str) -> bool:
    return name in inspect.signature(fn).parameters


@torch.no_grad()
def sample(model, input_ids: torch.Tensor, attention: torch.Tensor, *, max_new_tokens: int, eos: int, pad: int,
           greedy: bool = False, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
           seeds: list[int] | None = None, stop: StopStrings | None = None, synced: bool = False,
           compact_at: float = 0.125) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A lean decode loop over left-padded prompts: one prefill, then one single-token forward
    per step into a cache written in place. Rows that emitted EOS or completed a ``stop``
    string leave the batch (and the cache) once they are at least ``compact_at`` of it, so late
    steps run only live rows; until then they feed ``pad`` as generate does, and their draws are
    discarded. Returns tokens [rows, max_new_tokens] (``pad`` after a row's end) and, sampled,
    the log-prob of each token at ``temperature`` (0 after the end; see ``draw``). Sampling
    needs ``seeds``, one per row: row r's tokens come from ``uniforms`` keyed by seeds[r].

    Each step's inputs come from the model's own ``prepare_inputs_for_generation``, as in
    ``generate`` (Mamba's decode steps drop the mask, hybrid models pick their masks). A model
    whose cache the loop does not know, or that the generation self-check handed to ``generate``
    (exactrl/rollout/generation_check.py), is decoded by ``generate`` itself; one it set to the
    static-shape step (rollout.decode), by exactrl/rollout/static_decode.py.

    A model the self-check set to decode unpadded (``use_unpadded``) decodes the prompts of each
    length as a batch of their own.

    ``synced`` (parameters sharded over ranks): every rank runs as many forwards, stepping
    at least one row until no rank has a live one."""
    if not greedy and (seeds is None or len(seeds) != len(input_ids)):
        raise ValueError(f"sampling needs one seed per row: {len(input_ids)} rows, seeds={seeds!r}")
    kw = {"max_new_tokens": max_new_tokens, "eos": eos, "pad": pad, "greedy": greedy, "temperature": temperature,
          "top_p": top_p, "top_k": top_k, "seeds": seeds, "stop": stop, "synced": synced}
    hf = base_model(model)
    if static := getattr(hf, "exactrl_static", None):  # rollout.decode: exactrl/rollout/static_decode.py
        return static(model, input_ids, attention, **kw)
    made = None if getattr(hf, "exactrl_generate", None) else decode_cache(model, input_ids.shape[1] + max_new_tokens)
    decode = sample_with_generate if made is None else _loop
    if decodes_unpadded(model) and (synced or attention[:, 0].min() == 0):  # rows of several lengths
        return unpadded.by_prompt_length(decode, model, input_ids, attention, compact_at=compact_at, **kw)
    return decode(model, input_ids, attention, compact_at=compact_at, cache=made, **kw)


def _loop(model, input_ids: torch.Tensor, attention: torch.Tensor, *, max_new_tokens: int, eos: int, pad: int,
          greedy: bool, temperature: float, top_p: float, top_k: int, seeds: list[int] | None,
          stop: StopStrings | None, synced: bool, compact_at: float, cache=None):
    """``sample``'s decode loop; ``cache``: decode_cache's (name, cache) for these rows, made here when None."""
    hf = base_model(model)
    cache_name, cache = cache or decode_cache(model, input_ids.shape[1] + max_new_tokens)
    with_positions = _takes(hf.forward, "position_ids")
    keep_one = _takes(hf.forward, "logits_to_keep")

    def forward(ids: torch.Tensor, mask: torch.Tensor, first: bool):
        extra = {"position_ids": (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]} if with_positions else {}
        inputs = hf.prepare_inputs_for_generation(ids, attention_mask=mask, use_cache=True, is_first_iteration=first,
                                                  **{cache_name: cache}, **extra)
        if first and keep_one:
            inputs["logits_to_keep"] = 1
        return model(**inputs)

    rows, device = input_ids.shape[0], input_ids.device  # the model's device: the loop never leaves it
    tokens = torch.full((rows, max_new_tokens), pad, dtype=torch.long, device=device)
    logprobs = None if greedy else torch.zeros(rows, max_new_tokens, device=device)
    u = None if greedy else uniforms(seeds, max_new_tokens, device)
    mask = attention
    out = forward(input_ids, mask, True)
    row = torch.arange(rows, device=device)  # the original row of each batch row
    live = torch.ones(rows, dtype=torch.bool, device=device)
    for t in range(max_new_tokens):
        token, logp = draw(out.logits[:, -1].float(), greedy, temperature, top_p, top_k, None if greedy else u[row, t])
        tokens[row[live], t] = token[live]
        if logprobs is not None:
            logprobs[row[live], t] = logp[live]
        live = live & (token != eos)
        if stop is not None:
            live = live & ~stop(tokens[row, : t + 1])
        if t + 1 == max_new_tokens or not _any_live(live, synced):
            break
        token = torch.where(live, token, pad)
        if (~live).sum() >= max(1.0, compact_at * len(live)):
            keep = live.nonzero()[:, 0] if live.any() else torch.zeros(1, dtype=torch.long, device=device)
            row, live, token, mask = row[keep], live[keep], token[keep], mask[keep]
            _keep_rows(cache, keep)
        mask = torch.cat([mask, mask.new_ones(len(mask), 1)], 1)
        out = forward(token[:, None], mask, False)
    return tokens, logprobs


@torch.no_grad()
def sample_with_generate(model, input_ids: torch.Tensor, attention: torch.Tensor, *, max_new_tokens: int,
                         eos: int | None, pad: int, greedy: bool = False, temperature: float = 1.0, top_p: float = 1.0,
                         top_k: int = 0, seeds: list[int] | None = None, stop: StopStrings | None = None,
                         synced: bool = False, **_) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``sample``'s contract through Hugging Face's ``generate``: the same tokens for the same
    ``seeds`` (the keyed draw of ``draw`` applied as a logits processor to the logits
    ``generate`` would sample from, which then decodes greedily: rows stay in its batch, so row r
    at step t reads the same uniform as in the loop; nothing of the model's
    generation_config.json), the same ends (EOS, ``stop``), and the log-prob of each sampled
    token at ``temperature`` from the raw logits it returns."""
    if not greedy and (seeds is None or len(seeds) != len(input_ids)):
        raise ValueError(f"sampling needs one seed per row: {len(input_ids)} rows, seeds={seeds!r}")
    config = GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=False, num_beams=1,
                              pad_token_id=pad, eos_token_id=eos, output_logits=not greedy,
                              return_dict_in_generate=True,
                              use_cache=True)
    criteria = None if stop is None else StoppingCriteriaList([_AfterPrompt(stop, input_ids.shape[1])])
    keyed = None if greedy else LogitsProcessorList([KeyedDraw(uniforms(seeds, max_new_tokens, input_ids.device),
                                                                input_ids.shape[1], temperature, top_p, top_k)])
    # generate fills what the config leaves at its defaults from the model's generation_config.json
    # (a repetition penalty, top-k, ...): none of it may shape the draws the log-probs describe.
    hf, own = base_model(model), base_model(model).generation_config
    hf.generation_config = GenerationConfig()
    try:
        out = model.generate(input_ids=input_ids, attention_mask=attention, generation_config=config,
                             logits_processor=keyed, stopping_criteria=criteria, synced_gpus=synced)
    finally:
        hf.generation_config = own
    new = out.sequences[:, input_ids.shape[1]:]
    tokens = torch.full((len(input_ids), max_new_tokens), pad, dtype=torch.long, device=input_ids.device)
    tokens[:, : new.shape[1]] = new
    if greedy:
        return tokens, None
    logits = torch.stack(out.logits, 1).float() / temperature  # [rows, steps, vocab]
    logp = torch.log_softmax(logits, -1).gather(-1, new[..., None])[..., 0]
    lengths = torch.tensor([n or new.shape[1] for n in response_ends(new, eos, stop)], device=input_ids.device)
    ended = torch.arange(new.shape[1], device=input_ids.device) >= lengths[:, None]  # after a row's EOS or stop string
    logprobs = torch.zeros(tokens.shape, device=input_ids.device)
    logprobs[:, : new.shape[1]] = logp.masked_fill(ended, 0.0)
    return tokens, logprobs


class HFEngine:
    """Samples ``n`` responses per prompt with the trainer's own model object (so there are no
    weights to sync on one CPU process), left-padding prompts as ``generate`` expects.

    ``synced``: the model's parameters are sharded over ranks (FSDP2, ZeRO-3), so every rank
    must take part in every forward: generate's ``synced_gpus`` keeps a rank whose responses
    have all ended stepping until every rank's have. Every rank must then make as many calls
    with as many requests."""

    logprobs_over = "vocabulary"  # sampling.warp: log p at the temperature, before the top-k/top-p cut

    def __init__(self, model, tokenizer, batch_size: int, synced: bool = False):
        self.model, self.tok, self.batch_size, self.synced = model, tokenizer, batch_size, synced
        self.name = "hf (in-process)"
        self.weights_state = WeightsState(self.name)
        self._digest: WeightsDigest | None = None

    @property
    def weights_version(self) -> int:
        return self.weights_state.version

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Take the trainer's weights; returns the new version. Sharing the trainer's model
        object (the in-process case), what arrives must be that model's own parameters: checked
        by identity, nothing copied. A model of the generator's own takes full, Hugging Face-named
        tensors (Worker.export_weights), one at a time, copied in. Either way every parameter must
        arrive; then the digest is computed from the weights now held (weights_digest)."""
        own = dict(self.model.named_parameters())
        buffers = dict(self.model.named_buffers())  # a persistent buffer is part of the saved weights too
        missing, shared = set(own), True
        for name, tensor in named:
            param = own.get(name, buffers.get(name))
            if param is None:
                raise WeightSyncError(f"the generator's model has no parameter '{name}'")
            missing.discard(name)
            if param is tensor:
                continue
            shared = False
            if param.shape != tensor.shape:
                raise WeightSyncError(f"'{name}' arrived with shape {tuple(tensor.shape)}; the generator's is "
                                      f"{tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor)
        if missing:
            raise WeightSyncError(f"the trainer sent no '{min(missing)}' ({len(missing)} of the generator's parameters "
                                  "did not arrive)")
        self._digest = self._held_digest(shared)
        self.weights_state.synced(self.weights_state.version + 1, self._digest.value)
        return self.weights_version

    def _held_digest(self, shared: bool) -> WeightsDigest:
        """Its own model: the Hugging Face-named tensors as the trainer exports them. The trainer's:
        its parameters as handed over (exactrl/checks/weight_sync.py shared_digest)."""
        if shared:
            return shared_digest(self.model.named_parameters(), self.synced)
        return digest_of(hf_tensors(self.model, lambda t: t))

    def weights_digest(self) -> WeightsDigest:
        """The digest computed from the weights held after the last load (None before any)."""
        return self._digest

    @torch.no_grad()
    def probe_logprobs(self, ids: list[int]) -> list[float]:
        """log p(ids[t] | ids[:t]) for t >= 1 at temperature 1, as the generator's model computes
        it (eval mode, one sequence, no padding)."""
        was_training = self.model.training
        self.model.eval()
        try:
            x = torch.tensor([ids], device=device_of(self.model))
            logits = self.model(input_ids=x).logits[0, :-1].float()
        finally:
            self.model.train(was_training)
        return torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0].tolist()

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams | None = None,
                 seeds: list[int] | None = None,
                 **kwargs) -> list[Generation]:
        """``params``, or its fields as keywords: generate(ids, n=4, temperature=0.7). ``seeds``:
        one per prompt (exactrl/rollout/generator.py); without them prompt i is keyed by i alone,
        so the same call samples the same responses."""
        p = params or SamplingParams(**kwargs)
        seeds = list(prompt_seeds(positions=range(len(prompt_ids)))) if seeds is None else list(seeds)
        if len(seeds) != len(prompt_ids):
            raise ValueError(f"one seed per prompt: {len(prompt_ids)} prompts, {len(seeds)} seeds")
        requests = [(i, ids, row_seed(seeds[i], j)) for i, ids in enumerate(prompt_ids) for j in range(p.n)]
        was_training = self.model.training
        self.model.eval()
        stop = StopStrings(self.tok, p.stop) if p.stop else None
        out: list[Generation] = []
        try:
            for start in range(0, len(requests), self.batch_size):
                out += self._generate_batch(requests[start : start + self.batch_size], p, stop)
        finally:
            self.model.train(was_training)
        return out

    def _generate_batch(self, requests, p: SamplingParams, stop: StopStrings | None) -> list[Generation]:
        pad, eos = self.tok.pad_token_id, self.tok.eos_token_id
        width = max(len(ids) for _, ids, _ in requests)
        device = device_of(self.model)
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for _, ids, _ in requests], device=device)
        attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids, _ in requests], device=device)
        tokens, logprobs = sample(self.model, input_ids, attention, max_new_tokens=p.max_new_tokens, eos=eos, pad=pad,
                                  greedy=p.greedy, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                  seeds=[seed for _, _, seed in requests], stop=stop, synced=self.synced)
        logprobs = [None] * len(requests) if logprobs is None else logprobs.tolist()
        out = []
        for (idx, ids, _), row, lp, end in zip(requests, tokens.tolist(), logprobs, response_ends(tokens, eos, stop)):
            # What follows the end is padding: never in the response, its mask or the loss.
            response, finished = row[:end], end is not None
            out.append(Generation(idx, ids, response, self.tok.decode(response, skip_special_tokens=True), finished,
                                  None if lp is None else lp[: len(response)], self.weights_version,
                                  self.weights_state.digest))
        return out
