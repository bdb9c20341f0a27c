"""The generator interface: what the RL loop asks of a rollout engine.

    generate(prompt_ids, params, seeds) -> [Generation]   tokens, text and sampling log-probs
    load_weights(named_tensors) -> version                 the policy's weights (full, Hugging Face-named)
    weights_digest() -> WeightsDigest                      recomputed from the weights it holds
    probe_logprobs(ids) -> [float]                         log p(ids[t] | ids[:t]), t >= 1, temperature 1
    weights_version, weights_state                         what the next generation samples with
    logprobs_over                                          "vocabulary" or "kept": its log-probs' convention
    name                                                   how errors name it

The Hugging Face decode loop (exactrl/rollout/hf.py) and the vLLM engine (exactrl/rollout/vllm_generator.py)
implement it; a Ray actor holding one is another, with no change to the loop. Every sync is
verified by the trainer (Worker.push_weights, exactrl/checks/weight_sync.py: digest, probe,
state), and every Generation carries the weights version and digest it was sampled with, so a
sample can always say which policy produced it.

Seeds: ``seeds[i]`` keys every random draw of prompt i's ``params.n`` responses; response j
draws from a stream derived from (seeds[i], j) alone (exactrl's loop: ``row_seed``; vLLM: one
request per response with ``SamplingParams(seed=row_seed(seeds[i], j))``). So a response does not
depend on which other requests share its batch, on the batch size, on which rank asked, or on
when other rows finish: the caller keys a request by what it is (the run's seed, the rollout,
the prompt's place in it -- ``prompt_seeds``), and the same seeded run samples the same rollouts
on any layout. Greedy decoding draws nothing.

Log-probs: ``Generation.logprobs[t]`` is log p of response token t under the policy at the
sampling temperature, and the generator declares over what (``logprobs_over``):
- "vocabulary": log_softmax(logits / temperature) over the whole vocabulary, before top-k and
  top-p cut it (the cuts choose which tokens can be drawn, not what a drawn token's log-prob
  is). The HF loop's convention; it is what the trainer computes
  (exactrl/losses/token_losses.py token_logprobs, which never cuts).
- "kept": renormalised over the top-k/top-p kept set the token was drawn from (vLLM's
  logprobs_mode=processed_logprobs: exactrl/rollout/vllm_generator.py). The trainer then
  replays the kept set on its own logits (token_losses.kept_logprobs) before comparing, or every
  ratio would be off by the kept mass (TRL issue #6789, PR #7269).
The on-policy check, the rollout-trainer gap and its correction (exactrl/losses/rollout_gap.py)
compare like with like either way (``compares_kept_set``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from exactrl.checks.weight_sync import WeightsDigest, WeightsState, WeightSyncError

__all__ = ["Generation", "Generator", "GeneratorError", "SamplingParams", "WeightSyncError", "prompt_seeds", "row_seed",
           "turn_seed"]

@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # responses per prompt
    greedy: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop: tuple[str, ...] = ()  # a response ends with the token that completes one of these (kept in it)
    max_new_tokens: int = 48


@dataclass(frozen=True)
class Generation:
    prompt_index: int  # which prompt of the request this answers
    prompt_ids: list[int]
    response_ids: list[int]  # up to and including EOS, or the token that completes a stop string
    text: str  # decoded response without special tokens (a stop string stays in it)
    finished: bool  # True when the model emitted EOS or a stop string within max_new_tokens
    logprobs: list[float] | None = None  # sampled runs: log p of each response token (the module's convention)
    weights_version: int = 0  # the generator's weights version it was sampled with
    weights_digest: str | None = None  # the digest of those weights (exactrl/checks/weight_sync.py), once synced


LOGPROBS_OVER = ("vocabulary", "kept")


class GeneratorError(RuntimeError):
    """A generator stopped answering: its engine process died or did not answer in time."""


def _key(*parts) -> int:
    """A 63-bit seed from ``parts``: a hash, so neighbouring keys give unrelated streams."""
    return int.from_bytes(hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest(), "little") >> 1


def prompt_seeds(*key, positions: Iterable[int]) -> list[int]:
    """One seed per prompt: ``key`` (e.g. the run's seed, the rollout, the refill round) and the
    prompt's position in the whole request list (not in this rank's share of it)."""
    return [_key("prompt", *key, p) for p in positions]


def row_seed(seed: int, sample: int) -> int:
    """The seed of response ``sample`` of the prompt seeded ``seed``."""
    return _key("sample", seed, sample)


def turn_seed(seed: int, turn: int) -> int:
    """The prompt seed of turn ``turn`` of the episode seeded ``seed`` (rollout/multiturn.py): each turn is
    asked for as its own prompt, with one sample."""
    return _key("turn", seed, turn)


class Generator(Protocol):
    name: str  # how errors and records name it: "hf (in-process)", "vllm engine 0 (pid 1234)"
    weights_version: int
    weights_state: WeightsState
    logprobs_over: str  # one of LOGPROBS_OVER: the convention of its Generation.logprobs
    tok: object  # the tokenizer of its ids; decodes texts it did not sample (demonstrations, rollout/mixed.py)

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams,
                 seeds: Sequence[int] | None = None) -> list[Generation]: ...

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int: ...

    def weights_digest(self) -> WeightsDigest: ...

    def probe_logprobs(self, ids: list[int]) -> list[float]: ...


def compares_kept_set(generator, top_p: float, top_k: int) -> bool:
    """Whether the trainer must replay the top-p/top-k kept set to compare its log-probs with
    ``generator``'s: it reports them over the kept set and sampling cuts anything (top_p < 1 or
    top_k > 0; otherwise the kept set is the vocabulary)."""
    over = getattr(generator, "logprobs_over", None)
    if over not in LOGPROBS_OVER:
        raise TypeError(f"{type(generator).__name__} declares logprobs_over={over!r}: a generator says whether its "
                        f"log-probs are over the whole vocabulary or the top-p/top-k kept set (one of "
                        f"{', '.join(LOGPROBS_OVER)}; exactrl/rollout/generator.py)")
    return over == "kept" and (top_p < 1.0 or top_k > 0)
