"""Environments for multi-turn and agent RL: what the policy acts on between its turns.

base.py the interface (reset, step) and what crosses it; render.py how an observation becomes token ids;
process.py where a user's environment runs (a process of its own, with a hard timeout); tools.py the built-in
tool-calling environment over a module of plain functions; remote.py an environment served over HTTP.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the package itself stays light: what a pool needs is imported when one is made
    from exactrl.envs.process import EnvPool


def make_env_pool(env_cfg) -> EnvPool:
    """The pool an EnvConfig (env.*) asks for: env.cls in an environment process, env.url over HTTP, env.tools as
    the built-in tool-calling environment in an environment process (its schemas checked here, in the trainer's
    process). A class, server or tools module that cannot be used is an EnvError here, before the run starts."""
    from exactrl.envs.base import EnvError
    from exactrl.envs.process import ProcessEnvPool

    if env_cfg.url is not None:
        from exactrl.envs.remote import RemoteEnvPool  # urllib, threads: only for a server

        return RemoteEnvPool(env_cfg.url, env_cfg.timeout)
    if env_cfg.tools is not None:
        from exactrl.envs.tools import schemas

        return ProcessEnvPool("exactrl.envs.tools:ToolEnv", {"module": env_cfg.tools}, env_cfg.timeout,
                              tools=schemas(env_cfg.tools))
    if env_cfg.cls is None:
        raise EnvError("no environment: set env.cls, env.url or env.tools")
    return ProcessEnvPool(env_cfg.cls, env_cfg.args, env_cfg.timeout)
