"""What a run would otherwise find only after its model loaded, refused before anything is written
(a run directory, a checkpoint) and in a second: a vLLM engine's interpreter without vLLM, a reward
server that accepts no connection. Called by the CLI once per run, not on each launched rank."""

from __future__ import annotations

from pydantic import BaseModel

from exactrl.rollout.vllm_env import check_vllm_python
from exactrl.serving import check_server


def phases(cfg) -> list[tuple[str, object]]:
    """The command's training configs with their keys' prefixes: the config itself, and a pipeline's, demo's or
    study's phases (base., sft., rl., mixed.)."""
    return [("", cfg), *((f"{name}.", getattr(cfg, name)) for name in ("base", "sft", "rl", "mixed")
                         if isinstance(getattr(cfg, name, None), BaseModel))]


def check_before_start(cfg) -> None:
    """Refuses, in one line naming the key, a vLLM interpreter without vLLM or a reward URL with no server
    behind it, in any phase of ``cfg``."""
    servers: dict[str, tuple[str, float]] = {}
    for prefix, c in phases(cfg):
        rollout, reward, ray = getattr(c, "rollout", None), getattr(c, "reward", None), getattr(c, "ray", None)
        # on a cluster Ray joins (ray.address), the engines' interpreter is on other machines: theirs to say
        distill = getattr(c, "distill", None)
        engine = rollout is not None and rollout.engine == "vllm" and not (ray is not None and ray.enabled
                                                                           and ray.address)
        teacher = distill is not None and distill.teacher is not None and distill.teacher_engine == "vllm"
        if engine or teacher:  # a vLLM teacher's engine takes rollout.vllm.python too
            check_vllm_python(rollout.vllm.python, prefix)
        timeout = min(reward.timeout, 10.0) if reward is not None else 10.0
        if reward is not None:
            key = "reward.url" if reward.url else "reward.fn"
            servers |= {url: (prefix + key, timeout) for url in reward.specs() if url.startswith(("http://", "https://"))}
        eval_fn = getattr(getattr(c, "eval", None), "reward_fn", None)
        if eval_fn and eval_fn.startswith(("http://", "https://")):
            servers.setdefault(eval_fn, (prefix + "eval.reward_fn", timeout))
    for url, (key, timeout) in servers.items():
        check_server(url, key, timeout)
