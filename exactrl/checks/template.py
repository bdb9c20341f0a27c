"""The start-up check that the chat template is append-only for the run's observations (env.render=template).

A multi-turn trajectory is built from ids, never re-rendered (envs/render.py): the prompt's render, each turn's
sampled ids, the closing the template puts after an assistant turn, each observation's delta. The check builds the
same text for a fixed conversation and compares it with the template's own render of the whole conversation so far:

    [system?, user, assistant, <role>, assistant, <role>, assistant]     for each role in ``roles``, with and without
                                                                         the system message (a template that refuses
                                                                         a system message is checked without it)

The first assistant turn holds a <think> block and a tool call, the second is plain, the last holds a <think> block
again: Qwen3's template drops past <think> blocks once a user message follows (prime-rl #1334, NeMo-RL #2822).

The rule. At every point where the policy generates (after the prompt and after each observation, rendered with
add_generation_prompt=True) and for the finished conversation (without it), the template's render must equal the
text the trajectory holds: the prompt's render, then per assistant turn its content and ObservationRenderer's
closing, per observation ObservationRenderer.delta_text. Then each render the policy sees is a prefix of the next and
the renderer's deltas are what the template appends. A render with an assistant turn last, which no policy reads
(the next one adds the observation), is only checked through the final conversation.

- Append-only: TemplateCheck(True, ...), and the rollout renders deltas.
- Not append-only: TemplateCheck(False, detail) naming the first turn the template renders differently from the
  trajectory and the differing text. The rollout prints it and continues: the trajectory holds what the policy saw,
  which is not what the template would render for the whole conversation at inference.
- No delta at all (the template raises on the role, or does not close an assistant turn the same way when an
  observation follows): RenderError, a one-line refusal naming env.render=text and data.chat_template.
"""

from __future__ import annotations

from dataclasses import dataclass

from exactrl.envs.render import ObservationRenderer, RenderError, render

SYSTEM = "You are a careful assistant."
USER = "What is 17 * 23?"
ASSISTANTS = [
    "<think>\nMultiplying by hand is error-prone.\n</think>\n\n"
    '<tool_call>{"name": "calc", "arguments": {"expression": "17*23"}}</tool_call>',
    "Let me check that once more.",
    "<think>\nThe tool agrees.\n</think>\n\nThe answer is 391.",
]
OBSERVATIONS = ["391", "391.0"]


@dataclass(frozen=True)
class TemplateCheck:
    append_only: bool
    detail: str  # append-only: what was checked; else the first turn that is not an extension and the differing text


def _conversation(role: str, system: bool) -> list[dict]:
    conv = [{"role": "system", "content": SYSTEM}] if system else []
    conv.append({"role": "user", "content": USER})
    for i, a in enumerate(ASSISTANTS):
        conv.append({"role": "assistant", "content": a})
        if i < len(OBSERVATIONS):
            conv.append({"role": role, "content": OBSERVATIONS[i]})
    return conv


def _first_difference(ours: str, theirs: str) -> int:
    n = min(len(ours), len(theirs))
    return next((i for i in range(n) if ours[i] != theirs[i]), n)


def _mismatch(conv: list[dict], upto: int, starts: list[tuple[int, int]], ours: str, theirs: str) -> str:
    """One line: which turn of ``conv`` the template renders differently once turns up to ``upto`` are there."""
    p = _first_difference(ours, theirs)
    turn = max((t for at, t in starts if at <= p), default=0)
    roles = ", ".join(m["role"] for m in conv[: upto + 1])
    return (f"turn {turn} ({conv[turn]['role']}) is not an extension: with turns [{roles}] the template renders "
            f"{theirs[max(p - 20, 0):p + 40]!r} where the trajectory holds {ours[max(p - 20, 0):p + 40]!r}")


def _check_one(renderer: ObservationRenderer, tokenizer, conv: list[dict], tools) -> str | None:
    """None if ``conv`` renders as the trajectory builds it, else the first mismatch."""
    first = next(i for i, m in enumerate(conv) if m["role"] == "assistant")
    ours = render(tokenizer, conv[:first], True, tools)
    starts = [(0, first - 1)]  # (where a turn's text starts in ours, the turn)
    for i in range(first, len(conv)):
        m = conv[i]
        starts.append((len(ours), i))
        if m["role"] == "assistant":
            ours += m["content"] + renderer.closing_text
            continue
        ours += renderer.delta_text([m])
        theirs = render(tokenizer, conv[: i + 1], True, tools)
        if theirs != ours:
            return _mismatch(conv, i, starts, ours, theirs)
    theirs = render(tokenizer, conv, False, tools)
    return None if theirs == ours else _mismatch(conv, len(conv) - 1, starts, ours, theirs)


def check_template(tokenizer, roles=("tool",), tools=None) -> TemplateCheck:
    """Whether the chat template is append-only for observations of ``roles`` (module docstring: the rule);
    RenderError if it cannot render them as a delta at all."""
    renderer = ObservationRenderer(tokenizer, "template", tools=tools)
    checked = 0
    for role in roles:
        for system in (True, False):
            conv = _conversation(role, system)
            if system:
                try:
                    render(tokenizer, conv[:2], True, tools)
                except RenderError:
                    continue  # a template without system messages: the data has none either
            try:
                bad = _check_one(renderer, tokenizer, conv, tools)
            except RenderError as e:
                way_out = "" if "env.render=text" in str(e) else (
                    ": use env.render=text (contents encoded as they are) or data.chat_template (one rendering them)")
                raise RenderError(f"env.render=template: {role!r} observations cannot be rendered as a delta of the "
                                  f"chat template: {e}{way_out}") from None
            if bad:
                return TemplateCheck(False, f"the chat template is not append-only for {role!r} observations: {bad}")
            checked += 1
    return TemplateCheck(True, f"the chat template is append-only for {', '.join(map(repr, roles))} observations "
                               f"({checked} conversations checked turn by turn)")
