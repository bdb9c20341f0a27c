"""The built-in tool-calling environment (env.tools=module): the module's public functions are the tools.

A tool is a plain function defined in that module whose name does not start with "_"; its type hints and its
docstring (a description, and an ``Args:`` line per argument) give its OpenAI-style schema
(transformers.utils.get_json_schema), which the chat template shows the model (``schemas``, for
``apply_chat_template(tools=...)``). Each turn the policy's text is searched for calls in the Hermes / Qwen format,

    <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>

(a JSON list of such calls inside one tag also works; a last tag left open, as a stop string at "</tool_call>"
leaves it, is read to the end of the text). Every call is run and answered, in order, by a message
{"role": "tool", "name": ..., "content": str(result)}. A call that cannot be run (bad JSON, an unknown tool, wrong
arguments, a tool that raises) is answered "error: ..." and counted in info["tool_errors"], so the model sees its
mistake; it never ends the run. A turn with no call is the answer: the episode ends.

The environment runs in the environment process (envs/process.py), under env.timeout per turn; only ``schemas``
imports transformers, in the trainer's process, so that process starts with the standard library alone.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re

from exactrl.envs.base import Action, EnvError, StepResult

_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


def load_tools(module: str) -> dict:
    """The module's tools by name, or an EnvError naming the module."""
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise EnvError(f"env.tools={module}: cannot import the module ({e})") from None
    except Exception as e:  # the module's own code failed while importing
        raise EnvError(f"env.tools={module}: importing it raised {type(e).__name__}: {e}") from None
    tools = {name: fn for name, fn in vars(mod).items()
             if inspect.isfunction(fn) and not name.startswith("_") and fn.__module__ == mod.__name__}
    if not tools:
        raise EnvError(f"env.tools={module}: the module defines no public function (a tool is a function of the "
                       "module whose name does not start with '_')")
    return tools


def schemas(module: str) -> list[dict]:
    """Each tool's OpenAI-style schema, in the module's order; a tool it cannot describe is an EnvError naming
    it."""
    from transformers.utils import get_json_schema

    out = []
    for name, fn in load_tools(module).items():
        try:
            out.append(get_json_schema(fn))
        except Exception as e:  # DocstringParsingException, TypeHintParsingException
            raise EnvError(f"env.tools={module}: tool '{name}' cannot be described ({e}); give it type hints and a "
                           "docstring with a description and an 'Args:' line per argument") from None
    return out


def parse_calls(text: str) -> list[tuple[str | None, dict | None, str | None]]:
    """Every call in ``text`` as (name, arguments, None), or (name or None, None, why it cannot be run)."""
    calls = []
    for body in _CALL.findall(text):
        try:
            parsed = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append((None, None, f"the tool call is not valid JSON ({e}): {body.strip()[:200]!r}"))
            continue
        for call in parsed if isinstance(parsed, list) else [parsed]:
            name = call.get("name") if isinstance(call, dict) else None
            if not isinstance(name, str):
                calls.append((None, None, f"a tool call is {{\"name\": ..., \"arguments\": {{...}}}}, got "
                                          f"{json.dumps(call)[:200]}"))
                continue
            args = call.get("arguments", {})
            if isinstance(args, str):  # OpenAI's wire form: the arguments as a JSON string
                try:
                    args = json.loads(args)
                except json.JSONDecodeError as e:
                    calls.append((name, None, f"the arguments of '{name}' are not valid JSON ({e})"))
                    continue
            if not isinstance(args, dict):
                calls.append((name, None, f"the arguments of '{name}' must be an object, got {json.dumps(args)}"))
                continue
            calls.append((name, args, None))
    return calls


class ToolEnv:
    """One episode of tool calls over the tools of ``module`` (env.tools)."""

    def __init__(self, module: str):
        self.module = module
        self.tools = load_tools(module)

    def reset(self, row: dict) -> None:
        return None  # the row's prompt as loaded (the chat template shows the tools)

    def run(self, name: str | None, args: dict | None, error: str | None) -> tuple[str, bool]:
        """A call's answer and whether it failed."""
        if error is not None:
            return f"error: {error}", True
        fn = self.tools.get(name)
        if fn is None:
            return f"error: unknown tool '{name}' (the tools are: {', '.join(self.tools)})", True
        try:
            inspect.signature(fn).bind(**args)
        except TypeError as e:
            return f"error: wrong arguments for '{name}': {e}", True
        try:
            return str(fn(**args)), False
        except Exception as e:
            return f"error: {name} raised {type(e).__name__}: {e}", True

    def step(self, action: Action) -> StepResult:
        calls = parse_calls(action.text)
        if not calls:
            return StepResult(None, None, True, {"tool_calls": 0, "tool_errors": 0})
        messages, errors = [], 0
        for name, args, error in calls:
            content, failed = self.run(name, args, error)
            errors += failed
            messages.append({"role": "tool", "name": name, "content": content} if name is not None
                            else {"role": "tool", "content": content})
        return StepResult(messages, None, False, {"tool_calls": len(calls), "tool_errors": errors})
