"""The rollout-trainer gap, measured every rollout (exactrl/losses/rollout_gap.py defines the
metrics and the correction; the loop writes the choice to the run's manifest, RolloutGap.record).

Where the trainer's side comes from, with the same weights version as the generator's:
- a rollout with an old-log-prob pass: that pass (``rollout_gap_metrics``, here, over the whole
  rollout, identical on every rank: each holds all of it);
- a rollout that feeds one update and skips the pass (algorithms/rl.py reuses_first_forward): the
  update's own forward, before the step is applied, is the rollout's policy, so the step measures
  the gap in it (Objective.with_gap(measure=True), reduced over ranks with the step's metrics): no
  extra forward. srft, whose objective takes no ratio, measures it there too.
Either way the metrics land in the rollout's records of metrics.jsonl (and the trackers) under
``rollout_gap/``. Rollouts without generator log-probs (the hinted methods' ones: the
generator never scores the hint) have none to compare.
"""

from __future__ import annotations

from exactrl.data.batch import Sample, collate
from exactrl.losses.objective import Metrics
from exactrl.losses.rollout_gap import RolloutGap, measure, policy_tokens, trainer_logprobs


def rollout_gap_metrics(samples: list[Sample], gap: RolloutGap) -> dict[str, float]:
    """The gap's metrics over ``samples`` (a rollout with its old log-probs attached); {} when
    they carry no generator log-probs."""
    if any(s.gen_logprobs is None for s in samples):
        return {}
    b = collate(samples, pad_id=0)
    m = Metrics()
    measure(trainer_logprobs(gap, {}, b, current=False) - b["gen_logprobs"], policy_tokens(b, b["loss_mask"]),
            gap.gap_cap, m)
    return m.result()
