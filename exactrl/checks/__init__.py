"""Runtime verification that runs inside every training command (see DESIGN.md, "Verification
built in"): the canary (canary.py, every step), the on-policy ratio (on_policy.py, every
rollout) and the start-up self-checks: determinism (determinism.py) and packing (packing.py).
The engines import them, so nothing here imports rollout or above: the generation self-check, which
drives the decoders, is exactrl/rollout/generation_check.py."""


def one_line(e: BaseException) -> str:
    """An exception as one line for a check's report: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__
