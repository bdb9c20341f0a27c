"""PPO's critic: a value model on the policy's architecture, trained next to it.

The critic is the policy's model with a scalar head per position (Hugging Face's
*ForTokenClassification with one label), loaded from the policy's starting point (or
``critic.path``), with its own optimizer and its own engine on the same backend, so it
is sharded, offloaded and canary-checked like the policy. Per rollout:
  1. its values V(s_t) of the rollout are computed once, in the micro-batches of the first
     update (like the old log-probs), and fixed for the rollout;
  2. GAE turns rewards and values into advantages and returns (exactrl/advantages, ``gae``);
  3. after each policy step the critic takes one step on the same mini-batch: per-token
     0.5 (V - R)^2, clipped around the rollout's values (critic.value_clip), aggregated by
     the step's one normaliser like every loss.
During the first ``critic.warmup_rollouts`` rollouts only the critic learns.
"""

from __future__ import annotations

from pathlib import Path

import torch

from exactrl.config.aggregation import norm_len
from exactrl.config.schema_rl import RLConfig
from exactrl.data.batch import Sample
from exactrl.distributed.engine import build_engine
from exactrl.distributed.step_plan import StepPlan
from exactrl.losses.objective import Objective, ValueTerm
from exactrl.losses.token_losses import at_least_fp32
from exactrl.models.loading import load_value_model
from exactrl.workers.load import load_model
from exactrl.workers.worker import Worker


def token_values(output_logits: torch.Tensor) -> torch.Tensor:
    """[B, L, 1] head outputs -> [B, L-1] values V(s_t) aligned with next-token targets
    (position t scores the prefix that the action at target t is taken from)."""
    return output_logits[:, :-1, 0].to(at_least_fp32(output_logits.dtype))


class Critic(Worker):
    def __init__(self, cfg: RLConfig, model: torch.nn.Module, total_steps: int, pad_id: int):
        # Its own optimizer section of the run's validated config, on the run's engine settings.
        engine = build_engine(model, cfg, total_steps, optim=cfg.critic.optim)
        super().__init__("critic", model, engine, pad_id=pad_id, packed=cfg.train.padding_free)
        self.cfg = cfg

    @classmethod
    def _build(cls, cfg: RLConfig, role, path, *, run_dir: Path, phase: str, longest: int, pad_id: int,
               total_steps: int,
               checkpoint: str | None, policy) -> Critic:
        """From the checkpoint being resumed, else ``path`` (critic.path or the policy's starting
        model); packing self-checked like the policy."""
        if checkpoint:
            path = Path(checkpoint) / "critic"

        def loader(p, trainable, attn, dropout, trust_remote_code):  # a value head is new: seeded; its dropout is off
            return load_value_model(p, init_seed=cfg.train.seed, attn=attn, trust_remote_code=trust_remote_code)

        return cls(cfg, load_model(cfg, path, run_dir, phase, "critic", longest, loader=loader), total_steps, pad_id)

    def token_field(self, name: str, logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        if name != "values":
            raise ValueError(f"the critic computes values, not '{name}'")
        return token_values(logits)

    def objective(self) -> Objective:
        """The critic's loss: the value term, aggregated like the policy's loss."""
        t = self.cfg.train
        return Objective((ValueTerm(clip=self.cfg.critic.value_clip, agg=t.loss_agg,
                                    norm_len=norm_len(self.cfg)),))

    def step(self, batch: list[Sample], plan: StepPlan) -> dict:
        """One critic optimizer step on the policy's mini-batch, in the policy's micro-batches."""
        result = self.train_step(batch, plan, self.objective())
        return {"critic_loss": result.loss, "critic_grad_norm": result.stats["grad_norm"],
                "critic_canary": result.stats["canary"], **result.metrics}
