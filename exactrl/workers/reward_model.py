"""A reward model: the critic's value model (the policy's architecture with a scalar head per position,
models/loading.py load_value_model) trained on preference pairs by `exactrl rm`.

**Where it scores.** A sequence's reward is the head's output at the **last real token of its answer**: the
answer's last loss token, its EOS (or the chat template's end of turn), found from the loss mask
(losses/pairs.py last_token_scores). Not at the first pad token, nor at the last non-pad one: with a tokenizer
whose pad equals its EOS (SmolLM2's, Qwen's) the first "pad" may be an end of turn inside the prompt and the
last non-pad token is the one before the answer's EOS (what AutoModelForSequenceClassification's pad-id search
reads there). The per-token field "scores" holds at target t the head's output at target t's own token (the
token after the one that predicts it), so the answer's last target carries the answer's last token's score,
packed or padded alike.

**In `exactrl rl`** (reward.model=DIR): the same model, frozen (role "reward", no optimizer), scores every
response of a rollout on the ids the policy sampled (prompt_ids + response_ids: nothing decoded and re-encoded,
so the reward model must share the policy's tokenizer), normalised with the mean and std its training run saved
(DIR/reward_stats.json); ModelReward is that reward, called by every rank on the whole gathered rollout
(exactrl/rollout/collect.py), or under Ray (ray.enabled) by the driver, whose reward model is a group of ray.ranks
rank actors (exactrl/workers/groups.py) running the same score on every rank.

**A process reward model** (`exactrl rm rm.kind=process`, reward_stats.json kind process) is read as its training
read a step-labelled row (data/steps.py encode_steps): each step followed by the separator's tokens, its score s at
the separator's last token (step_reading). A response's reward is reward.model_reduce of sigmoid(s) over its steps
(min, as Lightman et al. 2023 score a solution; prod; last), a probability in [0, 1], not normalised.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from exactrl.config.loader import ConfigError
from exactrl.config.reward_stats import STATS_FILE, saved_kind
from exactrl.data.batch import Sample, collate
from exactrl.data.encode import _ids
from exactrl.device import process_device
from exactrl.distributed.engine import build_engine
from exactrl.dtypes import autocast_for
from exactrl.losses.pairs import last_token_scores
from exactrl.losses.token_losses import at_least_fp32
from exactrl.models.loading import load_tokenizer, load_value_model, tokenizer_mismatch
from exactrl.workers.load import load_model
from exactrl.workers.worker import Worker


def score_layout(units: int, per_forward: int, world: int, unit: int = 1, what: str = "samples") -> list[list[list[
        int]]]:
    """Every rank's micro-batches over the samples of ``units`` units of ``unit`` consecutive samples (a pair: 2,
    kept together), at most ``per_forward`` units each, as even as can be and the same number on each rank: a
    sharded model's forwards are collectives."""
    chunks = world * max(1, math.ceil(units / (per_forward * world)))
    if units < chunks:
        raise ConfigError(f"{units} {what} cannot give each of {world} ranks one to score; use more {what}")
    bounds = [unit * (i * units // chunks) for i in range(chunks + 1)]
    parts = [list(range(bounds[i], bounds[i + 1])) for i in range(chunks)]
    return [parts[r::world] for r in range(world)]


def target_scores(output_logits: torch.Tensor) -> torch.Tensor:
    """[B, L, 1] head outputs -> [B, L-1]: at target t, the head's output at target t's token (position t + 1)."""
    return output_logits[:, 1:, 0].to(at_least_fp32(output_logits.dtype))


def step_reading(sample: Sample, separator: list[int], eos: int | None) -> tuple[Sample, list[int]]:
    """``sample`` as a process reward model read a step-labelled row in training (encode_steps: the prompt, then each
    step followed by the separator's tokens), and the targets carrying each step's score (StepExample.targets: the
    head at the separator's last token p sits at target p - 1). The steps are cut at every non-overlapping
    occurrence of the ``separator`` ids in the sampled response, left to right as str.split cuts text; the final
    step (what follows the last separator, the whole response when there is none) ends at the response's last real
    token, its EOS left out, and a separator is placed after it: training scored every step, the last included, at
    a separator following it and never showed the model an EOS. A response ending with a separator has no further
    step; one with none is one step."""
    response = list(sample.response_ids)
    if response and response[-1] == eos:
        response.pop()
    ids, positions, n, i = list(sample.prompt_ids), [], len(separator), 0
    while i + n <= len(response):
        if response[i : i + n] == separator:
            positions.append(len(sample.prompt_ids) + i + n - 1)
            i += n
        else:
            i += 1
    ids += response
    if not positions or positions[-1] != len(ids) - 1:
        ids += separator
        positions.append(len(ids) - 1)
    prompt = len(sample.prompt_ids)
    return Sample(ids[:prompt], ids[prompt:], source=sample.source), [p - 1 for p in positions]


REDUCE = {"min": lambda p: p.min(), "prod": lambda p: p.prod(), "last": lambda p: p[-1]}  # reward.model_reduce


class RewardModel(Worker):
    @classmethod
    def _build(cls, cfg, role, path, *, run_dir: Path, phase: str, longest: int, pad_id: int, total_steps: int,
               checkpoint: str | None, policy) -> RewardModel:
        """From the checkpoint being resumed (its weights are the reward model's), else ``path``: a causal LM
        (a new head, seeded from train.seed) or a saved reward model; packing self-checked like a policy. Role
        "reward": a saved reward model, frozen (no engine), run under the run's autocast as the reference is."""

        def loader(p, trainable, attn, dropout, trust_remote_code):  # the head's dropout is off: a deterministic score
            return load_value_model(p, init_seed=cfg.train.seed, attn=attn, trust_remote_code=trust_remote_code)

        if role == "reward":
            model = load_model(cfg, path, run_dir, phase, role, longest, trainable=False, loader=loader)
            device, dtype = process_device(), cfg.model.dtype
            return cls(role, model.requires_grad_(False), pad_id=pad_id, packed=cfg.train.padding_free,
                       autocast=lambda: autocast_for(dtype, device))
        model = load_model(cfg, path, run_dir, phase, role, longest, loader=loader, checkpoint=checkpoint)
        return cls(role, model, build_engine(model, cfg, total_steps), pad_id=pad_id, packed=cfg.train.padding_free)

    def token_field(self, name: str, logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        if name != "scores":
            raise ValueError(f"the reward model computes scores, not '{name}'")
        return target_scores(logits)

    def score(self, samples: list[Sample], layout: list[list[list[int]]]) -> torch.Tensor:
        """Each sample's reward [N] (no gradient), at its answer's last real token; ``layout`` as Worker.forward."""
        per_target = self.forward(samples, "scores", layout)
        return torch.stack([last_token_scores(v[None], collate([s], self.pad_id)["loss_mask"])[0]
                            for s, v in zip(samples, per_target)])


@dataclass
class ModelReward:
    """reward.model of an RL run: its reward model's score of each response, (score - mean) / std with the
    statistics its training saved (mean 0, std 1 with reward.model_normalize=false), weighted by
    reward.model_weight in the run's reward; a process reward model's (``separator`` set), ``reduce`` of the
    sigmoid of its step scores. ``worker``: the frozen reward model (roles.worker("reward", ...): a RewardModel, or
    under Ray a WorkerGroup of its ranks with the same ``score``, ``forward`` and ``world_size``), set once the
    run's workers are built."""

    path: Path
    weight: float
    mean: float
    std: float
    per_forward: int  # samples per forward (train.micro_batch_size)
    worker: RewardModel | None = None  # or a Ray WorkerGroup
    separator: list[int] | None = None  # a process reward model's step separator's token ids; None: pairwise
    eos: int | None = None  # the policy's EOS id, which ends a response but no step
    reduce: str = "min"  # reward.model_reduce

    def __call__(self, samples: list[Sample]) -> list[float]:
        """Each sample's normalised score. Every rank calls it with the whole rollout (each scores its share of
        the micro-batches and receives everyone's), so the scores do not depend on the ranks."""
        layout = score_layout(len(samples), self.per_forward, self.worker.world_size)
        if self.separator is None:
            scores = self.worker.score(samples, layout).double()
        else:
            rows = [step_reading(s, self.separator, self.eos) for s in samples]
            per_target = self.worker.forward([r for r, _ in rows], "scores", layout)
            scores = torch.stack([REDUCE[self.reduce](torch.sigmoid(v[t].double())) for (_, t), v in zip(rows,
                                                                                                           per_target)])
        return ((scores - self.mean) / self.std).tolist()


def model_reward(reward, tokenizer, per_forward: int, trust_remote_code: bool = False) -> ModelReward | None:
    """``reward`` (the reward.* section)'s reward model, checked before anything loads: a saved reward model
    (exactrl rm's final directory) with the policy's tokenizer (``tokenizer``) and, to normalise, its
    reward_stats.json. None without reward.model."""
    if reward.model is None:
        return None
    path = Path(reward.model)
    config = path / "config.json"
    if not config.is_file():
        raise ConfigError(f"reward.model={path}: no config.json there; give the final/ directory of an `exactrl rm` "
                          "run")
    arch = json.loads(config.read_text()).get("architectures") or []
    if not any(a.endswith("ForTokenClassification") for a in arch):
        raise ConfigError(f"reward.model={path}: {config} names {arch or 'no architecture'}, not a reward model "
                          "(a *ForTokenClassification head); train one with `exactrl rm`")
    stats = path / STATS_FILE
    rm_tok = load_tokenizer(path, trust_remote_code)
    differs = tokenizer_mismatch(tokenizer, rm_tok)
    if differs:
        raise ConfigError(f"reward.model={path}: its tokenizer differs from the policy's ({differs}); the reward "
                          "model reads the policy's sampled token ids as they are, so train it from the policy's "
                          "model family, or serve it over text (python -m exactrl.rewards.server --model DIR)")
    kind = saved_kind(path)
    if kind is None:
        _read(stats)  # raises, naming what is wrong with the file
    if kind == "process":
        return _process_reward(reward, path, tokenizer, per_forward)
    mean, std = 0.0, 1.0
    if reward.model_normalize:
        if not stats.is_file():
            raise ConfigError(f"reward.model_normalize=true, but {stats} does not exist: `exactrl rm` writes it beside "
                              "the model it saves; give that directory, or set reward.model_normalize=false")
        try:
            train = _read(stats)["train"]
            mean, std = float(train["mean"]), float(train["std"])
        except (KeyError, TypeError) as e:
            raise ConfigError(f"{stats}: no 'train' mean and std to normalise reward.model's scores with "
                              f"({type(e).__name__}: {e}); set reward.model_normalize=false") from None
        if not std > 0:
            raise ConfigError(f"{stats}: the scores' std is {std}, nothing to normalise by; set "
                              "reward.model_normalize=false")
    return ModelReward(path, reward.model_weight, mean, std, per_forward)


def _process_reward(reward, path: Path, tokenizer, per_forward: int) -> ModelReward:
    """A process reward model's reward: its steps cut at the separator its training saved, tokenised as there."""
    stats = path / STATS_FILE
    if reward.model_normalize:
        raise ConfigError(f"reward.model_normalize=true, but reward.model={path} is a process reward model ({stats}: "
                          f"kind process): its reward, reward.model_reduce={reward.model_reduce} of sigmoid(step "
                          "score), is a probability in [0, 1], and the statistics saved are of step logits, not of "
                          "that; set reward.model_normalize=false")
    sep = _read(stats).get("step_separator")
    ids = _ids(tokenizer, sep, first=False) if isinstance(sep, str) else []
    if not ids:
        raise ConfigError(f"{stats}: step_separator is {sep!r}, not a separator the tokenizer spells; `exactrl rm` "
                          "with rm.kind=process writes the one it cut steps at")
    return ModelReward(path, reward.model_weight, 0.0, 1.0, per_forward, separator=ids, eos=tokenizer.eos_token_id,
                       reduce=reward.model_reduce)


def _read(stats: Path) -> dict:
    try:
        out = json.loads(stats.read_text())
    except ValueError as e:
        raise ConfigError(f"{stats} is not valid JSON ({e}); `exactrl rm` writes it beside the model") from None
    if not isinstance(out, dict):
        raise ConfigError(f"{stats} holds {type(out).__name__}, not the object `exactrl rm` writes")
    return out
