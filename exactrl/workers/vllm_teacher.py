"""A distillation teacher served by a vLLM engine (distill.teacher_engine=vllm): the teacher's directory loaded
by an engine process of its own (exactrl/rollout/vllm_generator.py, one per rank, from rollout.vllm.*'s
interpreter and limits), which scores each rollout once from vLLM's prompt log-probs of prompt + response
(VLLMGenerator.score). It gives the fields the in-process teacher (exactrl/workers/teacher.py) gives, in the
same per-token layout (one value per target, num_targets long, prompt targets included), so the distillation
terms read either alike: the sampled token's log-prob ("logprobs") and the k largest log-probs and their ids
("topk_logprobs", "topk_ids").

What it cannot give, refused by the config before anything starts (exactrl/config/schema_distill.py):
* the logits over the vocabulary (distill.loss=reverse_kl, jsd): vLLM returns log-probs of a few tokens;
* a temperature other than 1: vLLM computes prompt log-probs from the raw logits (no sampling processor
  touches a prompt token, whatever the request's temperature or logprobs_mode), and log p_T(y) =
  z_y / T - logsumexp(z / T) needs every logit, so it cannot be recovered from a few log-probs at 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from exactrl.data.batch import Sample
from exactrl.device import use_device
from exactrl.distributed.collectives import gather_fields
from exactrl.distributed.launch import rank, world_size
from exactrl.rollout.vllm_generator import VLLMGenerator, rank_gpu

FIELDS = ("logprobs", "topk_logprobs", "topk_ids")


class VLLMTeacher:
    """The teacher's vLLM engine behind the frozen worker's ``forward_fields``; ``topk``: the k of the top-k
    fields (distill.topk)."""

    role = "teacher"

    def __init__(self, engine: VLLMGenerator, topk: int):
        self.engine, self.topk = engine, topk

    def forward_fields(self, samples: list[Sample], names: tuple[str, ...],
                       layout: list[list[list[int]]]) -> dict[str, list[torch.Tensor]]:
        """Worker.forward_fields's result: every sample's per-token ``names``, each rank scoring its micro-batches
        ``layout[rank]`` with its own engine (one request for all of them) and every rank receiving all."""
        unknown = [n for n in names if n not in FIELDS]
        if unknown:
            raise ValueError(f"a vLLM teacher gives {', '.join(FIELDS)}, not {', '.join(unknown)} (vLLM returns "
                             "the log-probs of a few tokens, not the logits over the vocabulary)")
        if len(layout) != world_size():
            raise ValueError(f"a layout of {len(layout)} ranks' micro-batches for the teacher's {world_size()}")
        mine = [i for mb in layout[rank()] for i in mb]
        k = self.topk if "topk_logprobs" in names or "topk_ids" in names else 0
        scored = self.engine.score([samples[i].ids for i in mine], k)
        part = {i: self.fields(samples[i], names, k, *row) for i, row in zip(mine, scored)}
        return gather_fields(part, len(samples), names, self.role)

    @staticmethod
    def fields(sample: Sample, names: tuple[str, ...], k: int, logprobs, top_ids, top_logprobs) -> list:
        """One sample's ``names`` from the engine's lists (position t - 1 scores token t), num_targets long."""
        n = sample.num_targets
        if len(logprobs) != n:
            raise RuntimeError(f"the teacher's engine scored {len(logprobs)} targets of a sample of {n}")
        values = {"logprobs": torch.tensor(logprobs, dtype=torch.float32)}
        if k:
            values["topk_logprobs"] = torch.tensor(top_logprobs, dtype=torch.float32).view(n, k)
            values["topk_ids"] = torch.tensor(top_ids, dtype=torch.long).view(n, k)
        return [values[name] for name in names]

    def close(self) -> None:
        self.engine.close()


def vllm_teacher(cfg, path: str, tokenizer, run_dir: Path, index: int = 0) -> VLLMTeacher:
    """The teacher ``path`` in a vLLM engine of its own (``index``: this rank's), under rollout.vllm.*'s
    interpreter, memory and limits; it never takes weights, so it never sleeps."""
    v = cfg.rollout.vllm
    env = rank_gpu(use_device(cfg.distributed.device))  # this rank's GPU, as its rollout engine's
    if v.cpu_kv_cache_gb:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(v.cpu_kv_cache_gb)
    longest = cfg.data.max_length + cfg.rollout.max_new_tokens + 1  # + the one token each scoring request samples
    positions = json.loads((Path(path) / "config.json").read_text()).get("max_position_embeddings")
    engine = VLLMGenerator(path, tokenizer, python=v.python, dtype=cfg.model.dtype, seed=cfg.train.seed,
                           max_model_len=min(longest, positions or longest), index=index,
                           enforce_eager=v.enforce_eager, gpu_memory_utilization=v.gpu_memory_utilization,
                           start_timeout=v.start_timeout, request_timeout=v.request_timeout, log_dir=run_dir,
                           env=env, trust_remote_code=cfg.model.trust_remote_code,
                           max_logprobs=max(20, cfg.distill.topk), label="vllm teacher engine")
    return VLLMTeacher(engine, cfg.distill.topk)
