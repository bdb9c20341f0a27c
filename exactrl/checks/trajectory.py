"""Every multi-turn rollout, before anything trains on it: the trained ids are the sampled ids.

For each episode (rollout/multiturn.py) against the generator's own outputs, turn by turn:
- each turn was sampled from exactly the trajectory's ids before it (the Generation's prompt ids equal the
  row's prefix): what the policy saw is what the trainer's forward sees;
- the turn's ids in the row equal the ids the generator returned, and its generator log-probs are the ones it
  reported;
- the loss mask is 1 exactly on the sampled ids, and every other target (prompt, template, observation) has
  origin other than policy, mask 0 and generator log-prob 0; mask, origin and log-probs have one entry per target.
A failure is exactrl's bug, not the user's: the run stops naming the episode and the first position that differs.

Re-tokenisation drift: how many policy turns would have changed had their text been encoded again
(decode -> encode differs from the sampled ids; prime-rl PR #1863: "\\n"+"\\n" sampled as two tokens encodes as
one). Reported as env/retokenize_drift_turns: the count this path did not suffer.

Per turn, after the trainer's old log-probs are computed: the largest |trainer - generator| log-prob on each
turn's sampled ids (rollout_gap/turn_K_max), the rollout-trainer gap turn by turn.
"""

from __future__ import annotations

import torch


class TrajectoryError(RuntimeError):
    """A multi-turn row is not the episode the generator sampled."""


def _fail(i: int, what: str) -> None:
    raise TrajectoryError(f"episode {i} of this rank's rollout: {what} -- the trained row is not what was sampled "
                          "(an exactrl bug: please report it with the run's config)")


def check_episodes(samples: list, episodes: list, tokenizer) -> dict:
    """Checks ``samples`` (to_sample of each of ``episodes``, in order) as above; returns the drift count."""
    drift = 0
    for i, (s, e) in enumerate(zip(samples, episodes)):
        n, head, ids = s.num_targets, len(s.prompt_ids) - 1, s.ids
        mask, origin = s.loss_mask, s.origin or ()
        if len(mask) != n or len(origin) != n or (s.gen_logprobs is not None and s.gen_logprobs.numel() != n):
            _fail(i, f"{n} targets, {len(mask)} mask entries, {len(origin)} origins")
        sampled = torch.zeros(n, dtype=torch.bool)
        for k, t in enumerate(e.turns):
            g, at = t.generation, len(s.prompt_ids) + t.start
            if list(g.prompt_ids) != ids[:at]:
                first = next((j for j, (a, b) in enumerate(zip(g.prompt_ids, ids[:at])) if a != b),
                             min(len(g.prompt_ids), at))
                _fail(i, f"turn {k} was sampled from {len(g.prompt_ids)} ids that differ from the row's {at} at "
                         f"position {first}")
            got = ids[at : at + len(t.ids)]
            if got != list(g.response_ids[: len(t.ids)]) or s.turn_spans[k] != (head + t.start, head + t.start
                                                                              + len(t.ids)):
                _fail(i, f"turn {k}'s ids in the row {got[:12]} are not the ids the generator sampled "
                         f"{list(g.response_ids[:12])}")
            sampled[head + t.start : head + t.start + len(t.ids)] = True
            if s.gen_logprobs is not None and g.logprobs is not None:
                want = torch.tensor(g.logprobs[: len(t.ids)], dtype=s.gen_logprobs.dtype)
                if not torch.equal(s.gen_logprobs[head + t.start : head + t.start + len(t.ids)], want):
                    _fail(i, f"turn {k}'s generator log-probs are not the ones it reported")
            if tokenizer.encode(tokenizer.decode(t.ids, skip_special_tokens=False),
                                add_special_tokens=False) != list(t.ids):
                drift += 1
        m = torch.tensor(mask, dtype=torch.bool)
        if not torch.equal(m, sampled):
            j = int((m != sampled).nonzero()[0])
            _fail(i, f"target {j} has loss mask {int(m[j])} but was {'' if sampled[j] else 'not '}sampled")
        policy = torch.tensor([o == "policy" for o in origin])
        if bool((policy[head:] != sampled[head:]).any()):
            _fail(i, "a response target's origin is policy where it was not sampled, or the reverse")
        if s.gen_logprobs is not None and bool((s.gen_logprobs[~sampled] != 0).any()):
            _fail(i, "a target the policy did not sample carries a generator log-prob")
    return {"env/retokenize_drift_turns": drift}


def turn_gaps(samples: list) -> dict:
    """The largest |old - generator| log-prob on each turn's sampled ids, over the rollout (rows that carry
    both and their turns)."""
    worst: dict[int, float] = {}
    for s in samples:
        if s.turn_spans is None or s.old_logprobs is None or s.gen_logprobs is None:
            continue
        for k, (a, b) in enumerate(s.turn_spans):
            if b > a:
                gap = float((s.old_logprobs[a:b].double() - s.gen_logprobs[a:b].double()).abs().max())
                worst[k] = max(worst.get(k, 0.0), gap)
    return {f"rollout_gap/turn_{k}_max": v for k, v in sorted(worst.items())}
