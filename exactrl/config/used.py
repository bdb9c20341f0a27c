"""Which settings a run uses: no setting that silently does nothing (DESIGN.md). A key set to
other than the command's default in a run that cannot use it is refused by config/loader.py
(check_used) from the table below."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from exactrl.config.methods import METHODS, names
from exactrl.config.reward_stats import saved_kind
from exactrl.config.schema import CommonConfig, OptimConfig
from exactrl.config.schema_ray import RayConfig


class UsedWhen(NamedTuple):
    """A key (or 'section.') that only some runs use: ``used(config)`` says whether this one does,
    ``why_not`` (formatted with c=the config) why it does not, and ``fix`` what would use it."""

    key: str
    used: Callable[[CommonConfig], bool]
    why_not: str
    fix: str


# No setting that silently does nothing (DESIGN.md): a key below set to other than the command's
# default in a run that cannot use it is refused (config/loader.py, check_used). A new key whose
# effect depends on another joins with one row; rows whose key a command lacks are skipped.
USED_WHEN = [
    UsedWhen("model.lora.", lambda c: c.model.lora.rank > 0, "LoRA is off (model.lora.rank=0)",
             "set model.lora.rank > 0"),
    UsedWhen("model.packed_kernel", lambda c: c.train.padding_free, "nothing is packed (train.padding_free=false)",
             "set train.padding_free=true"),
    UsedWhen("critic.", lambda c: _method(c).critic, "only " + " and ".join(names(critic=True)) + " trains a critic "
             "(algo.name={c.algo.name})", "set algo.name=" + " or ".join(names(critic=True))),
    # each method's own section (algo.gae, algo.dapo, algo.luffy, ...), refused under another algo.name in its words
    *(UsedWhen(f"algo.{m.config}.", lambda c, s=m.config: _method(c).config == s, m.section_refusal
               + " (algo.name={c.algo.name})", f"set algo.name={m.name}") for m in METHODS.values() if m.config),
    UsedWhen("algo.luffy.clip", lambda c: c.algo.policy_loss is None, "algo.policy_loss={c.algo.policy_loss} is the "
             "loss on the policy's tokens", "unset algo.policy_loss"),
    UsedWhen("algo.policy_loss", lambda c: _method(c).policy_ratio, "{c.algo.name} has no ratio loss on the policy's "
             "responses (its positive and negative terms are log-likelihoods)", "use another algo.name"),
    UsedWhen("algo.clip_eps_high", lambda c: _method(c).clips == "policy", "{c.algo.name} clips only its "
             "demonstrations' ratio p, which never exceeds 1, so no upper bound acts", "use another algo.name"),
    UsedWhen("algo.dual_clip", lambda c: _method(c).clips == "policy", "{c.algo.name} clips only its "
             "demonstrations' ratio, with no dual clip", "use another algo.name"),
    *(UsedWhen(key, lambda c: _clips(c), "nothing is clipped (" + " or ".join(
        f"algo.{m.config}.{m.clip_switch}=false" for m in METHODS.values() if m.clip_switch) + ")",
               "turn that clip on") for key in ("algo.clip_eps", "algo.clip_eps_high", "algo.dual_clip")),
    *(UsedWhen(key, lambda c: _method(c).policy_ratio, "{c.algo.name}'s loss takes no ratio to the policy that "
               "sampled, so there is no on-policy ratio to check", "use another algo.name") for key in (
        "algo.ratio_check", "algo.ratio_tol", "algo.gen_ratio_tol")),
    UsedWhen("algo.rollout_correction", lambda c: _method(c).policy_ratio, "{c.algo.name}'s loss takes no ratio on "
             "the policy's samples for a correction to weigh (its terms on them are log-likelihoods)",
             "use another algo.name"),
    *(UsedWhen(key, lambda c: not _method(c).hinted, "algo.name={c.algo.name}'s samples carry no generator "
               "log-probs (the generator never scores the hint it continues), so there is no gap to measure or "
               "correct", "use another algo.name") for key in ("algo.rollout_correction", "algo.rollout_gap_cap")),
    *(UsedWhen(key, lambda c: c.algo.rollout_correction != "none", "no correction is applied "
               "(algo.rollout_correction=none)", "set algo.rollout_correction=tis, icepop or seq_mask")
      for key in ("algo.rollout_correction_form", "algo.rollout_correction_cap")),
    UsedWhen("algo.rollout_correction_cap_low", lambda c: c.algo.rollout_correction in ("icepop", "seq_mask"),
             "algo.rollout_correction={c.algo.rollout_correction} has no lower bound (tis truncates from above)",
             "set algo.rollout_correction=icepop or seq_mask"),
    UsedWhen("distill.", lambda c: c.distill.teacher is not None, "there is no teacher (distill.teacher unset)",
             "set distill.teacher=PATH"),
    UsedWhen("distill.topk", lambda c: c.distill.loss == "forward_kl_topk", "distill.loss={c.distill.loss} reads "
             "no top-k", "set distill.loss=forward_kl_topk"),
    UsedWhen("distill.beta", lambda c: c.distill.loss == "jsd", "distill.loss={c.distill.loss} has no beta",
             "set distill.loss=jsd"),
    # a method whose whole objective is a distillation term reads no advantage and clips no ratio
    *(UsedWhen(key, lambda c: _method(c).policy_term, "algo.name={c.algo.name} trains no policy-gradient term "
               "(its loss is the distillation term, distill.*)", "use another algo.name") for key in (
        "algo.clip_eps", "algo.clip_eps_high", "algo.dual_clip", "algo.reward_norm", "algo.overlong_buffer",
        "algo.overlong_penalty", "algo.kl_in_reward")),
    UsedWhen("algo.uft.nll_agg", lambda c: c.algo.uft.nll_coef > 0, "there is no hint NLL (algo.uft.nll_coef=0)",
             "set algo.uft.nll_coef > 0"),
    UsedWhen("algo.prefix_rft.clip_prefix", lambda c: c.algo.policy_loss != "reinforce", "algo.policy_loss=reinforce "
             "does not clip", "use another algo.policy_loss"),
    UsedWhen("algo.std_normalize", lambda c: _method(c).std_normalize, "algo.name={c.algo.name} does not divide by "
             "the group std (only " + ", ".join(names(std_normalize=True)) + " do)", "use one of those"),
    UsedWhen("algo.gamma", lambda c: _method(c).discount, "algo.name={c.algo.name} does not discount returns "
             "(only " + ", ".join(names(discount=True)) + " do)", "use one of those"),
    UsedWhen("algo.kl_target", lambda c: c.algo.kl_coef > 0, "there is no KL term (algo.kl_coef=0)",
             "set a starting algo.kl_coef > 0 (the adaptive controller scales it)"),
    UsedWhen("algo.kl_in_reward", lambda c: c.algo.kl_coef > 0, "there is no KL term (algo.kl_coef=0)",
             "set algo.kl_coef > 0"),
    UsedWhen("algo.kl_estimator", lambda c: c.algo.kl_coef > 0, "there is no KL term (algo.kl_coef=0)",
             "set algo.kl_coef > 0"),
    UsedWhen("algo.kl_estimator", lambda c: not c.algo.kl_in_reward, "the KL in the reward is k1 per token "
             "(algo.kl_in_reward=true)", "set algo.kl_in_reward=false"),
    UsedWhen("algo.kl_horizon", lambda c: c.algo.kl_target is not None, "the KL coefficient is fixed (algo.kl_target "
             "unset)", "set algo.kl_target"),
    UsedWhen("algo.overlong_penalty", lambda c: c.algo.overlong_buffer > 0, "the overlong penalty is off "
             "(algo.overlong_buffer=0)", "set algo.overlong_buffer > 0"),
    UsedWhen("algo.clip_eps", lambda c: c.algo.policy_loss != "reinforce", "algo.policy_loss=reinforce does not clip",
             "use another algo.policy_loss"),
    UsedWhen("algo.clip_eps_high", lambda c: c.algo.policy_loss != "reinforce", "algo.policy_loss=reinforce does "
             "not clip", "use another algo.policy_loss"),
    UsedWhen("algo.dual_clip", lambda c: c.algo.policy_loss != "reinforce", "algo.policy_loss=reinforce does not clip",
             "use another algo.policy_loss"),
    UsedWhen("algo.ratio_tol", lambda c: c.algo.ratio_check != "off", "the on-policy check is off "
             "(algo.ratio_check=off)", "set algo.ratio_check=error or warn"),
    UsedWhen("rollout.vllm.", lambda c: c.rollout.engine == "vllm" or _vllm_teacher(c), "neither the generator "
             "(rollout.engine={c.rollout.engine}) nor a teacher is vLLM", "set rollout.engine=vllm (or "
             "distill.teacher_engine=vllm with distill.teacher)"),
    UsedWhen("rollout.batch_size", lambda c: c.rollout.engine == "hf", "vLLM batches its requests itself "
             "(rollout.engine={c.rollout.engine})", "set rollout.engine=hf"),
    UsedWhen("rollout.decode", lambda c: c.rollout.engine == "hf", "vLLM decodes in its own engine "
             "(rollout.engine={c.rollout.engine})", "set rollout.engine=hf"),
    UsedWhen("reward.fn", lambda c: c.reward.url is None, "reward.url replaces it",
             "list the URL in reward.fn instead"),
    *(UsedWhen(f"reward.{key}", lambda c: c.reward.model is not None, "there is no reward model (reward.model "
               "unset)", "set reward.model") for key in ("model_weight", "model_normalize", "model_reduce")),
    UsedWhen("reward.model_reduce", lambda c: _process_rm(c.reward.model), "reward.model={c.reward.model} is a "
             "pairwise reward model (its reward_stats.json has no kind: process), one score per response, no steps to "
             "reduce", "give the final/ of an `exactrl rm` run with rm.kind=process"),
    # the asynchronous schedule has an effect without Ray too (it runs in sequence: rollout/schedule.py)
    *(UsedWhen(f"ray.{key}", lambda c: c.ray.enabled, "Ray is off (ray.enabled=false)", "set ray.enabled=true")
      for key in RayConfig.model_fields if key not in ("async_rollouts", "max_staleness")),
    UsedWhen("ray.max_staleness", lambda c: c.ray.async_rollouts, "rollouts are synchronous (ray.async_rollouts="
             "false)", "set ray.async_rollouts=true"),
    UsedWhen("deepspeed.", lambda c: c.distributed.backend == "deepspeed", "the train engine is not DeepSpeed "
             "(distributed.backend={c.distributed.backend})", "set distributed.backend=deepspeed"),
    UsedWhen("distributed.fsdp_cpu_offload", lambda c: c.distributed.backend == "fsdp2", "the train engine is not "
             "FSDP2 (distributed.backend={c.distributed.backend}; DeepSpeed has deepspeed.offload_*)",
             "set distributed.backend=fsdp2"),
    UsedWhen("train.compile", lambda c: c.distributed.backend != "deepspeed", "the DeepSpeed engine does not "
             "compile the layers (distributed.backend=deepspeed, whose ZeRO-3 gathers parameters in hooks inside "
             "them)", "set distributed.backend=single or fsdp2"),
    UsedWhen("train.loss_agg_norm", lambda c: c.train.loss_agg == "seq-mean-token-sum-norm", "only "
             "train.loss_agg=seq-mean-token-sum-norm has a constant normaliser (train.loss_agg={c.train.loss_agg})",
             "set that train.loss_agg"),
    # exactrl rm: a pair's margin and centring belong to the Bradley-Terry loss, the step separator to a PRM's steps
    *(UsedWhen(f"rm.{key}", lambda c: c.rm.kind == "pairwise", "rm.kind=process scores steps, not pairs",
               "set rm.kind=pairwise") for key in ("margin", "center_rewards")),
    UsedWhen("rm.step_separator", lambda c: c.rm.kind == "process", "rm.kind=pairwise scores whole answers, not "
             "steps", "set rm.kind=process"),
    UsedWhen("train.packing_check_tol", lambda c: c.train.packing_check != "off", "the packing self-check is off "
             "(train.packing_check=off)", "turn it on"),
    UsedWhen("train.generation_check_tol", lambda c: c.train.generation_check != "off", "the generation self-check "
             "is off (train.generation_check=off)", "turn it on"),
    UsedWhen("train.save_total_limit", lambda c: c.train.save_every > 0, "no checkpoints are taken "
             "(train.save_every=0)", "set train.save_every"),
    UsedWhen("audit.canary_tol", lambda c: c.audit.canary != "off", "the canary is off (audit.canary=off)",
             "turn it on"),
    *(UsedWhen(f"log.wandb.{key}", lambda c: c.log.wandb.project is not None, "W&B is off (log.wandb.project unset)",
               "set log.wandb.project") for key in ("entity", "name")),
    # mode=online passes: every run's config.yaml held it while it was the default, and a replay of one must load.
    UsedWhen("log.wandb.mode", lambda c: c.log.wandb.project is not None or c.log.wandb.mode == "online",
             "W&B is off (log.wandb.project unset)", "set log.wandb.project"),
    UsedWhen("log.mlflow.experiment", lambda c: c.log.mlflow.uri is not None, "MLflow is off (log.mlflow.uri unset)",
             "set log.mlflow.uri"),
    *(row for section in ("optim.", "critic.optim.") for row in (
        UsedWhen(section + "momentum", lambda c, s=section: _optim(c, s).name == "sgd",
                 f"{section}name=adamw has no momentum setting (its betas are {section}betas)",
                 f"set {section}name=sgd"),
        UsedWhen(section + "betas", lambda c, s=section: _optim(c, s).name == "adamw",
                 f"{section}name=sgd has no betas (its momentum is {section}momentum)", f"set {section}name=adamw"),
        UsedWhen(section + "eps", lambda c, s=section: _optim(c, s).name == "adamw", f"{section}name=sgd has no eps",
                 f"set {section}name=adamw"),
        UsedWhen(section + "min_lr_ratio", lambda c, s=section: _optim(c, s).scheduler != "constant",
                 f"the learning rate is constant ({section}scheduler=constant)",
                 f"set {section}scheduler=linear or cosine"),
    )),
]


def _method(c):
    return METHODS[c.algo.name]


def _vllm_teacher(c) -> bool:
    """A distillation teacher served by vLLM (distill.teacher_engine=vllm), whose engine takes rollout.vllm.*."""
    d = getattr(c, "distill", None)
    return d is not None and d.teacher is not None and d.teacher_engine == "vllm"


def _clips(c) -> bool:
    """Whether some term clips a ratio: every method's, unless its clip_switch (a key of its section) is
    false; on the policy's samples algo.policy_loss, when set, is the loss that clips (luffy's own loss is
    the switched one)."""
    m = _method(c)
    if m.clip_switch is None:
        return True
    return getattr(getattr(c.algo, m.config), m.clip_switch) or (m.clips == "policy" and c.algo.policy_loss is not None)


def _optim(cfg: CommonConfig, section: str) -> OptimConfig:
    return cfg.critic.optim if section == "critic.optim." else cfg.optim



def _process_rm(model: str | None) -> bool:
    """Whether reward.model is a process reward model (or cannot be told: a directory not here, a config checked on
    another machine, or an unreadable reward_stats.json pass, and the run's own check, model_reward, reads it)."""
    return model is not None and (not Path(model).is_dir() or saved_kind(model) != "pairwise")
