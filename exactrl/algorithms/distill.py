"""On-policy distillation inside `exactrl rl` (distill.*): the student (the policy) samples, a frozen teacher
scores each rollout once -- per target token, in the first update's micro-batches, shared by every rank like
the reference's log-probs -- and a distillation term of the objective (exactrl/losses/distill_terms.py) trains
the student toward it on its own tokens: the whole objective under algo.name=on_policy_distill, or added to
another algorithm's terms.

The teacher reads the student's token ids as they are (nothing decoded and re-encoded), so it must share the
student's tokenizer: checked before it loads. What it gives per token (decided here, not per micro-batch): the
sampled token's log-prob always; its logits at each position for the divergences over the whole vocabulary
(reverse_kl, jsd); its top-k log-probs and ids for forward_kl_topk. Computing them once per rollout keeps the
teacher a worker of its own (in this process or a Ray actor group, exactrl/workers/placement.py) that the
policy's micro-batches never wait on. With distill.teacher_engine=vllm the teacher is a vLLM engine process
(exactrl/workers/vllm_teacher.py) giving the same fields, in the same layout, from vLLM's prompt log-probs.
"""

from __future__ import annotations

from exactrl.algorithms.sft import resolve
from exactrl.config.loader import ConfigError
from exactrl.config.schema_distill import DistillConfig
from exactrl.data.batch import Sample
from exactrl.distributed.launch import rank
from exactrl.losses.distill_terms import TEACHER_FIELDS
from exactrl.models.loading import load_tokenizer, tokenizer_mismatch
from exactrl.tasks.builtin import BuiltinSpec


def build_teacher(roles, cfg, tokenizer, spec: BuiltinSpec, where: dict):
    """The teacher worker of distill.teacher (None: no distillation), after refusing a teacher whose tokenizer
    is not the student's: a frozen model (roles' placement), or with distill.teacher_engine=vllm this rank's vLLM
    engine scoring from its prompt log-probs (the run closes it)."""
    if cfg.distill.teacher is None:
        return None
    path = resolve(cfg.distill.teacher, "model", spec)
    differs = tokenizer_mismatch(tokenizer, load_tokenizer(path, cfg.model.trust_remote_code, cfg.data.chat_template))
    if differs:
        raise ConfigError(f"distill.teacher={cfg.distill.teacher}: its tokenizer is not the student's ({differs}); "
                          "on-policy distillation scores the student's token ids, so give a teacher of the same "
                          "tokenizer")
    if cfg.distill.teacher_engine == "vllm":  # an engine process of this rank's (exactrl/workers/vllm_teacher.py)
        from exactrl.workers.vllm_teacher import vllm_teacher

        return vllm_teacher(cfg, path, tokenizer, where["run_dir"], rank())
    return roles.worker("teacher", path, **where)


def attach_teacher(samples: list[Sample], teacher, layout: list[list[list[int]]], distill: DistillConfig) -> None:
    """The teacher's per-token fields of every sample that distill.loss reads (``layout``: each rank's
    micro-batches, as the rollout's other per-token fields), set on the samples as teacher_<field>."""
    if teacher is None:
        return
    names = ("logprobs", *TEACHER_FIELDS[distill.loss])
    for name, values in teacher.forward_fields(samples, names, layout).items():
        for s, v in zip(samples, values):
            setattr(s, f"teacher_{name}", v)
