"""The environment section of `exactrl rl` (env.*): multi-turn and agent rollouts (exactrl/envs)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from exactrl.config.methods import METHODS
from exactrl.config.schema import Section


class EnvConfig(Section):
    cls: str | None = Field(None,
                            description="An environment class, module:Class (exactrl/envs/base.py: reset(row), "
                                        "step(action)), one instance per episode, run in a process of its own with "
                                        "env.timeout per call. One of env.cls, env.url, env.tools turns multi-turn "
                                        "rollouts on.")
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of env.cls's constructor.")
    url: str | None = Field(None,
                            description="An environment served over HTTP (python -m exactrl.envs.server): POST "
                                        "/reset and /step per episode.")
    tools: str | None = Field(None,
                              description="A module whose public functions are the tools (typed arguments and a "
                                          "docstring give each its OpenAI-style schema): the built-in tool-calling "
                                          "environment runs the calls it finds in a turn (<tool_call>{\"name\": ..., "
                                          "\"arguments\": {...}}</tool_call>) and answers with their results as "
                                          "'tool' messages; a turn without a call ends the episode. A malformed call "
                                          "is answered with an error message, never a crash.")
    max_turns: int = Field(4, gt=0, description="Policy turns per episode at most (the episode ends after the last).")
    max_tokens: int = Field(256, gt=0,
                            description="Tokens after the prompt per episode at most: the policy's turns, the "
                                        "observations and the template's tokens between them. A turn samples at most "
                                        "min(rollout.max_new_tokens, what is left); an observation that does not fit "
                                        "ends the episode unfinished.")
    timeout: float = Field(30.0, gt=0, description="Seconds one reset or step of one episode may take.")
    on_error: Literal["end", "stop"] = Field("end",
                                             description="An environment that raises, hangs past env.timeout or "
                                                         "returns a malformed result: 'end' that episode (reward 0, "
                                                         "counted in env/errors, the first error printed) or 'stop' "
                                                         "the run naming the episode and the error.")
    reward_fn: bool = Field(True,
                            description="Add reward.fn's score of the final turn's text (with the row's answer) to "
                                        "the rewards the environment gave per turn.")
    render: Literal["template", "text"] | None = Field(None,
                                                       description="How message observations become ids: "
                                                                   "'template' (the chat template's delta for them, "
                                                                   "checked at start-up to extend the conversation "
                                                                   "append-only) or 'text' (their contents encoded "
                                                                   "as they are); unset: 'template' when the "
                                                                   "tokenizer has a chat template.")

    @property
    def enabled(self) -> bool:
        return any(v is not None for v in (self.cls, self.url, self.tools))

    @model_validator(mode="after")
    def _one_source(self):
        given = [k for k in ("cls", "url", "tools") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"env.{given[0]} and env.{given[1]} are both set: an episode runs one environment "
                             "(a class, a server, or tools)")
        if self.args and self.cls is None:
            raise ValueError("env.args are env.cls's constructor arguments, and env.cls is not set")
        return self


# built-in tasks whose answers are episodes, and the env.* that runs them
TOOL_TASKS = {"calculator": "env.tools=exactrl.tasks.calculator_tools"}


def tool_task_refusal(task: str, prefix: str = "", budget: str = "rollout.max_new_tokens",
                      why: str = "one-turn rollouts would train the calls away") -> str:
    return (f"task.name={task} is a tool task: its model answers by calling a tool over several turns, and {why}; "
            f"set {prefix}{TOOL_TASKS[task]} and {prefix}{budget} of at least 96 (examples/agent_tools.yaml)")


def check_env(cfg) -> None:
    """Refuses what multi-turn episodes cannot honour in an `exactrl rl` config (env.* set), and a tool task
    without them."""
    if not cfg.env.enabled:
        if cfg.task.name in TOOL_TASKS and (cfg.data.train == "builtin" or cfg.model.path in ("builtin",
                                                                                             "builtin-sft")):
            raise ValueError(tool_task_refusal(cfg.task.name))
        return
    a, m = cfg.algo, METHODS[cfg.algo.name]
    if m.demonstrations or m.hinted:
        own = ", ".join(n for n, x in METHODS.items() if not (x.demonstrations or x.hinted))
        raise ValueError(f"algo.name={a.name} mixes demonstrations or hints into its rollouts; with env.* a rollout "
                         f"is the policy's own episodes: one of {own}")
    if a.overlong_buffer:
        raise ValueError(f"algo.overlong_buffer={a.overlong_buffer} shapes a one-turn response's length against "
                         "rollout.max_new_tokens; an episode's budget is env.max_tokens: set algo.overlong_buffer=0")
    if cfg.distill.teacher is not None:
        raise ValueError("distill.teacher with env.*: a teacher scoring an episode's policy turns between "
                         "observations is not built yet; leave one of them unset")
